"""Django signals sent by djlocks."""

from django.dispatch import Signal

#: Sent when a holder learns its grant ended without its own release, and when an
#: operator asks for the grant back (a graceful release: ``reason`` is
#: ``djlocks.grant.RELEASE_REQUESTED``, and the grant stays held until released).
#: The sender is the class of the spec that held the grant (``Lock`` or
#: ``Semaphore``); keyword arguments: ``spec`` (that spec), ``grant`` (the
#: ``Grant``, with its ``name`` and ``fence``) and ``reason`` (str). It may be
#: sent from djlocks' heartbeat thread.
lock_lost = Signal()
