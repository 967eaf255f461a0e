"""The prefix-index interface every backend and wrapper implements."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class PrefixIndexBackend(Protocol):
    """Which worker holds which KV block, and, per worker, how long a prompt's cached
    prefix is there. Block hashes are the 64-bit chain values of :mod:`common.hashing`.

    Rules every implementation keeps (``tests/contract`` checks them on each backend):

    - every method may be called from any thread;
    - a remote backend blocks on its round trip and raises its client's error (for
      Redis, ``redis.RedisError``) when it cannot answer; an in-process one does neither;
    - ``lookup`` and ``blocks_of`` never mutate; the other three do, and are idempotent
      (publishing a block twice, or evicting one not held, changes nothing);
    - the index is advisory: a stale entry costs a cache miss, never a wrong token.
    """

    def publish(self, worker: str, stored: Iterable[int] = (),
                evicted: Iterable[int] = ()) -> None:
        """Apply one batch of ``worker``'s events, evictions after stores, all or none
        visible to a concurrent ``lookup``."""
        ...

    def purge(self, worker: str) -> int:
        """Forget every block of ``worker`` at once (it died or restarted); returns how
        many it held."""
        ...

    def replace(self, worker: str, held: Iterable[int]) -> None:
        """Make ``held`` the whole of ``worker``'s state (a resync after an outage)."""
        ...

    def lookup(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per worker, how many *leading* blocks of ``block_hashes`` it holds: a worker
        that lacks block i is credited with at most i, whatever it holds after. The walk
        stops at the first block no worker still in the running holds; workers that
        lack the first block are absent; an empty list gives ``{}``."""
        ...

    def blocks_of(self, worker: str) -> set[int]:
        """Every hash ``worker`` holds now (tests, resync checks)."""
        ...
