"""A view that renders at most three "PDFs" at once across every process."""

from __future__ import annotations

import time

from django.http import HttpRequest, HttpResponse

from djlocks import NotAcquired, db_semaphore


def render_pdf(request: HttpRequest) -> HttpResponse:
    try:
        with db_semaphore("pdf-render", limit=3, ttl=60, timeout=30) as grant:
            time.sleep(0.2)  # stands in for the slow renderer
            return HttpResponse(f"rendered in slot {grant.slot} with fence {grant.fence}\n")
    except NotAcquired:
        return HttpResponse("the renderer is busy; try again\n", status=503)
