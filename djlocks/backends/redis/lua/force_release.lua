-- Take grants of the name away: the one with token ARGV[1], or all if it is
-- empty. Each old holder is told on channel ARGV[2] ("<meta key> <fence>")
-- where it listens, else it finds out at its next renewal or check; the next
-- grant's fence is higher, so its fenced writes are refused.
-- Returns how many grants ended.
local ended = 0
for i = 0, limit_of() - 1 do
  local key = slot_key(i)
  local lease = ARGV[1] == '' and redis.call('GET', key) or held_by(key, ARGV[1])
  if lease then
    local secret, fence = string.match(lease, '^([^\n]*)\n([^\n]*)')
    redis.call('DEL', key, waiter_key(secret), asked_key(secret))
    redis.call('PUBLISH', ARGV[2], meta .. ' ' .. fence)
    ended = ended + 1
  end
end
if ended > 0 then hand_off() end
return ended
