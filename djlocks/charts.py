"""The dashboard's pictures as inline SVG: a name's timeline, wait and hold
distributions, and the overview's sparkline of waiters.

Drawn on the server from ``djlocks.timeline``'s spans, with no script and no
library: a ``<title>`` on each bar is its tooltip, and the admin's own colours
(its CSS variables, with fallbacks) keep the dark theme legible. Every text
that comes from the store or the history is escaped (``format_html``).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from djlocks.kinds import Kind
from djlocks.timeline import TIMELINE_EVENTS, Span, Timeline

#: The timeline's drawing, in SVG user units (it scales to the page's width).
WIDTH, LEFT, LANE, WAIT_ROW, AXIS = 960, 70, 20, 8, 22
#: Rows of waits drawn at most; more are summed up in a note.
WAIT_ROWS = 12
#: Fill of each ending; a grant still held has none.
FILLS: dict[str | None, str] = {
    None: "var(--primary, #79aec8)",
    Kind.RELEASED: "var(--secondary, #417690)",
    Kind.LOST: "var(--error-fg, #ba2121)",
    Kind.FORCED_RELEASE: "#e67e22",
    Kind.EXPIRED: "var(--body-quiet-color, #888)",
    Kind.ACQUIRED: "var(--body-quiet-color, #999)",
    Kind.TIMED_OUT: "var(--error-fg, #ba2121)",
    Kind.CANCELLED: "var(--body-quiet-color, #bbb)",
}
#: The distributions' buckets: upper bounds in seconds, and their labels.
BUCKETS = (
    (0.001, "<1 ms"),
    (0.01, "<10 ms"),
    (0.1, "<100 ms"),
    (1.0, "<1 s"),
    (10.0, "<10 s"),
    (60.0, "<1 min"),
    (600.0, "<10 min"),
    (float("inf"), "longer"),
)


def timeline_svg(drawn: Timeline) -> SafeString:
    """Each slot a lane of grants (a bar from acquire to its end, coloured by how it
    ended, marked where it was lost, released by force or expired), the waits
    stacked under the lanes, and a time axis."""
    span = max((drawn.end - drawn.start).total_seconds(), 1e-3)

    def x(moment: datetime) -> float:
        seconds = (moment - drawn.start).total_seconds()
        return LEFT + (WIDTH - LEFT - 10) * min(max(seconds / span, 0.0), 1.0)

    wait_rows = min(WAIT_ROWS, 1 + max((wait.lane for wait in drawn.waits), default=-1))
    waits_top = drawn.lanes * LANE + 8
    height = waits_top + max(wait_rows, 1) * WAIT_ROW + AXIS + 8
    parts = [
        format_html(
            '<text x="4" y="{}" class="djlocks-chart-label">slot {}</text>',
            lane * LANE + 14,
            lane,
        )
        for lane in range(drawn.lanes)
    ]
    parts.append(
        format_html(
            '<text x="4" y="{}" class="djlocks-chart-label">waits</text>', waits_top + WAIT_ROW
        )
    )
    parts += [_grant_bar(grant, x(grant.start), x(grant.end)) for grant in drawn.grants]
    shown = [wait for wait in drawn.waits if wait.lane < WAIT_ROWS]
    parts += [
        _bar(
            x(wait.start),
            waits_top + wait.lane * WAIT_ROW,
            x(wait.end),
            WAIT_ROW - 2,
            FILLS.get(wait.ending, FILLS[None]),
            wait.about,
        )
        for wait in shown
    ]
    if len(shown) < len(drawn.waits):
        parts.append(
            format_html(
                '<text x="{}" y="{}" class="djlocks-chart-label">+{} more waits</text>',
                WIDTH - 140,
                waits_top + wait_rows * WAIT_ROW + 10,
                len(drawn.waits) - len(shown),
            )
        )
    axis = height - AXIS
    parts.append(
        format_html(
            '<line x1="{}" y1="{}" x2="{}" y2="{}" class="djlocks-chart-axis"/>',
            LEFT,
            axis,
            WIDTH - 10,
            axis,
        )
    )
    for step in range(7):
        moment = drawn.start + (drawn.end - drawn.start) * step / 6
        ago = (drawn.end - moment).total_seconds()
        parts.append(
            format_html(
                '<text x="{}" y="{}" text-anchor="middle" class="djlocks-chart-label">{}</text>',
                round(x(moment), 1),
                axis + 16,
                "now" if ago < 1 else f"-{_duration(ago)}",
            )
        )
    return _svg(WIDTH, height, "timeline of grants and waits", parts)


def histogram_svg(values: Sequence[float], title: str) -> SafeString:
    """``values`` (seconds) counted into ``BUCKETS``: one labelled bar per bucket."""
    counts = [0] * len(BUCKETS)
    for value in values:
        counts[next(i for i, (bound, _) in enumerate(BUCKETS) if value < bound)] += 1
    tallest, width, height, bar = max(counts) or 1, 460, 150, 52
    parts = [
        format_html(
            '<text x="4" y="14" class="djlocks-chart-label">{} ({})</text>',
            title,
            f"the last {len(values):,}"
            if len(values) >= TIMELINE_EVENTS
            else f"{len(values)} in all",
        )
    ]
    for i, ((_, label), count) in enumerate(zip(BUCKETS, counts, strict=True)):
        left, tall = 8 + i * (bar + 4), 96 * count / tallest
        parts.append(
            _bar(left, 118 - tall, left + bar, tall, FILLS[Kind.RELEASED], f"{label}: {count}")
        )
        parts.append(
            format_html(
                '<text x="{}" y="{}" text-anchor="middle" class="djlocks-chart-label">{}</text>'
                '<text x="{}" y="134" text-anchor="middle" class="djlocks-chart-label">{}</text>',
                left + bar / 2,
                114 - tall,
                count or "",
                left + bar / 2,
                label,
            )
        )
    return _svg(width, height, title, parts)


def sparkline_svg(counts: Sequence[float], title: str) -> SafeString:
    """A small line of ``counts`` (oldest first), scaled to the largest."""
    width, height, top = 90, 18, max(counts, default=0) or 1
    step = width / max(len(counts) - 1, 1)
    points = " ".join(
        f"{i * step:.1f},{height - 2 - (height - 4) * count / top:.1f}"
        for i, count in enumerate(counts)
    )
    line = format_html('<polyline points="{}" class="djlocks-sparkline"/>', points)
    return _svg(width, height, title, [line], fixed=True)


def _grant_bar(grant: Span, left: float, right: float) -> SafeString:
    top = grant.lane * LANE + 3
    bar = _bar(left, top, right, LANE - 6, FILLS[grant.ending], grant.about)
    if grant.ending in (Kind.LOST, Kind.FORCED_RELEASE, Kind.EXPIRED):
        mark = format_html(
            '<path d="M{} {} l6 6 m0 -6 l-6 6" class="djlocks-chart-mark"/>',
            round(right - 3, 1),
            top + 4,
        )
        return bar + mark  # both safe: still a SafeString
    return bar


def _bar(left: float, top: float, right: float, height: float, fill: str, about: str) -> SafeString:
    return format_html(
        '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}</title></rect>',
        round(left, 1),
        round(top, 1),
        round(max(right - left, 1.5), 1),
        round(height, 1),
        fill,
        about,
    )


def _svg(
    width: int, height: float, title: str, parts: list[SafeString], *, fixed: bool = False
) -> SafeString:
    size = format_html(' width="{}" height="{}"', width, round(height)) if fixed else ""
    return format_html(
        '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {} {}"{} role="img" '
        'class="djlocks-chart" aria-label="{}"><title>{}</title>{}</svg>',
        width,
        round(height),
        size,
        title,
        title,
        format_html_join("", "{}", ((part,) for part in parts)),
    )


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.3g} h"
    if seconds >= 60:
        return f"{seconds / 60:.3g} min"
    return f"{seconds:.3g} s"
