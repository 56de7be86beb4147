"""Concurrency limits and deduplication for task queues (Celery, ``django.tasks``).

``limit_concurrency("render:{user_id}", limit=2)`` decorates a task's function:
each run takes a slot of the semaphore named by the template, filled from the
run's own arguments, and gives it back however the run ends (success, failure,
a Celery retry or soft time limit). A run whose worker dies (SIGKILL at a hard
time limit, a revoke with ``terminate=True``, a lost host) holds a lease that
nobody renews: the slot is free again within one TTL. When every slot is taken,
``when_busy`` says what the run does: ``"retry"`` later with exponential
back-off (Celery), ``"skip"`` (the run returns ``None``), or ``"wait"`` for a
slot.

``enqueue_once(task, kwargs={"user_id": 7})`` enqueues only if no run
of the same key is queued or running. It takes a marker lease
(``djlocks:queued:<key>``, not renewed: it ends at ``queued_ttl`` at the
latest) and passes its token to the run, which gives the marker back once it
holds its running slot. From the enqueue to the end of the run's first attempt,
the marker or the running slot is held, so a second enqueue in between is
refused (a run retried after it started holds neither while it waits: see
docs/tasks.md).
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from djlocks.arguments import Seconds, normalize_delay, validate_limit, validate_name
from djlocks.backends import backends
from djlocks.core import Lock, Semaphore
from djlocks.exceptions import BackendUnavailable, LockError, LockLost, NotAcquired

task_log = logging.getLogger("djlocks.tasks")

F = TypeVar("F", bound=Callable[..., Any])
WhenBusy = Literal["retry", "skip", "wait"]
#: The keyword argument that carries the enqueue marker's token to the run.
QUEUED_TOKEN = "djlocks_queued"
#: The lock name of the marker of a key enqueued once: ``QUEUED_PREFIX + key``.
QUEUED_PREFIX = "djlocks:queued:"


class Busy(LockError):
    """Every slot was taken and the run cannot be retried later (not a Celery task)."""


def fill(
    template: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> str:
    """``template`` with ``{argument}`` fields filled from a call of ``func``.

    ``ValueError`` naming the fields if the call's arguments cannot fill it."""
    bound = inspect.signature(func).bind_partial(*args, **kwargs)
    bound.apply_defaults()
    try:
        return validate_name(template.format_map(bound.arguments))
    except (KeyError, IndexError, AttributeError) as exc:
        raise ValueError(
            f"The name template {template!r} needs {exc}, which is not an argument of "
            f"{func.__qualname__}{inspect.signature(func)}."
        ) from None


