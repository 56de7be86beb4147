-- Set the lease of the grant ARGV[1] on slot ARGV[2] to end ARGV[3] ms from
-- Redis's now; never re-claims an ended grant. The first renewal stamps the
-- server's run id on the grant; a later one on a restarted server (another
-- run id, the grant restored from disk) ends it instead. While an operator
-- asks for the grant back (request_release.lua), the lease is extended no
-- further than the operator's wait.
-- ARGV: 1 token, 2 slot, 3 ttl ms ('0': only check). Returns {1, expires ms}
-- | {0} (ended) | {-2} (Redis restarted since the grant was stamped) |
-- {3, expires ms, ms left} (renewed, and its release requested).
local key = slot_key(ARGV[2])
local lease = held_by(key, ARGV[1])
if not lease then return {0} end
local run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
local stamped = string.match(lease, '\n(%x+)$')
if stamped and #stamped == #run_id and stamped ~= run_id then
  redis.call('DEL', key)
  hand_off()
  return {-2}
end
local asked = redis.call('PTTL', asked_key(ARGV[1]))
local now_ms = clock()
if ARGV[3] == '0' then
  if asked >= 0 then
    local left = redis.call('PTTL', key)
    return {3, now_ms + left, left}
  end
  return {1, -1}
end
local ttl = tonumber(ARGV[3])
if asked >= 0 and asked < ttl then ttl = math.max(1, asked) end
if stamped ~= run_id then lease = lease .. '\n' .. run_id end
redis.call('SET', key, lease, 'PX', ttl)
if asked >= 0 then return {3, now_ms + ttl, ttl} end
return {1, now_ms + ttl}
