"""The operators' dashboard in the Django admin; importing it registers the read-only
views of djlocks' tables too (``table_admin``).

The dashboard hangs off ``LockName`` (a model without a table) through
``get_urls()``: the overview replaces its change list, and each page is wrapped
in ``admin_site.admin_view`` (staff login, CSRF, no caching). Seeing it takes
the ``djlocks.view_lockname`` permission; releasing by force and changing
cool-downs take ``djlocks.force_release``. Every forced action is confirmed
on its own page, sent as a POST, and recorded twice: as an admin ``LogEntry``
and as a ``LockEvent`` carrying the user and the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Page, Paginator
from django.db import DatabaseError
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone

from djlocks.arguments import validate_name
from djlocks.backends import backends
from djlocks.backends.base import HolderInfo
from djlocks.charts import histogram_svg, sparkline_svg, timeline_svg
from djlocks.dashboard import (
    SORTS,
    STATES,
    LeadershipSummary,
    NameSummary,
    Overview,
    ReadersWriterSummary,
    overview,
    select,
)
from djlocks.events import events, recent_events, statistics
from djlocks.exceptions import BackendUnavailable
from djlocks.inspection import (
    GRACEFUL_WAIT,
    Snapshot,
    force_release,
    public,
    request_release,
    snapshot,
)
from djlocks.models import LockName
from djlocks.moments import MomentEncoder, moment_text
from djlocks.stuck import stuck_holders
from djlocks.table_admin import ReadOnlyAdmin
from djlocks.timeline import average_waiters, distributions, timeline

PAGE_SIZE = 100
REFRESH_SECONDS = 5
RECENT_EVENTS = 50
PERIODS = {"1h": timedelta(hours=1), "24h": timedelta(days=1), "7d": timedelta(days=7)}
#: The spans a name's timeline can show (the last hour unless asked).
TIMELINES = {"10m": timedelta(minutes=10), "1h": timedelta(hours=1)}
#: The overview's sparklines of waiters: over the last hour, in 30 averages.
SPARKLINE_PERIOD = timedelta(hours=1)
SPARKLINE_POINTS = 30
View = Callable[..., HttpResponse]


class ReleaseForm(forms.Form):
    """The confirmation of a forced release: exactly the grants the operator was shown.

    ``fences`` carries the shown grants' fences (comma-separated): a grant that
    changed hands since the page was drawn has a new fence and is left alone.
    Where the backend can ask a holder to give its grant back (``graceful``),
    ``mode`` chooses that instead, and ``wait`` is the holder's time (seconds).
    """

    IMMEDIATE, GRACEFUL = "immediate", "graceful"

    fences = forms.CharField(widget=forms.HiddenInput)
    mode = forms.ChoiceField(
        choices=[
            (IMMEDIATE, "Immediate: take the grant away now"),
            (GRACEFUL, "Graceful: ask the holder to give it back"),
        ],
        initial=IMMEDIATE,
        required=False,
        widget=forms.RadioSelect,
    )
    wait = forms.FloatField(
        min_value=0.001,
        initial=GRACEFUL_WAIT,
        required=False,
        help_text="Graceful only: seconds the holder gets before the store ends its lease.",
    )
    reason = forms.CharField(
        max_length=500,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        help_text="Recorded with your user name in the history and the admin log.",
    )

    def __init__(self, *args: Any, graceful: bool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not graceful:
            del self.fields["mode"], self.fields["wait"]

    def graceful_wait(self) -> float | None:
        """The wait of a graceful release, or ``None`` for an immediate one (once valid)."""
        if self.cleaned_data.get("mode") != self.GRACEFUL:
            return None
        wait = self.cleaned_data.get("wait")
        return GRACEFUL_WAIT if wait is None else float(wait)

    def clean_fences(self) -> set[int]:
        text = self.cleaned_data["fences"]
        try:
            return {int(fence) for fence in text.split(",")}
        except ValueError as exc:
            raise forms.ValidationError(f"Fences are whole numbers, not {text!r}.") from exc


class CooldownForm(forms.Form):
    """Clear a slot's cool-down, or make it end a number of seconds from now."""

    seconds = forms.FloatField(
        min_value=0,
        max_value=365 * 24 * 3600,
        initial=0,
        help_text="0 clears the cool-down; otherwise it ends this many seconds from now.",
    )
    reason = forms.CharField(max_length=500, widget=forms.Textarea(attrs={"rows": 3, "cols": 60}))