def limit_concurrency(
    name: str,
    *,
    limit: int = 1,
    when_busy: WhenBusy = "retry",
    retry_after: Seconds = 5.0,
    max_retry_after: Seconds = 300.0,
    timeout: Seconds | None = None,
    ttl: Seconds | None = None,
    backend: str = "default",
) -> Callable[[F], F]:
    """Decorate a task's function so that at most ``limit`` runs per filled name run at once.

    Arguments:
        name: a template filled from the run's arguments with ``str.format``
            (``"render:{user_id}"``); the result must be a valid lock name.
        limit: how many runs of one name may run at once (1: a lock).
        when_busy: ``"retry"``: raise Celery's ``Retry`` with a back-off of
            ``retry_after`` seconds doubled at each retry, at most ``max_retry_after``,
            less up to half at random, so that retries spread out (the task's own
            ``max_retries`` applies); outside a Celery worker it raises ``Busy``.
            ``"skip"``: return ``None`` without running. ``"wait"``: wait up to
            ``timeout`` seconds (``None``: forever), then raise ``NotAcquired``.
        ttl: seconds a dead worker's slot stays taken at most (default
            ``DJLOCKS["TTL"]``); renewed every ttl/3 while the run goes on.
        backend: an alias of ``DJLOCKS["BACKENDS"]``; a lease backend frees a dead
            worker's slot at its TTL, a session backend when the server sees the
            worker's connection close.

    Put it under the queue's decorator (``@app.task`` or ``@shared_task``, or
    ``django.tasks``' ``@task``), so that the queue runs the limited function.
    Raises ``ValueError`` for bad arguments, and at run time if the template
    cannot be filled.
    """
    if when_busy not in ("retry", "skip", "wait"):
        raise ValueError(f"when_busy must be 'retry', 'skip' or 'wait', not {when_busy!r}.")
    validate_limit(limit)
    base_delay = normalize_delay(retry_after, "retry_after")
    longest_delay = max(base_delay, normalize_delay(max_retry_after, "max_retry_after"))
    options: dict[str, Any] = {
        "backend": backend,
        "ttl": ttl,
        "timeout": timeout if when_busy == "wait" else 0,
    }
    spec = Lock(**options) if limit == 1 else Semaphore(limit=limit, **options)

    def decorate(func: F) -> F:
        if inspect.iscoroutinefunction(func):
            raise TypeError(
                f"limit_concurrency limits synchronous functions; {func.__qualname__} is "
                f"async. Take the slot inside it: `async with Semaphore(...)`."
            )
        _check_fields(name, func)

        @functools.wraps(func)
        def limited(*args: Any, **kwargs: Any) -> Any:
            queued = kwargs.pop(QUEUED_TOKEN, None)
            slot = spec.with_name(fill(name, func, args, kwargs))
            grant = slot.acquire_grant()
            if grant is None:
                try:
                    busy = _busy(slot, when_busy, base_delay, longest_delay)
                except BaseException as exc:
                    # Retried later, the run is still queued: it keeps the marker.
                    if queued is not None and not _is_celery_retry(exc):
                        _give_back_marker(slot.backend_alias, slot.name, queued)
                    raise
                if queued is not None:
                    _give_back_marker(slot.backend_alias, slot.name, queued)
                return busy
            try:
                if queued is not None:
                    _give_back_marker(slot.backend_alias, slot.name, queued)
                return func(*args, **kwargs)
            finally:
                grant.release()

        limited.djlocks_limit = Limit(name, backend)  # type: ignore[attr-defined]
        return cast(F, limited)

    return decorate


@dataclass(frozen=True)
class Limit:
    """What ``limit_concurrency`` put on a function: its name template and backend."""

    template: str
    backend: str


def _check_fields(template: str, func: Callable[..., Any]) -> None:
    """``ValueError`` if ``template`` names a field that is not an argument of ``func``."""
    parameters = inspect.signature(func).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    for _, field_name, _, _ in string.Formatter().parse(template):
        if field_name is None:
            continue
        argument = re.split(r"[.\[]", field_name, maxsplit=1)[0]
        if not argument or argument.isdigit():
            raise ValueError(
                f"The name template {template!r} must name arguments, as in "
                f"'render:{{user_id}}', not {{{field_name}}}."
            )
        if argument not in parameters and not takes_any:
            raise ValueError(
                f"The name template {template!r} needs {argument!r}, which is not an "
                f"argument of {func.__qualname__}{inspect.signature(func)}."
            )


def _busy(slot: Lock, when_busy: WhenBusy, base_delay: float, longest_delay: float) -> Any:
    """What a run does when every slot of its name is taken."""
    if when_busy == "skip":
        task_log.info("skipped a run: every slot of %r is taken", slot.name)
        return None
    if when_busy == "wait":
        raise NotAcquired(f"No slot of {slot.name!r} came free within {slot.timeout} s.")
    task = _current_celery_task()
    if task is None:
        raise Busy(
            f"Every slot of {slot.name!r} is taken, and this run cannot be retried later: "
            f"when_busy='retry' needs a Celery worker. Use 'skip' or 'wait' elsewhere."
        )
    doublings = min(task.request.retries or 0, 32)  # 2**32 x any delay is past the cap
    delay = min(longest_delay, base_delay * 2**doublings)
    countdown = delay * random.uniform(0.5, 1.0)
    task_log.info("every slot of %r is taken: retrying in %.1f s", slot.name, countdown)
    raise task.retry(countdown=countdown)


