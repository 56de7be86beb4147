-- Ask the holder of the grant with secret ARGV[1] to give it back (a graceful
-- release): its lease ends ARGV[2] ms from now at the latest, renewals stop
-- there (renew.lua), and its holder is told on channel ARGV[3] ("<meta key>
-- <fence>") where it listens. Returns how many grants were asked (0 or 1).
local wait = tonumber(ARGV[2])
for i = 0, limit_of() - 1 do
  local key = slot_key(i)
  local lease = held_by(key, ARGV[1])
  if lease then
    local left, asked = redis.call('PTTL', key), redis.call('PTTL', asked_key(ARGV[1]))
    if asked >= 0 and asked < wait then wait = asked end
    if left >= 0 and left < wait then wait = left end
    wait = math.max(1, wait)
    redis.call('PEXPIRE', key, wait)
    redis.call('SET', asked_key(ARGV[1]), '1', 'PX', wait)
    redis.call('PUBLISH', ARGV[3], meta .. ' ' .. string.match(lease, '^[^\n]*\n([^\n]*)'))
    return 1
  end
end
return 0
