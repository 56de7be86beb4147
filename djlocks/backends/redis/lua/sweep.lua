-- Drop the name's dead waiters from its queue; returns how many.
local before = redis.call('ZCARD', queue)
walk_queue(function() return false end, math.huge)
return before - redis.call('ZCARD', queue)
