-- Take grants of the name away: the one with token ARGV[1], or all if it is
-- empty. The old holder finds out at its next renewal or check; the next
-- grant's fence is higher, so its fenced writes are refused.
-- Returns how many grants ended.
local ended = 0
for i = 0, limit_of() - 1 do
  local key = slot_key(i)
  if (ARGV[1] == '' and redis.call('EXISTS', key) == 1) or held_by(key, ARGV[1]) then
    redis.call('DEL', key)
    ended = ended + 1
  end
end
if ended > 0 then wake_heads() end
return ended
