"""What Redis says of the names: holders, waiters and cool-downs, by ``SCAN`` and a script."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from djlocks.backends.base import CooldownInfo, HolderInfo, WaiterInfo, in_queue_order
from djlocks.backends.redis.protocol import SCAN_BATCH, moment, text, token_of
from djlocks.backends.redis.store import STORE_ERRORS, RedisStore


class RedisInspection(RedisStore):
    """Every name's meta key by ``SCAN``, each described by one script call (pipelined)."""

    def _meta_keys(self) -> Iterator[str]:
        """Every name's meta key, by ``SCAN`` (never ``KEYS``: it blocks the server)."""
        try:
            for key in self.redis().scan_iter(match=f"{self.prefix}:{{*}}:m", count=SCAN_BATCH):
                yield text(key)
        except STORE_ERRORS as exc:
            raise self._unavailable(exc) from exc

    def _described(self, name: str | None) -> list[Sequence[Any]]:
        """The describe script's reply for ``name``, or for every name."""
        if name is not None:
            return [self._run("describe", name)]
        replies = self._on_every_name("describe")
        return sorted(replies, key=lambda reply: text(reply[1]))

    def _on_every_name(self, script: str, *args: int) -> list[Sequence[Any]]:
        """``script``'s reply for every name's meta key, ``SCAN_BATCH`` calls per pipeline
        (one call at a time on a cluster, whose pipelines run no scripts)."""
        keys = list(self._meta_keys())
        if self.on_a_cluster:
            return [self._call(script, key, *args) for key in keys]
        replies: list[Sequence[Any]] = []
        for start in range(0, len(keys), SCAN_BATCH):
            try:
                with self.redis().pipeline(transaction=False) as pipe:
                    for key in keys[start : start + SCAN_BATCH]:
                        self._scripts[script](keys=[key], args=list(args), client=pipe)
                    replies.extend(pipe.execute())
            except STORE_ERRORS as exc:
                raise self._unavailable(exc) from exc
        return replies

    def holders(self, name: str | None = None) -> list[HolderInfo]:
        holders = []
        for reply in self._described(name):
            for slot, lease, expires in reply[3]:
                secret, fence, since, identity = text(lease).split("\n", 3)
                host, pid, thread, label = json.loads(identity.split("\n")[0])
                holders.append(
                    HolderInfo(
                        name=text(reply[1]),
                        backend=self.alias,
                        slot=int(slot),
                        limit=int(reply[2]),
                        host=host,
                        pid=pid,
                        thread=thread,
                        label=label,
                        since=moment(since),
                        expires_at=moment(expires),
                        fence=int(fence),
                        token=token_of(secret, int(slot)),
                    )
                )
        return holders

    def cooldowns(self, name: str | None = None) -> list[CooldownInfo]:
        return [
            CooldownInfo(
                name=text(reply[1]), backend=self.alias, slot=int(slot), until=moment(until)
            )
            for reply in self._described(name)
            for slot, until in reply[4]
        ]

    def waiters(self, name: str | None = None) -> list[WaiterInfo]:
        waiting = []
        for reply in self._described(name):
            for record in reply[5]:
                _, since, _, identity = text(record).split("\n", 3)
                host, pid, thread, label = json.loads(identity)
                waiting.append((text(reply[1]), host, pid, thread, label, moment(since)))
        return in_queue_order(self.alias, waiting)

    def names(self) -> list[tuple[str, int]]:
        return [(text(reply[1]), int(reply[2])) for reply in self._described(None)]

    def sweep(self, idle_names: float | None = None) -> dict[str, int]:
        """Drop dead waiters from every queue; with ``idle_names`` (seconds), delete the
        keys of names with no lease, cool-down or waiter whose last grant is older.

        Leases and cool-downs need no sweeping: Redis deletes them at their
        TTL. Such expiries leave no ``expired`` event (the key is gone before
        anyone looks); the holder records a ``lost`` event when it notices. A
        deleted name's fences live on in Redis's clock: every fence is at least
        the clock in microseconds at its grant (see ``lua/prelude.lua``).
        """
        idle_ms = -1 if idle_names is None else round(idle_names * 1000)
        replies = self._on_every_name("sweep", idle_ms)
        swept = {"dead waiters": sum(int(dead) for dead, _ in replies)}
        if idle_names is not None:
            swept["idle names"] = sum(int(deleted) for _, deleted in replies)
        return swept
