"""Workloads and arrival processes: what to send and when. Pure, seeded.

Workloads yield :class:`Request` (prompt token ids, output length):

- ``random``: input and output lengths uniform in ``[len * (1 - range_ratio),
  len * (1 + range_ratio)]`` (``vllm bench serve``'s random dataset), random token ids;
- ``shared-prefix``: ``groups`` system prompts of ``prefix_len`` tokens, each request one
  of them plus a unique ``input_len``-token question;
- ``mixed``: long prompts among short ones with longer outputs (prefill interfering
  with ongoing decodes: the disaggregation case);
- ``multi-turn``: conversations whose prompts grow turn by turn, each turn sent after
  the previous reply;
- ``trace``: a JSONL file, one request per line: ``timestamp`` (s, optional: replayed
  on its own schedule), ``input_length``, ``output_length``, ``prefix_group``
  (optional: requests of a group share a prompt prefix of half the shortest input).

Every workload draws its token ids from ``token_ids``: ordinary (not special) ids of
the served model's vocabulary, which the caller finds out (:mod:`loadtest.vocab`).

Arrivals: an open loop at ``rate`` requests/s, Poisson (``burstiness`` 1) or gamma
(``burstiness`` < 1 is burstier, > 1 more regular; shape = burstiness, mean 1/rate, as
``vllm bench serve``), or ``inf`` (all at once; then the harness's concurrency bounds
the load: a closed loop).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TOKEN_IDS: Sequence[int] = range(1000, 30000)
"""Library callers that start a known model (``benchmarks/``: SmolLM2, 49,152 ids) may
rely on this; ``pdserve bench`` never does: it asks the server (:mod:`loadtest.vocab`)."""


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int
    at: float | None = None  # seconds from the start (trace replay); None: arrivals decide
    conversation: int | None = None
    """Multi-turn: the turns of a conversation are sent one after another, in order."""
    think_s: float | None = None
    """Multi-turn: the pause between the previous turn's reply and this turn (None: the
    run's ``think_time_s``); a replay of logged turns keeps each turn's own."""


def _ids(rng: random.Random, n: int, token_ids: Sequence[int]) -> list[int]:
    """``n`` ids drawn uniformly from ``token_ids`` (ordinary tokens of the served
    vocabulary; for a ``range`` this is ``randrange`` over it, the same stream)."""
    return [rng.choice(token_ids) for _ in range(n)]


def _length(rng: random.Random, n: int, ratio: float) -> int:
    return max(1, rng.randint(math.floor(n * (1 - ratio)), math.ceil(n * (1 + ratio))))


def random_workload(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, token_ids: Sequence[int] = DEFAULT_TOKEN_IDS) -> list[Request]:
    rng = random.Random(seed)
    return [Request(_ids(rng, _length(rng, input_len, range_ratio), token_ids),
                    _length(rng, output_len, range_ratio)) for _ in range(num)]


def shared_prefix_workload(num: int, groups: int, prefix_len: int, input_len: int,
                           output_len: int, seed: int = 0,
                           token_ids: Sequence[int] = DEFAULT_TOKEN_IDS) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, token_ids) for _ in range(groups)]
    return [Request(prefixes[rng.randrange(groups)] + _ids(rng, input_len, token_ids),
                    output_len) for _ in range(num)]


def mixed_workload(num: int, input_len: int, output_len: int, long_fraction: float,
                   long_input_len: int, long_output_len: int, range_ratio: float = 0.0,
                   seed: int = 0, token_ids: Sequence[int] = DEFAULT_TOKEN_IDS) -> list[Request]:
    """Long prompts among ongoing decodes (DistServe's interference case): a
    ``long_fraction`` of requests have ``long_input_len``-token prompts and
    ``long_output_len`` outputs, the rest ``input_len`` -> ``output_len``; lengths vary
    within ``range_ratio``; which request is long is seeded."""
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long fraction must be in [0, 1], got {long_fraction}")
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        long = rng.random() < long_fraction
        n_in, n_out = (long_input_len, long_output_len) if long else (input_len, output_len)
        out.append(Request(_ids(rng, _length(rng, n_in, range_ratio), token_ids),
                           _length(rng, n_out, range_ratio)))
    return out


def multi_turn_workload(conversations: int, turns: int, input_len: int, output_len: int,
                        seed: int = 0, token_ids: Sequence[int] = DEFAULT_TOKEN_IDS
                        ) -> list[Request]:
    """Conversations that grow: turn k's prompt is turn k-1's prompt, a stand-in for its
    reply (``output_len`` seeded ids: the workload stays the same whatever a server
    answers) and a new ``input_len``-token user message. Turns of a conversation are
    sent in order, each after the previous reply; conversations start at the arrival
    times. Prefix caches see each previous prompt again."""
    rng = random.Random(seed)
    out = []
    for c in range(conversations):
        history: list[int] = []
        for t in range(turns):
            if t:
                history = history + _ids(rng, output_len, token_ids)
            history = history + _ids(rng, input_len, token_ids)
            out.append(Request(list(history), output_len, conversation=c))
    return out


def trace_workload(path: str | Path, seed: int = 0, token_ids: Sequence[int] = DEFAULT_TOKEN_IDS
                   ) -> list[Request]:
    rng = random.Random(seed)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    shortest: dict[str, int] = {}
    for r in rows:
        if r.get("prefix_group") is not None:
            g = str(r["prefix_group"])
            shortest[g] = min(shortest.get(g, r["input_length"]), r["input_length"])
    prefixes = {g: _ids(rng, n // 2, token_ids) for g, n in shortest.items()}
    out = []
    for r in rows:
        n = int(r["input_length"])
        prefix = prefixes.get(str(r.get("prefix_group")), []) if r.get("prefix_group") \
            is not None else []
        out.append(Request(prefix + _ids(rng, n - len(prefix), token_ids),
                           int(r["output_length"]),
                           r.get("timestamp")))
    return out


def arrival_times(num: int, rate: float, burstiness: float = 1.0, seed: int = 0
                  ) -> list[float]:
    """Send times (s from the start) of ``num`` requests; all 0.0 when rate is inf."""
    if math.isinf(rate):
        return [0.0] * num
    if rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


KINDS = ("random", "shared-prefix", "mixed", "multi-turn", "trace")


@dataclass(frozen=True)
class WorkloadShape:
    """One of the workloads above by name, with ``pdserve bench``'s flags (same names,
    same defaults): what ``pdserve bench`` sends and ``pdserve plan`` simulates."""

    workload: str = "random"
    num_requests: int = 100
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    long_fraction: float = 0.25
    long_input_len: int = 1536
    long_output_len: int = 16
    turns: int = 4
    prefix_len: int = 512
    groups: int = 8
    trace: str | None = None

    def __post_init__(self) -> None:
        if self.workload not in KINDS:
            raise ValueError(f"workload must be one of {KINDS}, got {self.workload!r}")
        if self.workload == "trace" and not self.trace:
            raise ValueError("--workload trace needs --trace FILE.jsonl")

    def requests(self, seed: int = 0, token_ids: Sequence[int] = DEFAULT_TOKEN_IDS
                 ) -> list[Request]:
        n, w = self.num_requests, self.workload
        if w == "trace":
            return trace_workload(self.trace or "", seed, token_ids)
        if w == "shared-prefix":
            return shared_prefix_workload(n, self.groups, self.prefix_len, self.input_len,
                                          self.output_len, seed, token_ids)
        if w == "mixed":
            return mixed_workload(n, self.input_len, self.output_len, self.long_fraction,
                                  self.long_input_len, self.long_output_len, self.range_ratio,
                                  seed, token_ids)
        if w == "multi-turn":
            return multi_turn_workload(n, self.turns, self.input_len, self.output_len, seed,
                                       token_ids)
        return random_workload(n, self.input_len, self.output_len, self.range_ratio, seed,
                               token_ids)