@admin.register(LockName)
class DashboardAdmin(ReadOnlyAdmin):
    """Every lock and semaphore across backends: holders, waiters, history, forced release."""

    def get_urls(self) -> list[URLPattern]:
        def page(view: View) -> View:
            return self.admin_site.admin_view(view)

        changelist = f"{self.opts.app_label}_{self.opts.model_name}_changelist"
        return [
            path("", page(self.overview_view), name=changelist),
            path("overview.json", page(self.overview_json), name="djlocks_overview_json"),
            path("name/", page(self.name_view), name="djlocks_name"),
            path("name.json", page(self.name_json), name="djlocks_name_json"),
            path("release/", page(self.release_view), name="djlocks_release"),
            path("cooldown/", page(self.cooldown_view), name="djlocks_cooldown"),
        ]

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("djlocks.force_release")

    # -- the overview ---------------------------------------------------------

    def overview_view(self, request: HttpRequest) -> HttpResponse:
        page, query, found = self._overview_page(request)
        _warn_unavailable(request, found.unavailable)
        now = timezone.now()
        context = {
            **self._context(request, "Locks and semaphores"),
            "page": page,
            "rows": self._overview_rows(page, now),
            "leaderships": _linked(found.leaderships, now, query),
            "readers_writers": _linked(found.readers_writers, now, query),
            "query": query,
            "sorts": {key: _sort_link(query, key) for key in SORTS},
            "page_links": [
                (number, "?" + urlencode({**query, "page": number}) if number != "…" else "")
                for number in page.paginator.get_elided_page_range(page.number)
            ],
            "filters": {
                "backend": _filter_links(query, "backend", {a: a for a in backends.aliases()}),
                "state": _filter_links(query, "state", STATES),
            },
            "json_url": reverse("admin:djlocks_overview_json"),
        }
        return TemplateResponse(request, "admin/djlocks/dashboard/overview.html", context)

    def overview_json(self, request: HttpRequest) -> JsonResponse:
        page, query, found = self._overview_page(request)
        now = timezone.now()
        return JsonResponse(
            {
                "now": now,
                "count": page.paginator.count,
                "page": page.number,
                "pages": page.paginator.num_pages,
                "rows": self._overview_rows(page, now),
                "leaderships": _linked(found.leaderships, now, query),
                "readers_writers": _linked(found.readers_writers, now, query),
                "unavailable": found.unavailable,
            },
            encoder=MomentEncoder,
        )

    def _overview_page(self, request: HttpRequest) -> tuple[Page[Any], dict[str, str], Overview]:
        """A page of the overview's names, its query, and what the stores answered."""
        self._require(request, self.has_view_permission(request))
        query = {
            key: request.GET[key].strip()
            for key in ("q", "backend", "state", "o")
            if request.GET.get(key, "").strip()
        }
        backend = query.get("backend")
        if backend is not None and backend not in backends.aliases():
            raise Http404(f"No djlocks backend is configured under the alias {backend!r}.")
        found = overview(backend)
        rows = select(
            found.names,
            now=timezone.now(),
            search=query.get("q", ""),
            state=query.get("state", ""),
            order=query.get("o", "name"),
        )
        page = Paginator(rows, PAGE_SIZE).get_page(request.GET.get("page"))
        return page, query, found

    def _overview_rows(self, page: Page[Any], now: datetime) -> list[dict[str, Any]]:
        """The page's rows, each with its link and a sparkline of its waiters over the
        last hour (``SPARKLINE_PERIOD``, in ``SPARKLINE_POINTS`` averages)."""
        rows: list[NameSummary] = list(page.object_list)
        try:
            averages = average_waiters(
                [(row.backend, row.name) for row in rows],
                {(row.backend, row.name): row.waits_since for row in rows},
                now - SPARKLINE_PERIOD,
                now,
                SPARKLINE_POINTS,
            )
        except DatabaseError:  # the history's database: the stores' answers still show
            averages = {(row.backend, row.name): [] for row in rows}
        return [
            {
                **row.as_json(now),
                "url": _name_url(row.backend, row.name),
                "sparkline": sparkline_svg(
                    averages[row.backend, row.name], f"waiters of {row.name}, last hour"
                ),
            }
            for row in rows
        ]

    # -- one name -------------------------------------------------------------

    def name_view(self, request: HttpRequest) -> HttpResponse:
        data, found = self._name_data(request)
        _warn_unavailable(request, data["unavailable"])
        now, backend, name = data["now"], data["backend"], data["name"]
        span = request.GET.get("timeline", "1h")
        span = span if span in TIMELINES else "1h"
        start, limit = now - TIMELINES[span], data["limit"] or 1
        drawn = timeline(backend, name, limit, start, now, found.holders, found.waiters)
        waits, holds = distributions(backend, name, now - PERIODS[data["period"]])
        context = {
            **self._context(request, data["name"]),
            **data,
            "timeline": timeline_svg(drawn),
            "timelines": TIMELINES,
            "timeline_span": span,
            "wait_chart": histogram_svg(waits, "Waits"),
            "hold_chart": histogram_svg(holds, "Holds"),
            "periods": PERIODS,
            "json_url": reverse("admin:djlocks_name_json") + "?" + request.GET.urlencode(),
            "release_all_url": _action_url("admin:djlocks_release", data["backend"], data["name"]),
        }
        return TemplateResponse(request, "admin/djlocks/dashboard/name.html", context)

    def name_json(self, request: HttpRequest) -> JsonResponse:
        return JsonResponse(self._name_data(request)[0], encoder=MomentEncoder)

    def _name_data(self, request: HttpRequest) -> tuple[dict[str, Any], Snapshot]:
        """What the name's page shows, and the stores' answer it was made from."""
        self._require(request, self.has_view_permission(request))
        backend, name = _target(request.GET)
        period = request.GET.get("period", "24h")
        if period not in PERIODS:
            period = "24h"
        now = timezone.now()
        found = snapshot(name, backend)
        may_release = self.has_force_release_permission(request)
        holders = []
        stuck = stuck_holders(found.holders, now)
        for holder in found.holders:
            shown = public(holder)
            shown["expires_in"] = (
                None if holder.expires_at is None else (holder.expires_at - now).total_seconds()
            )
            shown["held_for"] = (now - holder.since).total_seconds()
            shown["usual_hold"] = stuck.get((holder.backend, holder.name, holder.slot))
            shown["stuck"] = shown["usual_hold"] is not None
            if may_release:
                shown["release_url"] = _action_url(
                    "admin:djlocks_release", backend, name, fence=holder.fence
                )
            holders.append(shown)
        holders.sort(key=lambda shown: not shown["stuck"])  # stuck first, else slot order
        waiters = [
            {**vars(waiter), "waited": (now - waiter.since).total_seconds()}
            for waiter in found.waiters
        ]
        cooldowns = []
        for cooling in found.cooldowns:
            shown = {**vars(cooling), "ends_in": (cooling.until - now).total_seconds()}
            if may_release:
                shown["change_url"] = _action_url(
                    "admin:djlocks_cooldown", backend, name, cooling.slot
                )
            cooldowns.append(shown)
        stats = statistics(backend, name, now - PERIODS[period])
        data = {
            "now": now,
            "backend": backend,
            "name": name,
            "grant_ends_with": (
                "" if found.unavailable else backends[backend].capabilities.grant_ends_with
            ),
            "limit": None if found.unavailable else _limit(backend, name, found.holders),
            "unavailable": found.unavailable,
            "holders": holders,
            "waiters": waiters,
            "cooldowns": cooldowns,
            "period": period,
            "statistics": vars(stats),
            "events": [
                {
                    "at": event.at,
                    "kind": event.get_kind_display(),
                    "slot": event.slot,
                    "fence": event.fence,
                    "host": event.host,
                    "pid": event.pid,
                    "label": event.label,
                    "waited": event.waited,
                    "held": event.held,
                    "operator": event.operator,
                    "reason": event.reason,
                }
                for event in recent_events(backend, name, RECENT_EVENTS)
            ],
        }
        return data, found

    # -- forced actions -------------------------------------------------------

    def release_view(self, request: HttpRequest) -> HttpResponse:
        """Confirm (GET) and perform (POST) the forced release of shown grants."""
        self._require(request, self.has_force_release_permission(request))
        backend, name = _target(request.GET)
        found = snapshot(name, backend)
        if found.unavailable:
            messages.error(request, f"Nothing was released: {found.unavailable[backend]}")
            return redirect(_name_url(backend, name))
        fence = request.GET.get("fence")
        shown = [h for h in found.holders if fence is None or str(h.fence) == fence]
        form = ReleaseForm(
            request.POST or None,
            initial={"fences": ",".join(str(h.fence) for h in shown)},
            graceful=backends[backend].capabilities.graceful_release,
        )
        if request.method == "POST" and form.is_valid():
            chosen = form.cleaned_data["fences"]
            self._release(
                request,
                backend,
                name,
                form.cleaned_data["reason"],
                [h for h in found.holders if h.fence in chosen],
                form.graceful_wait(),
            )
            return redirect(_name_url(backend, name))
        if not shown:
            messages.warning(request, f"Nobody holds {name!r} with that fence now.")
            return redirect(_name_url(backend, name))
        return self._confirmation(
            request,
            "release.html",
            f"Release {name}?",
            backend,
            name,
            form,
            holders=[public(holder) for holder in shown],
            effect=backends[backend].forced_release_effect,
        )

    def _release(
        self,
        request: HttpRequest,
        backend: str,
        name: str,
        reason: str,
        chosen: list[HolderInfo],
        wait: float | None,
    ) -> None:
        """Release ``chosen`` by force, or ask their holders to give them back within
        ``wait`` seconds (a graceful release); each grant is audited (``LogEntry`` and
        event) as it is done. Say on the page what was done, and what failed."""
        released: list[HolderInfo] = []
        done = "Forced release" if wait is None else f"Graceful release (within {wait:g} s)"

        def audited(holder: HolderInfo) -> None:
            released.append(holder)
            self.log_change(
                request,
                LockName(name=name, backend=backend),
                f"{done} of slot {holder.slot} (fence {holder.fence}) held by "
                f"{holder.host} pid {holder.pid}: {reason}",
            )

        user = request.user.get_username()
        try:
            if wait is None:
                force_release(chosen, reason=reason, operator=user, on_released=audited)
            else:
                request_release(
                    chosen, wait=wait, reason=reason, operator=user, on_requested=audited
                )
        except BackendUnavailable as exc:
            messages.error(request, f"The release stopped after {len(released)} grant(s): {exc}")
        else:
            gone = len(chosen) - len(released)
            if gone:
                messages.warning(request, f"{gone} grant(s) had already ended; nothing done there.")
        if released and wait is not None:
            messages.success(
                request,
                f"Asked {len(released)} holder(s) of {name!r} to give their grant back within "
                f"{wait:g} s; each slot is free when its holder has, or when that time is up.",
            )
        elif released:
            messages.success(request, f"Released {len(released)} grant(s) of {name!r} by force.")

    def cooldown_view(self, request: HttpRequest) -> HttpResponse:
        """Confirm (GET) and perform (POST) clearing or moving a slot's cool-down."""
        self._require(request, self.has_force_release_permission(request))
        backend, name = _target(request.GET)
        slot = _slot(request.GET.get("slot"))
        form = CooldownForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            seconds, reason = form.cleaned_data["seconds"], form.cleaned_data["reason"]
            store = backends[backend]
            try:
                until = store.set_cooldown(name, slot, seconds)
            except (ValueError, BackendUnavailable) as exc:
                messages.error(request, f"The cool-down was not changed: {exc}")
                return redirect(_name_url(backend, name))
            user = request.user.get_username()
            if store.capabilities.history:
                events.cooldown_changed(backend, name, slot, until, operator=user, reason=reason)
            change = f"until {moment_text(until)}" if until else "cleared"
            self.log_change(
                request,
                LockName(name=name, backend=backend),
                f"Cool-down of slot {slot} {change}: {reason}",
            )
            messages.success(request, f"The cool-down of {name!r} slot {slot} is {change}.")
            return redirect(_name_url(backend, name))
        return self._confirmation(
            request,
            "cooldown.html",
            f"Change the cool-down of {name}?",
            backend,
            name,
            form,
            slot=slot,
            cooldowns=[c for c in snapshot(name, backend).cooldowns if c.slot == slot],
        )

    # -- helpers --------------------------------------------------------------

    def _confirmation(
        self,
        request: HttpRequest,
        template: str,
        title: str,
        backend: str,
        name: str,
        form: forms.Form,
        **details: Any,
    ) -> TemplateResponse:
        """The page that asks before a forced action; its form POSTs back to the same URL."""
        context = {
            **self._context(request, title),
            "backend": backend,
            "name": name,
            "form": form,
            "name_url": _name_url(backend, name),
            **details,
        }
        return TemplateResponse(request, f"admin/djlocks/dashboard/{template}", context)

    def _context(self, request: HttpRequest, title: str) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.opts,
            "refresh_seconds": REFRESH_SECONDS,
            "may_release": self.has_force_release_permission(request),
        }

    @staticmethod
    def _require(request: HttpRequest, allowed: bool) -> None:
        if not allowed:
            raise PermissionDenied


