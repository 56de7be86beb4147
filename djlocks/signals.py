"""Django signals sent by djlocks."""

from django.dispatch import Signal

#: Sent when a holder learns its grant ended without its own release.
#: Keyword arguments: ``name`` (str), ``fence`` (int), ``reason`` (str).
#: The sender is the ``Lock``/``Semaphore`` spec that held the grant.
lock_lost = Signal()
