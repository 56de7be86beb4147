-- Make slot ARGV[1]'s cool-down end ARGV[2] ms from Redis's now ('0' clears
-- it). Returns the end in ms, 0 if cleared, or -1 if the name has no such slot.
local slot = tonumber(ARGV[1])
if slot < 0 or slot >= limit_of() then return -1 end
if ARGV[2] == '0' then
  redis.call('DEL', cool_key(slot))
  hand_off()
  return 0
end
redis.call('SET', cool_key(slot), '1', 'PX', ARGV[2])
local now_ms = clock()
return now_ms + tonumber(ARGV[2])