def _target(params: Any) -> tuple[str, str]:
    """The ``backend`` alias and ``name`` a request is about; 404 if unknown or malformed."""
    backend = params.get("backend", "")
    if backend not in backends.aliases():
        raise Http404(f"No djlocks backend is configured under the alias {backend!r}.")
    try:
        return backend, validate_name(params.get("name", ""))
    except (TypeError, ValueError) as exc:
        raise Http404(str(exc)) from exc


def _slot(value: str | None) -> int:
    if value is None or not value.isdigit():
        raise Http404(f"slot must be a slot number, not {value!r}.")
    return int(value)


def _limit(backend: str, name: str, holders: list[HolderInfo]) -> int | None:
    if holders:
        return holders[0].limit
    return dict(backends[backend].names()).get(name)


def _linked(
    found: list[LeadershipSummary] | list[ReadersWriterSummary],
    now: datetime,
    query: dict[str, str],
) -> list[dict[str, Any]]:
    """The overview's leaderships or reader-writer locks that match the search, each
    linked to the page of the lock that shows its leader or writer."""
    search = query.get("q", "")
    return [
        {**summary.as_json(now), "url": _name_url(summary.backend, summary.lock_name)}
        for summary in found
        if not search or summary.matches(search)
    ]


def _warn_unavailable(request: HttpRequest, unavailable: dict[str, str]) -> None:
    """Say on the page which stores could not be asked (their rows are missing)."""
    for alias, reason in unavailable.items():
        messages.warning(request, f"Backend {alias!r} could not be asked: {reason}")


def _name_url(backend: str, name: str) -> str:
    return reverse("admin:djlocks_name") + "?" + urlencode({"backend": backend, "name": name})


def _action_url(
    view: str, backend: str, name: str, slot: int | None = None, *, fence: int | None = None
) -> str:
    params: dict[str, Any] = {"backend": backend, "name": name}
    if slot is not None:
        params["slot"] = slot
    if fence is not None:
        params["fence"] = fence
    return reverse(view) + "?" + urlencode(params)


def _filter_links(
    query: dict[str, str], key: str, choices: dict[str, str]
) -> list[tuple[str, str, bool]]:
    """(label, query string, selected) for "All" and each choice of the filter ``key``."""
    rest = {k: v for k, v in query.items() if k not in (key, "page")}
    links = [("All", "?" + urlencode(rest), key not in query)]
    for value, label in choices.items():
        links.append((label, "?" + urlencode({**rest, key: value}), query.get(key) == value))
    return links


def _sort_link(query: dict[str, str], key: str) -> str:
    """The query string that sorts by ``key``, descending if it is the current ascending sort."""
    order = f"-{key}" if query.get("o", "name") == key else key
    return "?" + urlencode({**{k: v for k, v in query.items() if k != "page"}, "o": order})
