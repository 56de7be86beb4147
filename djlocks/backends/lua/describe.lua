-- Everything an operator sees of one name, by Redis's clock, in one reply:
-- {now ms, name, limit, holders, cool-downs, waiters}. A holder is
-- {slot, token, fence, since, expires ms, host, pid, thread, label}; a
-- cool-down {slot, until ms}; a waiter, in queue order,
-- {since, host, pid, thread, label}. Dead waiters are dropped on the way.
local now_ms = clock()
local limit = limit_of()
local holders, cooling, waiting = {}, {}, {}
for i = 0, limit - 1 do
  local left = redis.call('PTTL', slot_key(i))
  if left >= 0 then
    local h = redis.call('HMGET', slot_key(i), 'token', 'fence', 'since', 'host', 'pid',
      'thread', 'label')
    holders[#holders + 1] = {i, h[1], h[2], h[3], now_ms + left, h[4], h[5], h[6], h[7]}
  end
  local cool = redis.call('PTTL', cool_key(i))
  if cool >= 0 then cooling[#cooling + 1] = {i, now_ms + cool} end
end
walk_queue(function(id)
  waiting[#waiting + 1] = redis.call('HMGET', waiter_key(id), 'since', 'host', 'pid', 'thread',
    'label')
  return false
end, math.huge)
return {now_ms, redis.call('HGET', meta, 'name') or '', limit, holders, cooling, waiting}
