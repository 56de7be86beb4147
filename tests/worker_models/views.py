"""Hold a lock in a request: ``?name=&ttl=&seconds=&kind=`` (see ``holding.work``)."""

from __future__ import annotations

import asyncio

from django.http import HttpRequest, JsonResponse

from djlocks import Lock, LockLost
from tests.worker_models.holding import hold, later, work


def _arguments(request: HttpRequest) -> tuple[str, float, float, str]:
    query = request.GET
    return query["name"], float(query["ttl"]), float(query["seconds"]), query["kind"]


def hold_view(request: HttpRequest) -> JsonResponse:
    return JsonResponse(hold(*_arguments(request)))


async def hold_async(request: HttpRequest) -> JsonResponse:
    """In the event loop: ``kind=await`` awaits ``asyncio.sleep``; any other kind blocks
    the loop itself while the lock is held."""
    name, ttl, seconds, kind = _arguments(request)
    fence = None
    try:
        async with Lock(name, ttl=ttl, timeout=30) as grant:
            fence, first_expiry = grant.fence, grant.expires_at
            if kind == "await":
                await asyncio.sleep(seconds)
            else:
                work(kind, seconds)
            renewed = later(grant.expires_at, first_expiry)
    except LockLost as lost:
        return JsonResponse({"fence": fence, "renewed": False, "lost": str(lost)})
    return JsonResponse({"fence": fence, "renewed": renewed, "lost": None})
