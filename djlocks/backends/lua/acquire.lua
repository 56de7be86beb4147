-- Try to take a slot of the name; one round trip that also issues the fence
-- and records the holder.
-- ARGV: 1 token, 2 limit, 3 ttl ms, 4 waiter id, 5 mode ('try': never queue;
-- 'join': queue if not granted; 'wait': already queued), 6 waiter ttl ms,
-- 7 wake-up channel, 8 name, 9 host, 10 pid, 11 thread, 12 label.
-- Returns {1, slot, fence, expires ms} | {0, ms until a slot frees or -1} |
-- {-1, the limit other callers use}.
local token, limit, wid, mode = ARGV[1], tonumber(ARGV[2]), ARGV[4], ARGV[5]

local known = redis.call('HGET', meta, 'limit')
if not known then
  redis.call('HSET', meta, 'limit', limit, 'name', ARGV[8])
elseif tonumber(known) ~= limit then
  for i = 0, tonumber(known) - 1 do
    if redis.call('EXISTS', slot_key(i)) == 1 then return {-1, tonumber(known)} end
  end
  redis.call('HSET', meta, 'limit', limit)
end

local free, soonest = free_slots(limit)
if #free > 0 then
  -- Grant only if fewer live waiters are ahead than slots are free: nobody
  -- barges past the queue. A caller not in the queue has every waiter ahead.
  local ahead = walk_queue(function(id) return id == wid end, #free)
  if ahead < #free then
    local slot = free[1]
    local now_ms, now_us = clock()
    -- Never below the last fence, and never below Redis's clock in
    -- microseconds: a Redis that restarts empty still issues higher fences.
    local fence = math.max(tonumber(redis.call('HGET', meta, 'fence') or '0') + 1, now_us)
    local fence_text = string.format('%.0f', fence)
    redis.call('HSET', meta, 'fence', fence_text)
    local key = slot_key(slot)
    redis.call('HSET', key, 'token', token, 'fence', fence_text, 'since', now_ms,
      'host', ARGV[9], 'pid', ARGV[10], 'thread', ARGV[11], 'label', ARGV[12])
    redis.call('PEXPIRE', key, ARGV[3])
    if mode ~= 'try' then
      redis.call('ZREM', queue, wid)
      redis.call('DEL', waiter_key(wid))
    end
    return {1, slot, fence_text, now_ms + tonumber(ARGV[3])}
  end
end

if mode ~= 'try' then
  local record = waiter_key(wid)
  if redis.call('EXISTS', record) == 0 then
    local now_ms = clock()
    redis.call('HSET', record, 'channel', ARGV[7], 'since', now_ms,
      'host', ARGV[9], 'pid', ARGV[10], 'thread', ARGV[11], 'label', ARGV[12])
  end
  redis.call('PEXPIRE', record, ARGV[6])
  if not redis.call('ZSCORE', queue, wid) then
    redis.call('ZADD', queue, redis.call('HINCRBY', meta, 'ticket', 1), wid)
  end
end
return {0, soonest or -1}
