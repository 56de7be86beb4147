"""``Lock`` and ``Semaphore``: one object that is a context manager, a decorator
and a ``threading.Lock``-like handle."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, TypedDict, TypeVar, Unpack, cast, overload

from asgiref.sync import sync_to_async
from django.db import connections

from djlocks import metrics, tracing
from djlocks.arguments import (
    Seconds,
    function_lock_name,
    normalize_cooldown,
    normalize_max_hold,
    normalize_timeout,
    normalize_ttl,
    validate_label,
    validate_limit,
    validate_name,
)
from djlocks.async_waits import task_granted, wait_threads
from djlocks.backends import backends
from djlocks.backends.base import AcquireRequest, LockBackend
from djlocks.backends.waiting import Abort
from djlocks.conf import normalized_setting
from djlocks.events import events
from djlocks.exceptions import BackendUnavailable, LockLost, NotAcquired, NotHeld
from djlocks.forksafe import fork_safe_lock
from djlocks.grant import Grant
from djlocks.heartbeat import heartbeat
from djlocks.identity import Identity, current_identity, task_identity

acquire_log = logging.getLogger("djlocks.acquire")

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")
_USE_SPEC: Any = object()  # "use the timeout given to the spec"
LostCallback = Callable[[Grant, str], None]
#: What a decorated call does when the lock is not granted in time.
OnBusy = Literal["raise", "skip"]


class LockOptions(TypedDict, total=False):
    """The keyword arguments of ``Lock``, ``Semaphore``, ``db_lock`` and ``db_semaphore``."""

    timeout: Seconds | None
    ttl: Seconds | None
    cooldown: Seconds
    backend: str
    label: str | None
    renew: bool
    max_hold: Seconds | None
    on_lost: LostCallback | None
    on_busy: OnBusy


def _holder_key() -> tuple[int, int]:
    """Grants are held per thread and, within a thread, per asyncio task."""
    # The running loop, or None: not get_running_loop(), which raises without one
    # (what a lock taken outside asyncio would pay at every acquire and release).
    loop = asyncio.events._get_running_loop()
    task = None if loop is None else asyncio.current_task(loop)
    return threading.get_ident(), id(task)


def pop_held(held: dict[tuple[int, int], list[T]], guard: threading.Lock, owner: object) -> T:
    """What this thread or task filed last in ``held`` (by ``_holder_key``), taken out;
    ``NotHeld`` naming ``owner`` if it filed nothing."""
    key = _holder_key()
    with guard:
        stack = held.get(key)
        if not stack:
            raise NotHeld(f"{owner!r} is not held by this thread or task.")
        item = stack.pop()
        if not stack:
            del held[key]
        return item


class Lock:
    """A named lock shared by every process that uses the same backend.

    A spec: ``__init__`` does no I/O, so a ``Lock`` can be built at import time
    and shared between threads; each acquire's state lives in its ``Grant``.

    Arguments:
        name: non-empty ``str`` of at most 255 characters, any Unicode but NUL and
            lone surrogates (bytes that were not UTF-8). ``None`` is allowed
            only for the decorator form, which then uses ``module.qualname``.
        timeout: seconds to wait (int, float or ``timedelta``); ``None`` waits
            forever, ``0`` tries once.
        ttl: lease length in seconds for lease backends; default
            ``DJLOCKS["TTL"]``. Renewed every ttl/3 while held unless ``renew=False``.
        cooldown: seconds the slot stays unavailable after release (a cool-down:
            "not again within X seconds").
        backend: an alias of ``DJLOCKS["BACKENDS"]``.
        label: free text shown to operators, at most 255 characters, no NUL nor
            lone surrogates; default the process's command line (cut to 255
            characters, NUL and bytes that were not UTF-8 shown as escapes).
        renew: ``False`` turns the heartbeat off: the lease then ends at its TTL.
        max_hold: the longest, in seconds, that one grant may be held (default
            ``DJLOCKS["MAX_HOLD"]``, ``None``: no bound). Past it the heartbeat
            stops renewing and takes the grant back as a forced release would,
            so the next waiter gets it even if the holder hangs while renewing;
            the holder stops believing it holds it, ``on_lost`` gets the reason
            ``djlocks.grant.HELD_PAST_MAX_HOLD`` and ``check()`` and ``release()``
            raise ``LockLost``. With ``renew=False`` no heartbeat takes it back: the
            holder only stops believing (a lease still ends at its TTL). Needs a backend
            that can release by force (``ValueError`` at acquire otherwise; the
            setting does not apply to the others).
        on_lost: called as ``on_lost(grant, reason)`` when the grant is lost
            (at once where the store pushes a forced release: the lease backend on
            PostgreSQL, Redis; else at the next renewal), and when an operator asks
            for it back (a graceful release; ``reason`` is
            ``djlocks.grant.RELEASE_REQUESTED``, and the grant stays held until it is
            released or the operator's wait ends). May be called from djlocks'
            heartbeat thread.
        on_busy: what a call of a decorated function does when the lock is not
            granted within ``timeout``: ``"raise"`` (the default) raises
            ``NotAcquired``; ``"skip"`` returns ``None`` without running the
            function, as a cron-style "skip if already running" does. A ``with``
            block cannot be skipped, so ``"skip"`` is refused there with ``TypeError``.

    Raises ``ValueError``/``TypeError`` for bad arguments at construction, and
    ``ImproperlyConfigured`` for an unknown backend alias at first use.
    Not re-entrant: a second acquire in the same thread waits like any other
    process would.
    """

    limit = 1

    def __init__(
        self,
        name: str | None = None,
        *,
        timeout: Seconds | None = None,
        ttl: Seconds | None = None,
        cooldown: Seconds = 0,
        backend: str = "default",
        label: str | None = None,
        renew: bool = True,
        max_hold: Seconds | None = None,
        on_lost: LostCallback | None = None,
        on_busy: OnBusy = "raise",
    ) -> None:
        self._name = None if name is None else validate_name(name)
        self.timeout = normalize_timeout(timeout)
        self._ttl = None if ttl is None else normalize_ttl(ttl)
        self.cooldown = normalize_cooldown(cooldown)
        if not isinstance(backend, str) or not backend:
            raise ValueError(f"backend must be an alias of DJLOCKS['BACKENDS'], not {backend!r}.")
        self.backend_alias = backend
        self.label = validate_label(label)
        self.renew = renew
        self._max_hold = normalize_max_hold(max_hold)
        self.on_lost = on_lost
        if on_busy not in ("raise", "skip"):
            raise ValueError(f"on_busy must be 'raise' or 'skip', not {on_busy!r}.")
        self.on_busy = on_busy
        self._held: dict[tuple[int, int], list[Grant]] = {}
        self._held_guard = fork_safe_lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._name!r} backend={self.backend_alias!r}>"

    @property
    def name(self) -> str:
        if self._name is None:
            raise ValueError(
                "This lock has no name: pass one, e.g. Lock('reports:nightly'); only the "
                "decorator form can default the name to the function's module.qualname."
            )
        return self._name

    @property
    def ttl(self) -> float:
        return self._ttl if self._ttl is not None else normalized_setting("TTL", normalize_ttl)

    @property
    def max_hold(self) -> float | None:
        """The longest one grant may be held, in seconds (``None``: no bound); the
        spec's, else ``DJLOCKS["MAX_HOLD"]``."""
        if self._max_hold is not None:
            return self._max_hold
        default: float | None = normalized_setting("MAX_HOLD", normalize_max_hold)
        return default

    @property
    def backend(self) -> LockBackend:
        return backends[self.backend_alias]

    def with_name(self, name: str) -> Lock:
        """This spec with another name (no I/O): every other argument is kept.

        ``ValueError`` if ``name`` is not a valid name."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone._name = validate_name(name)
        clone._held = {}
        clone._held_guard = fork_safe_lock()
        return clone

    # -- threading.Lock-like handle ------------------------------------------

    def acquire(self, blocking: bool = True, timeout: Any = _USE_SPEC) -> bool:
        """Wait for the lock (or a slot); return ``True`` if granted, ``False`` on time-out.

        ``timeout`` overrides the spec's (seconds; ``None`` forever; ``0`` once);
        ``blocking=False`` is ``timeout=0``, and another timeout with it a ``ValueError``. Raises
        ``BackendUnavailable`` when the store cannot be reached, ``AlreadyHeld`` on a
        ``limit`` mismatch.
        """
        return self.acquire_grant(blocking, timeout) is not None

    def acquire_grant(
        self,
        blocking: bool = True,
        timeout: Any = _USE_SPEC,
        abort: Abort | None = None,
    ) -> Grant | None:
        """Like ``acquire()``, but return the ``Grant`` (``None`` on time-out).

        ``abort`` (``djlocks.backends.base.Abort``) set by another thread ends the wait
        early with ``None``. The grant is released with ``grant.release()``
        from any thread, or with ``release()`` from the acquiring one. A lease
        whose reply arrived after it could have run out (a stalled network or
        process) is given back and ``None`` returned: it must not be believed.
        """
        return self._traced(self._wait(blocking, timeout), abort, current_identity(self.label))

    def _wait(self, blocking: bool, timeout: Any) -> float | None:
        """The seconds an acquire with these arguments waits (``None``: forever).
        ``ValueError`` for a ``timeout`` other than 0 given with ``blocking=False``:
        the call would not wait it (``threading.Lock.acquire`` refuses even 0)."""
        if timeout is _USE_SPEC:
            return self.timeout if blocking else 0.0
        wait = normalize_timeout(timeout)
        if not blocking and wait != 0:
            raise ValueError(
                f"A timeout of {timeout!r} was given with blocking=False, which never waits: "
                f"pass one or the other (blocking=False is timeout=0)."
            )
        return wait

    def _traced(
        self,
        wait: float | None,
        abort: Abort | None,
        identity: Identity,
        began: float | None = None,
    ) -> Grant | None:
        """``_acquire_grant`` in its tracing span, which starts at ``began``."""
        with tracing.acquiring(self.backend_alias, self.name, self.limit, began) as traced:
            grant = self._acquire_grant(wait, abort, identity, began)
            traced(grant)
        return grant

    def _acquire_grant(
        self,
        wait: float | None,
        abort: Abort | None,
        identity: Identity,
        began: float | None = None,
    ) -> Grant | None:
        """``acquire_grant`` for a wait of ``wait`` seconds (``None``: forever), asked by
        ``identity`` at ``began`` (``time.monotonic()``; ``None``: now). An async
        acquire began when its task asked, before it queued for a wait thread: that
        queueing counts against its timeout, and as waiting in its metrics and history."""
        started = time.monotonic() if began is None else began
        deadline = None if wait is None else started + wait
        ttl = self.ttl
        backend = self.backend
        max_hold = self.max_hold
        if not backend.capabilities.forced_release:
            if self._max_hold is not None:
                raise ValueError(
                    f"{self!r}: backend {self.backend_alias!r} cannot take a grant back from "
                    f"its holder (no forced release), so it cannot end one held past "
                    f"max_hold. Leave max_hold out, or use another backend."
                )
            max_hold = None  # DJLOCKS["MAX_HOLD"] is for the backends that can take back
        request = AcquireRequest(
            name=self.name,
            limit=self.limit,
            ttl=ttl,
            cooldown=self.cooldown,
            identity=identity,
        )
        holder = _holder_key()  # read before the wait: after the grant, the next waits on it
        measured = metrics.waiting(self.backend_alias, self.name)
        try:
            record = backend.acquire(request, deadline, abort)
        except BaseException:
            measured(None, time.monotonic() - started)
            raise
        if record is None:
            acquire_log.debug("not acquired %s within %s s", self.name, wait)
            cancelled = abort is not None and abort.is_set()
            waited = time.monotonic() - started
            measured(False, waited)
            if backend.capabilities.history:
                events.not_acquired(self.backend_alias, request, waited, cancelled=cancelled)
            return None
        grant = Grant(self, backend, record, ttl, started, request.identity, self.on_lost, max_hold)
        if time.monotonic() >= grant.believe_until():
            # The reply took so long that the lease may already have run out (honest
            # belief, docs/guarantees.md): the caller must not believe it; give it back.
            acquire_log.warning(
                "the grant of %s arrived after its lease could have ended; given back", self.name
            )
            with contextlib.suppress(LockLost, BackendUnavailable):
                backend.release(self.name, record.token, 0)
            measured(False, time.monotonic() - started)
            return None
        grant.measured_as = measured(True, grant.waited)
        if self.renew:
            heartbeat.add(grant)
        with self._held_guard:
            self._held.setdefault(holder, []).append(grant)
        acquire_log.debug("acquired %s slot %s fence %s", self.name, grant.slot, grant.fence)
        return grant

    def release(self) -> None:
        """Release the most recent grant this thread (or task) holds through this handle.

        Raises ``NotHeld`` if it holds none, and ``LockLost`` if the grant had
        already ended (the lease expired or was released by force); the slot
        is free either way afterwards.
        """
        self._pop_current().end()

    def locked(self) -> bool:
        """True if any holder holds the name now (asks the store)."""
        return bool(self.backend.holders(self.name))

    # -- context manager -----------------------------------------------------

    def __enter__(self) -> Grant:
        self._refuse_skip_in_a_block()
        return self._granted_or_busy(self.acquire_grant(True, _USE_SPEC))

    def __exit__(self, *exc_info: Any) -> None:
        self._pop_current().end(exc_info)

    async def __aenter__(self) -> Grant:
        self._refuse_skip_in_a_block()
        grant = await self._aacquire_grant(True, _USE_SPEC)
        if grant is None:
            raise await self._anot_acquired()
        return grant

    async def __aexit__(self, *exc_info: object) -> None:
        await self.arelease()

    # -- async handle ----------------------------------------------------------

    async def aacquire(self, blocking: bool = True, timeout: Any = _USE_SPEC) -> bool:
        """``acquire()`` for async code: ``await lock.aacquire(timeout=5)``.

        Waits in one of djlocks' threads (``async_waits``), so the event loop keeps
        running; the grant is the awaiting task's (the session backends' deadlock
        check tells it from the thread's other tasks). Cancelling the awaiting task
        ends the wait (at once if it still queues for a thread) and gives back a grant
        that arrived meanwhile. Same arguments, result and exceptions as ``acquire()``, plus
        ``TypeError`` for a backend whose grants live in the calling thread's
        transaction (the row backend).
        """
        return await self._aacquire_grant(blocking, timeout) is not None

    async def arelease(self) -> None:
        """``release()`` for async code: release what this task acquired through this handle.

        Raises ``NotHeld`` and ``LockLost`` as ``release()`` does.
        """
        grant = self._pop_current()
        await sync_to_async(grant.end, thread_sensitive=False)()

    async def _aacquire_grant(self, blocking: bool, timeout: Any) -> Grant | None:
        if self.backend.capabilities.in_caller_transaction:
            raise TypeError(
                f"{self!r}: backend {self.backend_alias!r} keeps its grants in the calling "
                f"thread's database transaction, which async code does not have. Take it in "
                f"synchronous code, e.g. in a function run with "
                f"sync_to_async(thread_sensitive=True)."
            )
        abort = Abort()
        wait = self._wait(blocking, timeout)
        task = asyncio.current_task()
        identity = current_identity(self.label) if task is None else task_identity(self.label, task)
        queued = time.monotonic()
        # Taken by the wait thread as it starts the acquire, or first by a cancellation
        # while the acquire still queues for a thread: then it never starts.
        started = threading.Lock()

        def in_a_wait_thread() -> Grant | None:
            if not started.acquire(blocking=False):
                return None  # cancelled while queued
            return self._traced(wait, abort, identity, began=queued)

        attempt = asyncio.ensure_future(
            sync_to_async(in_a_wait_thread, thread_sensitive=False, executor=wait_threads())()
        )
        try:
            grant = await asyncio.shield(attempt)
        except asyncio.CancelledError:
            if started.acquire(blocking=False):
                raise  # no thread took it up: nothing waits, nothing to give back
            abort.set()
            try:
                late = await asyncio.shield(attempt)
            except asyncio.CancelledError:  # again: go now; a late grant is given back
                attempt.add_done_callback(_give_back_late_grant)
                raise
            if late is not None:
                await sync_to_async(late.release, thread_sensitive=False)()
            raise
        if grant is not None:
            self._move_to_current_task(grant)
            task_granted(grant)
        return grant

    def _granted_or_busy(self, grant: Grant | None) -> Grant:
        if grant is None:
            raise self._not_acquired()
        return grant

    async def _anot_acquired(self) -> NotAcquired:
        """``_not_acquired`` off the event loop (it may ask the store through the ORM), in
        a wait thread, whose Django connections it then closes: a thread's connection
        would otherwise stay open for the thread's life."""

        def off_the_loop() -> NotAcquired:
            try:
                return self._not_acquired()
            finally:
                connections.close_all()

        return await sync_to_async(off_the_loop, thread_sensitive=False, executor=wait_threads())()

    def _not_acquired(self) -> NotAcquired:
        """The ``NotAcquired`` of an acquire that timed out: it names the cool-down that
        holds the name's released slots back, if one does (asked of the store: a
        cool-down, unlike a holder, is easy to miss in the store's listings)."""
        message = f"{self.name!r} was not acquired within {self.timeout} s."
        backend = self.backend
        if backend.capabilities.cooldowns:
            try:
                cooling = backend.cooldowns(self.name)
            except Exception:  # the store failed meanwhile: the message says what it knows
                acquire_log.debug("cannot read the cool-downs of %s", self.name, exc_info=True)
                cooling = []
            if cooling:
                first = min(cooldown.until for cooldown in cooling)
                message += (
                    f" A cool-down (a release's cooldown) holds back {len(cooling)} of its "
                    f"released slot(s); the first can be granted again at "
                    f"{first.isoformat(sep=' ', timespec='seconds')}."
                )
        return NotAcquired(message)

    def _refuse_skip_in_a_block(self) -> None:
        if self.on_busy == "skip":
            raise TypeError(
                f"{self!r} has on_busy='skip', which only a decorated function can honour: "
                f"a with block cannot be skipped. Use `if lock.acquire(): ...` instead."
            )

    def forget(self, grant: Grant) -> None:
        """Stop filing ``grant`` under the thread or task that holds it (``Grant.release``)."""
        with self._held_guard:
            for key, stack in list(self._held.items()):
                if grant in stack:
                    stack.remove(grant)
                    if not stack:
                        del self._held[key]

    def _move_to_current_task(self, grant: Grant) -> None:
        """The grant arrived in a worker thread; file it under the awaiting task."""
        self.forget(grant)
        with self._held_guard:
            self._held.setdefault(_holder_key(), []).append(grant)

    def _pop_current(self) -> Grant:
        return pop_held(self._held, self._held_guard, self)

    # -- decorator -----------------------------------------------------------

    def __call__(self, func: F) -> F:
        """Decorate ``func`` so each call runs while holding the lock.

        A call not granted the lock within ``timeout`` raises ``NotAcquired``,
        or returns ``None`` without running ``func`` when ``on_busy="skip"``. A lock
        given no name is named after ``func`` (``arguments.function_lock_name``, whose
        ``ValueError`` for a function of a script or the shell is raised here).
        """
        spec = self if self._name is not None else self.with_name(function_lock_name(func))
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_locked(*args: Any, **kwargs: Any) -> Any:
                grant = await spec._aacquire_grant(True, _USE_SPEC)
                if grant is None and spec.on_busy != "skip":
                    raise await spec._anot_acquired()
                if not spec._granted_for_call(grant):
                    return None
                async with contextlib.AsyncExitStack() as releasing:
                    releasing.push_async_exit(spec)
                    return await func(*args, **kwargs)

            return cast(F, async_locked)

        @functools.wraps(func)
        def locked(*args: Any, **kwargs: Any) -> Any:
            if not spec._granted_for_call(spec.acquire_grant(True, _USE_SPEC)):
                return None
            with contextlib.ExitStack() as releasing:
                releasing.push(spec)
                return func(*args, **kwargs)

        return cast(F, locked)

    def _granted_for_call(self, grant: Grant | None) -> bool:
        """True if a decorated call may run; False to skip it (``on_busy="skip"``)."""
        if grant is None and self.on_busy == "skip":
            acquire_log.info("skipped a call: %r is busy", self.name)
            return False
        self._granted_or_busy(grant)
        return True


class Semaphore(Lock):
    """At most ``limit`` holders of ``name`` at once, across every process.

    Each holder gets one slot, its own lease with its own fence. Every caller
    of a name must pass the same ``limit``; a mismatch raises ``AlreadyHeld``.
    Other arguments as for ``Lock``.
    """

    def __init__(
        self, name: str | None = None, *, limit: int, **options: Unpack[LockOptions]
    ) -> None:
        super().__init__(name, **options)
        self.limit = validate_limit(limit)

    def __repr__(self) -> str:
        return f"<Semaphore {self._name!r} limit={self.limit} backend={self.backend_alias!r}>"


@overload
def db_lock(name: F) -> F: ...


@overload
def db_lock(name: str | None = None, **options: Unpack[LockOptions]) -> Lock: ...


def db_lock(name: str | Callable[..., Any] | None = None, **options: Any) -> Any:
    """Build a ``Lock``: ``with db_lock("x", timeout=10) as grant:`` or ``@db_lock("x")``.

    ``@db_lock`` with no arguments names the lock after the function it decorates
    (``module.qualname``). Keyword arguments are those of ``Lock``.
    """
    if callable(name):
        return Lock(None, **options)(name)
    return Lock(name, **options)


def db_semaphore(
    name: str | None = None, *, limit: int, **options: Unpack[LockOptions]
) -> Semaphore:
    """Build a ``Semaphore``: ``with db_semaphore("pdf-render", limit=5, ttl=60, timeout=30):``.

    Also a decorator, like ``db_lock``. Keyword arguments are those of ``Lock``.
    """
    return Semaphore(name, limit=limit, **options)


def _give_back_late_grant(attempt: asyncio.Future[Grant | None]) -> None:
    """The end of an async acquire cancelled twice while its wait ended: release the grant
    it got after all (in a wait thread), so that it is not renewed for nothing."""
    if attempt.cancelled() or attempt.exception() is not None:
        return
    late = attempt.result()
    if late is not None:
        wait_threads().submit(_release_logged, late)


def _release_logged(grant: Grant) -> None:
    try:
        grant.release()
    except Exception:
        acquire_log.warning(
            "could not give back %s, granted to a cancelled acquire", grant.name, exc_info=True
        )
