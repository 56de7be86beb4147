-- Try to take a slot of the name; one round trip that also issues the fence
-- and records the holder.
-- ARGV: 1 token, 2 limit, 3 ttl ms, 4 waiter id, 5 mode ('try': never queue;
-- 'join': queue if not granted; 'wait': already queued), 6 waiter ttl ms,
-- 7 wake-up channel, 8 name, 9 identity JSON.
-- Returns {1, slot, fence, expires ms} | {0, ms until a slot frees or -1} |
-- {-1, the limit other callers use}.
local token, limit, wid, mode = ARGV[1], tonumber(ARGV[2]), ARGV[4], ARGV[5]

local known = redis.call('HMGET', meta, 'limit', 'fence')
if not known[1] then
  redis.call('HSET', meta, 'limit', limit, 'name', ARGV[8])
elseif tonumber(known[1]) ~= limit then
  for i = 0, tonumber(known[1]) - 1 do
    if redis.call('EXISTS', slot_key(i)) == 1 then return {-1, tonumber(known[1])} end
  end
  redis.call('HSET', meta, 'limit', limit)
end

-- Free slots (neither held nor cooling), and the ms until the soonest other ends.
local free, soonest = {}, nil
for i = 0, limit - 1 do
  if redis.call('EXISTS', slot_key(i), cool_key(i)) == 0 then
    free[#free + 1] = i
  else
    local left = math.max(redis.call('PTTL', slot_key(i)), redis.call('PTTL', cool_key(i)))
    if left >= 0 and (soonest == nil or left < soonest) then soonest = left end
  end
end

-- Grant only if fewer live waiters are ahead than slots are free: nobody
-- barges past the queue. A caller not in the queue has every waiter ahead.
if #free > 0 and walk_queue(function(id) return id == wid end, #free) < #free then
  local now_ms, now_us = clock()
  -- Never below the last fence, and never below Redis's clock in
  -- microseconds: a Redis that restarts empty still issues higher fences.
  local fence = string.format('%.0f', math.max(tonumber(known[2] or '0') + 1, now_us))
  redis.call('HSET', meta, 'fence', fence)
  local lease = token .. '\n' .. fence .. '\n' .. now_ms .. '\n' .. ARGV[9]
  redis.call('SET', slot_key(free[1]), lease, 'PX', ARGV[3])
  if mode ~= 'try' then
    redis.call('ZREM', queue, wid)
    redis.call('DEL', waiter_key(wid))
  end
  return {1, free[1], fence, now_ms + tonumber(ARGV[3])}
end

if mode ~= 'try' then
  local record = waiter_key(wid)
  if redis.call('PEXPIRE', record, ARGV[6]) == 0 then
    local now_ms = clock()
    redis.call('SET', record, ARGV[7] .. '\n' .. now_ms .. '\n' .. ARGV[9], 'PX', ARGV[6])
  end
  if not redis.call('ZSCORE', queue, wid) then
    redis.call('ZADD', queue, redis.call('HINCRBY', meta, 'ticket', 1), wid)
  end
end
return {0, soonest or -1}
