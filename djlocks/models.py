"""djlocks' tables: lease slots and waiters, session and row locks' fences and holders, history.

``LockName`` has no table: it gives the admin dashboard its place in the admin
index, its permissions and the object of its ``LogEntry`` records.
"""

from __future__ import annotations

from django.db import models

from djlocks.kinds import Kind


class LeaseSlot(models.Model):
    """One slot of a lock (slot 0 only) or semaphore (slots 0 .. limit-1).

    A slot is held while ``token`` is set and ``expires_at`` lies in the future
    by the database's clock. Rows are created on first use and kept: ``fence``
    remembers the last fence issued on the slot, ``cooldown_until`` when the
    slot may be granted again after a release, ``release_by`` when a graceful
    release's wait ends.
    """

    key = models.CharField(
        max_length=64, db_column="name_key", help_text="SHA-256 of the name (djlocks.keys)."
    )
    name = models.CharField(max_length=255)
    slot = models.PositiveIntegerField()
    limit = models.PositiveIntegerField(db_column="slot_limit")
    token = models.CharField(max_length=32, null=True, blank=True)
    fence = models.BigIntegerField(default=0)
    acquired_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    cooldown_until = models.DateTimeField(null=True, blank=True)
    release_by = models.DateTimeField(
        null=True,
        blank=True,
        help_text="An operator asked the holder for the grant back (a graceful release): "
        "the lease ends by then at the latest, and renewals stop there.",
    )
    host = models.CharField(max_length=255, blank=True, default="")
    pid = models.IntegerField(null=True, blank=True)
    thread = models.CharField(max_length=100, blank=True, default="")
    label = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        db_table = "djlocks_lease_slot"
        # A constraint, not ``unique=True`` on the field: on PostgreSQL that also makes a
        # second index on ``token`` (for ``LIKE``), which every claim and release, each
        # changing the token, would write for nothing.
        constraints = [
            models.UniqueConstraint(fields=["key", "slot"], name="djlocks_slot_key"),
            models.UniqueConstraint(fields=["token"], name="djlocks_slot_token"),
        ]

    def __str__(self) -> str:
        return f"{self.name}[{self.slot}]"


class LeaseWaiter(models.Model):
    """A process waiting for a lease name; ``id`` is its ticket in the FIFO queue.

    The waiter refreshes ``expires_at`` while it waits; a record whose expiry
    has passed belongs to a process that died and is ignored.
    """

    key = models.CharField(max_length=64, db_column="name_key")
    name = models.CharField(max_length=255)
    host = models.CharField(max_length=255, blank=True, default="")
    pid = models.IntegerField()
    thread = models.CharField(max_length=100, blank=True, default="")
    label = models.CharField(max_length=255, blank=True, default="")
    since = models.DateTimeField()
    expires_at = models.DateTimeField()
    token = models.CharField(
        max_length=32,
        null=True,
        blank=True,
        help_text="The grant token a release hands the slot over with (where the store "
        "hands over: PostgreSQL, MySQL).",
    )
    ttl = models.FloatField(
        null=True, blank=True, help_text="The lease length (seconds) the waiter asked for."
    )
    slot_limit = models.IntegerField(
        null=True, blank=True, help_text="The number of slots the waiter asked for."
    )
    connection_id = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="The server session a release that concerns the waiter wakes: the one "
        "it listens on (PostgreSQL: NOTIFY on its own channel) or sleeps on (MySQL: "
        "KILL QUERY).",
    )

    class Meta:
        db_table = "djlocks_lease_waiter"
        indexes = [models.Index(fields=["key", "id"], name="djlocks_waiter_queue")]

    def __str__(self) -> str:
        return f"{self.name} waiter #{self.pk}"


class FenceCounter(models.Model):
    """The last fence issued for a name by a store whose locks the server holds.

    The lock itself lives in the database server (a session's named lock, a
    transaction's row lock); this row makes fences durable (each grant
    increments it, on djlocks' own connection, right after the server granted)
    and maps the server's keys back to names for holders and waiters. A new
    row's fence starts at the database server's clock in microseconds, so a
    name that ``djlocks sweep`` removed gets higher fences than it ever had.
    """

    key = models.CharField(max_length=64, primary_key=True, db_column="name_key")
    name = models.CharField(max_length=255)
    limit = models.PositiveIntegerField(db_column="slot_limit")
    fence = models.BigIntegerField(default=0)
    used_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The name's last grant (or its registration), by the database's clock: "
        "how long it has been idle.",
    )

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.name} fence {self.fence}"


