-- Drop the name's dead waiters from its queue. With ARGV[1] >= 0 (milliseconds),
-- also delete the name when it is idle: no lease, cool-down or live waiter, and
-- its last grant more than ARGV[1] ms ago. The last grant's moment is its fence,
-- never below Redis's clock in microseconds at the grant (see grant), so a name
-- that comes back is granted higher fences without its meta hash.
-- Returns {dead waiters dropped, 1 if the name was deleted else 0}.
local before = redis.call('ZCARD', queue)
walk_queue(function() return false end, math.huge)
local left = redis.call('ZCARD', queue)
local idle_ms = tonumber(ARGV[1])
if idle_ms < 0 or left > 0 then return {before - left, 0} end
for i = 0, limit_of() - 1 do
  if redis.call('EXISTS', slot_key(i), cool_key(i)) > 0 then return {before - left, 0} end
end
local _, now_us = clock()
if now_us - tonumber(redis.call('HGET', meta, 'fence') or '0') <= idle_ms * 1000 then
  return {before - left, 0}
end
redis.call('DEL', meta, queue)
return {before - left, 1}
