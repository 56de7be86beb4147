"""Who is asking: the identity recorded with every grant and waiter."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import socket
import sys
import threading
import weakref
from dataclasses import dataclass

from djlocks.arguments import MAX_LABEL_LENGTH, storable
from djlocks.forksafe import fork_safe_lock


@dataclass(frozen=True)
class Identity:
    """Host, pid, thread and free-text label of a holder or waiter.

    ``thread`` is the thread's name and its operating-system id, ``"MainThread
    (tid 4242)"``: names need not be unique, ids are among live threads (the
    session backends find deadlocks between threads by it). An async acquire's
    names its task instead (``task_identity``).
    """

    host: str
    pid: int
    thread: str
    label: str


def current_identity(label: str | None) -> Identity:
    """Describe the calling thread; the label defaults to the process's command line.

    ``label`` must have passed ``validate_label``. The default label, the host and
    the thread's name are gathered, not given: they are made storable (NUL and
    bytes that were not UTF-8 become escapes) and cut to what the stores keep. A
    thread gathers them again only when its name, the label or the process (a
    fork) changed: the host and the command line are read once per thread and label.
    """
    thread_name = threading.current_thread().name
    asked = (thread_name, label, os.getpid())
    known: tuple[tuple[str, str | None, int], Identity] | None = getattr(_known, "last", None)
    if known is not None and known[0] == asked:
        return known[1]
    thread = storable(thread_name, 80)
    identity = Identity(
        host=storable(socket.gethostname(), 255),
        pid=os.getpid(),
        thread=f"{thread} {numbered(threading.get_native_id())}",
        label=label if label is not None else default_label(" ".join(sys.argv)),
    )
    _known.last = (asked, identity)
    return identity


def task_identity(label: str | None, task: asyncio.Task[object]) -> Identity:
    """Describe the asyncio ``task`` that acquires, from its event loop's thread: as
    ``current_identity``, with the task's name and number in place of the thread's id,
    ``"MainThread Task-5 (task 4294967301)"``, within ``THREAD_LENGTH``. An async grant
    is its task's, whichever thread its wait ran in: the session backends' deadlock
    check tells it from the thread's other tasks by that number."""
    identity = current_identity(label)
    thread = identity.thread.rsplit(" (tid ", 1)[0]
    suffix = f" {numbered(_task_number(task))}"
    described = f"{thread} {storable(task.get_name(), 40)}"[: THREAD_LENGTH - len(suffix)]
    return dataclasses.replace(identity, thread=described + suffix)


#: The longest ``thread`` the stores keep (the models' ``thread`` columns).
THREAD_LENGTH = 100
#: The first of the tasks' numbers, which count per process from 2**32 up: above every
#: thread id (Linux's are below 2**22), and short enough for a session's description
#: (PostgreSQL keeps 63 bytes).
FIRST_TASK_NUMBER = 1 << 32
_task_numbers: weakref.WeakKeyDictionary[asyncio.Task[object], int] = weakref.WeakKeyDictionary()
_next_task_number = itertools.count(FIRST_TASK_NUMBER)
_task_numbers_guard = fork_safe_lock()


def numbered(number: int) -> str:
    """How an identity's ``thread`` ends: ``(tid N)`` for a thread's operating-system id,
    ``(task N)`` for an asyncio task's number (``FIRST_TASK_NUMBER`` and up)."""
    return f"(task {number})" if number >= FIRST_TASK_NUMBER else f"(tid {number})"


def _task_number(task: asyncio.Task[object]) -> int:
    """``task``'s number in this process, given at its first acquire."""
    with _task_numbers_guard:
        number = _task_numbers.get(task)
        if number is None:
            number = _task_numbers[task] = next(_next_task_number)
        return number


#: Per thread: the last identity ``current_identity`` gathered, and what it was asked.
_known = threading.local()


def default_label(command_line: str) -> str:
    """The label of a holder that gave none: its command line, storable and cut to 255."""
    return storable(command_line, MAX_LABEL_LENGTH)