class ServerHolder(models.Model):
    """Who was last granted a slot of a name by a store whose locks the server holds.

    Whether the grant is live is the server's truth (``IS_USED_LOCK``,
    ``pg_locks``, InnoDB's transactions); a row counts only while its
    ``connection_id`` still holds the slot there. It adds the identity the
    server does not know.
    """

    key = models.CharField(max_length=64, db_column="name_key")
    name = models.CharField(max_length=255)
    slot = models.PositiveIntegerField()
    limit = models.PositiveIntegerField(db_column="slot_limit")
    token = models.CharField(max_length=32)
    fence = models.BigIntegerField()
    connection_id = models.BigIntegerField()
    acquired_at = models.DateTimeField()
    host = models.CharField(max_length=255, blank=True, default="")
    pid = models.IntegerField()
    thread = models.CharField(max_length=100, blank=True, default="")
    label = models.CharField(max_length=255, blank=True, default="")

    class Meta:
        abstract = True

    def __str__(self) -> str:
        return f"{self.name}[{self.slot}] by connection {self.connection_id}"


class SessionFence(FenceCounter):
    """Fences of the session backends (GET_LOCK, advisory locks)."""

    class Meta:
        db_table = "djlocks_session_fence"


class SessionHolder(ServerHolder):
    """Holders of the session backends; ``connection_id`` is djlocks' own session."""

    class Meta:
        db_table = "djlocks_session_holder"
        constraints = [
            models.UniqueConstraint(fields=["key", "slot"], name="djlocks_session_holder_slot"),
            models.UniqueConstraint(fields=["token"], name="djlocks_session_holder_token"),
        ]


class RowFence(FenceCounter):
    """Fences of the row backend (``SELECT ... FOR UPDATE``)."""

    class Meta:
        db_table = "djlocks_row_fence"


class RowHolder(ServerHolder):
    """Holders of the row backend; ``connection_id`` is the caller's own connection."""

    class Meta:
        db_table = "djlocks_row_holder"
        constraints = [
            models.UniqueConstraint(fields=["key", "slot"], name="djlocks_row_holder_slot"),
            models.UniqueConstraint(fields=["token"], name="djlocks_row_holder_token"),
        ]


class RowLock(models.Model):
    """A row the row backend locks: slot 0 of a lock, slots 0 .. limit-1 of a semaphore.

    Never updated: a holder's transaction locks it with ``SELECT ... FOR
    UPDATE`` and the commit or rollback unlocks it. Created on first use
    (``INSERT`` that ignores duplicates) and kept.
    """

    key = models.CharField(max_length=64, db_column="name_key")
    slot = models.PositiveIntegerField()

    class Meta:
        db_table = "djlocks_row_lock"
        constraints = [models.UniqueConstraint(fields=["key", "slot"], name="djlocks_row_slot")]

    def __str__(self) -> str:
        return f"{self.key[:12]}[{self.slot}]"


class LockName(models.Model):
    """A lock or semaphore name as the dashboard shows it; the stores are the truth.

    No table (``managed = False``): instances are built by the dashboard for
    ``LogEntry`` records. ``view`` lets staff see the dashboard;
    ``force_release`` lets them take grants away and change cool-downs.
    """

    name = models.CharField(max_length=255, primary_key=True)
    backend = models.CharField(max_length=100)

    class Meta:
        managed = False
        db_table = "djlocks_dashboard_no_table"
        verbose_name = "lock or semaphore"
        verbose_name_plural = "locks and semaphores"
        default_permissions = ("view",)
        permissions = [("force_release", "Can force the release of a lock and change cool-downs")]

    def __str__(self) -> str:
        return f"{self.name} ({self.backend})"


class LockEvent(models.Model):
    """One thing that happened to a name: the history behind the dashboard's statistics.

    Written by djlocks on its own connection (never inside the caller's
    transaction), after the fact: a grant's ``acquired`` event is written with
    its end, in one round trip. Switched off with ``DJLOCKS["EVENTS"] = False``;
    ``djlocks sweep`` deletes events older than ``DJLOCKS["EVENTS_RETENTION"]``.
    """

    Kind = Kind

    at = models.DateTimeField(db_index=True)
    kind = models.CharField(max_length=20, choices=Kind.choices)
    backend = models.CharField(max_length=100)
    name = models.CharField(max_length=255)
    slot = models.PositiveIntegerField(null=True, blank=True)
    fence = models.BigIntegerField(null=True, blank=True)
    host = models.CharField(max_length=255, blank=True, default="")
    pid = models.IntegerField(null=True, blank=True)
    thread = models.CharField(max_length=100, blank=True, default="")
    label = models.CharField(max_length=255, blank=True, default="")
    waited = models.FloatField(
        null=True,
        blank=True,
        help_text="Seconds from the start of acquire to the grant or the give-up.",
    )
    held = models.FloatField(null=True, blank=True, help_text="Seconds from the grant to its end.")
    operator = models.CharField(
        max_length=150, blank=True, default="", help_text="Who forced a release or a cool-down."
    )
    reason = models.TextField(blank=True, default="")

    class Meta:
        db_table = "djlocks_event"
        indexes = [models.Index(fields=["name", "at"], name="djlocks_event_name_at")]
        verbose_name = "event"

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.name} {self.kind}"
