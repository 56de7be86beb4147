-- A waiter gives up (time-out, cancellation) or an acquire ended in an
-- unknown state: remove the waiter and any grant of secret ARGV[1] (one a
-- release may have handed it meanwhile), and hand what that frees onward.
-- Returns how many grants it removed.
redis.call('ZREM', queue, ARGV[1])
redis.call('DEL', waiter_key(ARGV[1]), asked_key(ARGV[1]), line_key(ARGV[1]))
local removed = 0
for i = 0, limit_of() - 1 do
  if held_by(slot_key(i), ARGV[1]) then
    redis.call('DEL', slot_key(i))
    removed = removed + 1
  end
end
hand_off()
return removed
