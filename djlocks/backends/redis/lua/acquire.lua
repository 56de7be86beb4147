-- Try to take a slot of the name; one round trip that also issues the fence
-- and records the holder.
-- ARGV: 1 secret (the grant's, and the waiter's id), 2 limit, 3 ttl ms,
-- 4 mode ('try': never queue; 'join': queue if not granted; 'wait': already
-- queued), 5 waiter ttl ms, 6 wake-up channel ('': the waiter's line), 7 name,
-- 8 identity JSON.
-- Returns {1, slot, fence, expires ms} | {0, ms until a slot frees or -1} |
-- {-1, the limit other callers use}.
local secret, limit, mode = ARGV[1], tonumber(ARGV[2]), ARGV[4]
local record = waiter_key(secret)

-- What the waiter's line holds is a hand-off this attempt reads in the record (or
-- finds ended): never to be read again as a new one.
if mode ~= 'try' then redis.call('DEL', line_key(secret)) end

if mode == 'wait' then
  local waiting = redis.call('GET', record)
  if waiting and string.sub(waiting, 1, 8) == 'granted\n' then
    redis.call('DEL', record)
    local slot, fence, expires = string.match(waiting, '^granted\n(%d+)\n(%d+)\n(%d+)$')
    if held_by(slot_key(slot), secret) then return {1, tonumber(slot), fence, tonumber(expires)} end
    -- The handed lease ran out before its waiter came for it: queue again.
  end
end

local known = redis.call('HGET', meta, 'limit')
if not known then
  redis.call('HSET', meta, 'limit', limit, 'name', ARGV[7])
elseif tonumber(known) ~= limit then
  for i = 0, tonumber(known) - 1 do
    if redis.call('EXISTS', slot_key(i)) == 1 then return {-1, tonumber(known)} end
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
if #free > 0 and walk_queue(function(id) return id == secret end, #free) < #free then
  local fence, expires = grant(free[1], secret, ARGV[3], ARGV[8])
  if mode ~= 'try' then
    redis.call('ZREM', queue, secret)
    redis.call('DEL', record)
  end
  return {1, free[1], fence, expires}
end

if mode ~= 'try' then
  if redis.call('PEXPIRE', record, ARGV[5]) == 0 then
    local now_ms = clock()
    redis.call('SET', record, ARGV[6] .. '\n' .. now_ms .. '\n' .. ARGV[3] .. '\n' .. ARGV[8],
      'PX', ARGV[5])
  end
  if not redis.call('ZSCORE', queue, secret) then
    redis.call('ZADD', queue, redis.call('HINCRBY', meta, 'ticket', 1), secret)
  end
end
return {0, soonest or -1}
