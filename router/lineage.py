"""Which earlier request a prompt continues: the link the traffic log carries from a
chat's turn to the one before it. Pure logic, no I/O.

A multi-turn client sends turn k+1 after turn k's reply, and its prompt begins with
turn k's prompt. The planner's simulator (:mod:`planner.window`) replays a window of
logged requests; replayed each at its own arrival time, turn k+1 arrived in the
simulation while turn k was still decoding whenever the simulated decode ran a little
slower than the real one (its calibration is fitted, not exact), on the worker that
caches turn k's prompt, so its prefill stalled turn k's last tokens. On a 2-core EPYC's
chat headline at 25% load that predicted two mixed workers an ITL p99 of 458 ms where
they served 21 ms, and the planner's ITL rule split the pools for nothing. With the link
the simulator sends turn k+1 a measured pause after turn k's end, as the client did.

:class:`Lineage` keeps, for the last ``capacity`` prompts this router admitted, the
chained hash (:func:`common.hashing.block_hashes`) of each prompt's last full block,
with its request's key and length. A new prompt's chain holds that hash exactly when
its tokens begin with that prompt's full blocks (and, the first block carrying the
cache salt, it has the same salt); the deepest such earlier prompt that is shorter than
the new one is its parent. What the check cannot see: the earlier prompt's tokens past
its last full block (fewer than a block), so a prompt that shares an earlier one's full
blocks and then differs within a block's length of tokens is linked to it as well. The
same prompt again (a retry, or one template sent twice) is not a continuation and is not
linked. One router sees only its own requests: a conversation whose turns reach
different routers is not linked, and the planner replays those turns as it did before
(each at its arrival).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from common.hashing import block_hashes

BLOCK_SIZE = 16
"""Tokens per hashed block: a turn links to a prompt whose full blocks it begins with;
the shorter the block, the less of a short prompt is left out of its last full one."""

CAPACITY = 8192
"""Last full blocks remembered (a hash, and a key and a length for each of up to
:data:`PER_BLOCK` prompts ending there; some 200 bytes a prompt): a minute of a busy
router's requests, several planner windows."""


PER_BLOCK = 4
"""Prompts of different lengths remembered under one last full block (a turn and the
next one can end in the same block when it adds less than a block)."""


class Lineage:
    """The router's recent prompts, by the hash of their last full block. Used from the
    event loop only."""

    def __init__(self, model_id: str, block_size: int = BLOCK_SIZE,
                 capacity: int = CAPACITY) -> None:
        if block_size <= 0 or capacity <= 0:
            raise ValueError(f"block_size and capacity must be > 0, got {block_size}, "
                             f"{capacity}")
        self.model_id, self.block_size, self.capacity = model_id, block_size, capacity
        # the hash of a prompt's last full block -> the latest prompts that end there
        # (key, length), newest last, one per length
        self._ends: OrderedDict[int, list[tuple[str, int]]] = OrderedDict()

    def link(self, prompt: Sequence[int], key: str, cache_salt: str | None = None) -> str:
        """The key of the latest remembered prompt this one continues (the deepest, when
        several: its full blocks are this prompt's first ones, and it is shorter; ""
        when none), then this prompt remembered under ``key``. A prompt shorter than a
        block links to nothing and is not remembered."""
        n = len(prompt)
        chain = block_hashes(prompt, self.block_size, self.model_id, cache_salt)
        parent = next((k for h in reversed(chain) for k, m in reversed(self._ends.get(h, ()))
                       if m < n), "")
        if chain:
            ends = [e for e in self._ends.pop(chain[-1], ()) if e[1] != n]
            self._ends[chain[-1]] = [*ends[-(PER_BLOCK - 1):], (key, n)]
            while len(self._ends) > self.capacity:
                self._ends.popitem(last=False)
        return parent
