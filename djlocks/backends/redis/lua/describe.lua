-- Everything an operator sees of one name, by Redis's clock, in one reply:
-- {now ms, name, limit, holders, cool-downs, waiters}. A holder is
-- {slot, lease value, expires ms}; a cool-down {slot, until ms}; a waiter,
-- in queue order, its record's value. Dead waiters are dropped on the way.
local now_ms = clock()
local limit = limit_of()
local holders, cooling, waiting = {}, {}, {}
for i = 0, limit - 1 do
  local lease = redis.call('GET', slot_key(i))
  local left = redis.call('PTTL', slot_key(i))
  if lease and left >= 0 then holders[#holders + 1] = {i, lease, now_ms + left} end
  local cool = redis.call('PTTL', cool_key(i))
  if cool >= 0 then cooling[#cooling + 1] = {i, now_ms + cool} end
end
walk_queue(function(id)
  local record = redis.call('GET', waiter_key(id))
  if record then waiting[#waiting + 1] = record end
  return false
end, math.huge)
return {now_ms, redis.call('HGET', meta, 'name') or '', limit, holders, cooling, waiting}
