-- A waiter gives up (time-out, cancellation) or an acquire ended in an
-- unknown state: remove waiter ARGV[2] and any grant of token ARGV[1], then
-- pass the wake-up on, so the next waiter is not left behind this one.
-- Returns how many grants it removed.
redis.call('ZREM', queue, ARGV[2])
redis.call('DEL', waiter_key(ARGV[2]))
local removed = 0
for i = 0, limit_of() - 1 do
  if held_by(slot_key(i), ARGV[1]) then
    redis.call('DEL', slot_key(i))
    removed = removed + 1
  end
end
wake_heads()
return removed