def _is_celery_retry(exc: BaseException) -> bool:
    """Whether ``exc`` is Celery's ``Retry``: the run will come back."""
    try:
        from celery.exceptions import Retry
    except ImportError:
        return False
    return isinstance(exc, Retry)


def _current_celery_task() -> Any:
    """The Celery task running in this worker now, or ``None`` (no Celery, not a worker)."""
    try:
        from celery import current_task
    except ImportError:
        return None
    request = getattr(current_task, "request", None)
    if current_task is None or request is None or getattr(request, "id", None) is None:
        return None
    if getattr(request, "is_eager", False):  # run in place (apply(), always-eager): no queue
        return None
    return current_task


def enqueue_once(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    queued_ttl: Seconds = 3600.0,
) -> Any:
    """Enqueue ``task`` with ``args`` and ``kwargs`` unless a run with the same name is
    queued or running; return what the queue returns (Celery's ``AsyncResult``,
    ``django.tasks``' ``TaskResult``), or ``None`` if one was already.

    The task's function must be decorated with ``limit_concurrency``, whose name
    template, filled from these arguments, and backend say which runs are the same
    (``ValueError`` otherwise); the run gives the marker back once it holds its slot.
    ``queued_ttl`` (seconds) bounds how long a marker whose run never started (a lost
    message, a purged queue) refuses new enqueues. Needs a lease backend, whose grants
    outlive their process (``ValueError`` otherwise). If the queue refuses the message,
    the marker is given back and the queue's error raised.
    """
    func, bound_args = _signature_of(task, tuple(args))
    limit: Limit | None = getattr(func, "djlocks_limit", None)
    if limit is None:
        raise ValueError(
            f"enqueue_once needs a task whose function is decorated with "
            f"limit_concurrency (under the queue's own decorator); {task!r} is not."
        )
    store = backends[limit.backend]
    if store.capabilities.crash_release != "ttl":
        raise ValueError(
            f"enqueue_once needs a lease backend (its marker outlives the enqueuing "
            f"process); {limit.backend!r} ends its grants with their session."
        )
    kwargs = dict(kwargs or {})
    name = fill(limit.template, func, bound_args, kwargs)
    marker = Lock(QUEUED_PREFIX + name, backend=limit.backend, ttl=queued_ttl, renew=False)
    grant = marker.acquire_grant(timeout=0)
    if grant is None:
        return None
    try:
        if store.holders(name):  # a run holds its slot: running
            grant.release()
            return None
        kwargs[QUEUED_TOKEN] = grant.token
        if hasattr(task, "apply_async"):
            queued = task.apply_async(tuple(args), kwargs)
        else:
            queued = task.enqueue(*args, **kwargs)
    except BaseException:
        grant.release()
        raise
    grant.hand_over()  # the run releases it
    return queued


def _signature_of(task: Any, args: tuple[Any, ...]) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The function whose signature names ``task``'s arguments, and the arguments to bind
    to it: Celery's ``run`` (without ``self`` when bound), ``django.tasks``' ``func``
    (after the context it is given when ``takes_context``), or a plain function."""
    if hasattr(task, "apply_async"):
        return task.run, args
    func = getattr(task, "func", task)
    return func, ((None, *args) if getattr(task, "takes_context", False) else args)


def _give_back_marker(backend: str, name: str, token: str) -> None:
    """The run holds its slot, or ends: end the marker its enqueue took, by its token.

    A marker already ended (its TTL, an earlier attempt of the same run) is fine; a
    store that cannot be reached leaves it to its TTL."""
    try:
        backends[backend].release(QUEUED_PREFIX + name, token, 0.0)
    except LockLost:
        pass
    except BackendUnavailable as exc:
        task_log.warning("could not give back the marker of %r (%s): it ends at its TTL", name, exc)
