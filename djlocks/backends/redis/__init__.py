"""The Redis backend: leases as Redis keys with a TTL, through django-redis.

Each operation is one Lua script (``djlocks/backends/redis/lua/``), loaded once and
called by SHA (redis-py's ``Script``), so every decision is atomic and judged
by Redis's own clock: a lease is a key whose ``PX`` expiry Redis enforces.
This follows the single-instance lock pattern of the Redis documentation
(``SET`` with ``PX`` and a random value; compare-and-delete in a script)
and adds what that pattern lacks: semaphore slots, a fair queue, fences,
cool-downs and the holder's identity.

* A slot is granted only when fewer live waiters are queued ahead than slots
  are free, so nobody barges past the queue. Waiters queue in a sorted set by
  ticket; each waiter's record expires ``WAITER_TTL`` seconds after its last
  attempt, so a dead waiter drops out on its own.
* A release hands the freed slot to the next live waiter in the same script
  (the grant is made there, with its fence) and pushes it to the waiter's own
  line (``lines``) or publishes it on the waiter's process's channel
  (``wakeups``): the waiter needs no further round trip. Waiters also retry
  every ``POLL_INTERVAL`` seconds at most, and when the soonest lease or
  cool-down ends, and find a hand-off whose message was lost in their record:
  a lost wake-up costs one poll, never a stranded waiter.
* A forced release, and a graceful release's request (which caps the lease
  at the operator's wait; renewals respect the cap), publish the grant on the
  revocations channel, where every holding process listens
  (``push.RedisListener``): the holder renews at once and so hears of it.
* The fence is one more than the name's last fence and never below Redis's
  clock in microseconds, so it keeps rising when Redis restarts empty. The
  first renewal stamps Redis's run id on the grant: a grant restored from
  disk by a restarted server is ended, and its holder told (``LockLost``).

What Redis cannot promise: a failover to a replica, or a restart that loses
writes (no ``appendfsync always``), can grant a name twice; fences, and the
``LockLost`` the holder then gets, are the defence. ``OPTIONS["wait_replicas"]``
narrows it: each grant and renewal counts only once that many replicas have it
(``WAIT``, in ``replicas``). A ``maxmemory-policy``
other than ``noeviction`` may evict leases (system check ``djlocks.W004``).
"""

from djlocks.backends.redis.backend import RedisBackend
from djlocks.backends.redis.protocol import PREFIX_CHARACTERS

__all__ = ["PREFIX_CHARACTERS", "RedisBackend"]
