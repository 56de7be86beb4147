-- End the grant whose token holds slot ARGV[2]; compare-and-delete, so a late
-- or retried release never frees a newer grant.
-- ARGV: 1 token, 2 slot, 3 cool-down ms (0: none). Returns 1, or 0 if the
-- grant had already ended. A queued waiter is handed the slot at once.
local key = slot_key(ARGV[2])
if not held_by(key, ARGV[1]) then return 0 end
redis.call('DEL', key, waiter_key(ARGV[1]), asked_key(ARGV[1]), line_key(ARGV[1]))
if ARGV[3] ~= '0' then
  redis.call('SET', cool_key(ARGV[2]), '1', 'PX', ARGV[3])
end
hand_off()
return 1
