"""The kinds of event in a lock's history, beside the models that store them."""

from __future__ import annotations

from django.db import models


class Kind(models.TextChoices):
    """What happened: the values of ``LockEvent.kind``."""

    ACQUIRED = "acquired", "acquired"
    RELEASED = "released", "released"
    TIMED_OUT = "timed_out", "timed out"
    CANCELLED = "cancelled", "cancelled"
    LOST = "lost", "lost"
    EXPIRED = "expired", "expired"
    FORCED_RELEASE = "forced_release", "forced release"
    RELEASE_REQUESTED = "release_requested", "release requested"
    COOLDOWN_CHANGED = "cooldown_changed", "cool-down changed"
