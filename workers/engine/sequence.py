"""One request as the engine core sees it: tokens, progress, blocks. No torch.

Lifecycle: ``WAITING`` (queued, or preempted and waiting to be recomputed) ->
``RUNNING`` (holds KV blocks; each step computes a chunk of its prompt or one new
token) -> ``FINISHED`` (blocks freed). A decode worker in a disaggregated cluster adds
``RESERVED``: blocks for the whole prompt are held while a prefill worker computes it
and sends the KV; the request then joins ``RUNNING`` with its first token (commit), or
goes to ``WAITING`` to be recomputed here when the transfer failed.

``num_computed_tokens`` counts tokens whose KV is in the cache; the request needs a
forward pass until it equals ``num_tokens``, and a step whose chunk reaches the end
samples the next token.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq

from common.hashing import block_hashes

from .params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RESERVED = "reserved"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller
    REMOTE = "remote"  # prefill worker: first token sampled, decoding goes on elsewhere


class Sequence:
    """Mutable state of one request, owned by the scheduler."""

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        arrival: int,
        block_size: int,
        model_id: str,
        cache_salt: str | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.arrival = arrival  # FCFS order; ties impossible (a counter)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (usage)
        self.num_preemptions = 0
        self._block_size = block_size
        self._model_id = model_id
        self._cache_salt = cache_salt
        # Hashes of every full block, computed once (prompt) and extended as tokens come.
        self.block_hashes: list[int] = block_hashes(
            self.token_ids, block_size, model_id, cache_salt
        )
        self.num_hashed_blocks = 0  # leading blocks already offered to the prefix cache
        self.prompt_logprobs: int | None = None
        """Set: the prompt's log-probabilities are wanted (this many alternatives), so
        no cached prefix is reused (a cached block has no logits)."""

    @property
    def cache_salt(self) -> str | None:
        return self._cache_salt

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_tokens(self, i: int) -> list[int]:
        bs = self._block_size
        return self.token_ids[i * bs : (i + 1) * bs]

    def append_token(self, token_id: int) -> None:
        """Add a sampled token; hash the block it completes, if any."""
        self.token_ids.append(token_id)
        bs = self._block_size
        if len(self.token_ids) % bs == 0:
            parent = self.block_hashes[-1] if self.block_hashes else None
            i = len(self.token_ids) // bs - 1
            self.block_hashes.extend(
                block_hashes(
                    self.token_ids, bs, self._model_id, self._cache_salt, parent, start_block=i
                )
            )

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
