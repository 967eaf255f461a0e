"""Workloads and arrival processes: what to send and when. Pure, seeded.

Workloads yield :class:`Request` (prompt token ids, output length):

- ``random``: input and output lengths uniform in ``[len * (1 - range_ratio),
  len * (1 + range_ratio)]`` (``vllm bench serve``'s random dataset), random token ids;
- ``shared-prefix``: ``groups`` system prompts of ``prefix_len`` tokens, each request one
  of them plus a unique ``input_len``-token question;
- ``trace``: a JSONL file, one request per line: ``timestamp`` (s, optional: replayed
  on its own schedule), ``input_length``, ``output_length``, ``prefix_group``
  (optional: requests of a group share a prompt prefix of half the shortest input).

Arrivals: an open loop at ``rate`` requests/s, Poisson (``burstiness`` 1) or gamma
(``burstiness`` < 1 is burstier, > 1 more regular; shape = burstiness, mean 1/rate, as
``vllm bench serve``), or ``inf`` (all at once; then the harness's concurrency bounds
the load: a closed loop).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

MAX_TOKEN_ID = 30000  # random ids stay below: ordinary tokens in common vocabularies


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output_len: int
    at: float | None = None  # seconds from the start (trace replay); None: arrivals decide


def _ids(rng: random.Random, n: int, high: int = MAX_TOKEN_ID) -> list[int]:
    """Random token ids in [high / 30, high): clear of the special ids at the start."""
    return [rng.randrange(high // 30, high) for _ in range(n)]


def _length(rng: random.Random, n: int, ratio: float) -> int:
    return max(1, rng.randint(math.floor(n * (1 - ratio)), math.ceil(n * (1 + ratio))))


def random_workload(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, max_token_id: int = MAX_TOKEN_ID) -> list[Request]:
    rng = random.Random(seed)
    return [Request(_ids(rng, _length(rng, input_len, range_ratio), max_token_id),
                    _length(rng, output_len, range_ratio)) for _ in range(num)]


def shared_prefix_workload(num: int, groups: int, prefix_len: int, input_len: int,
                           output_len: int, seed: int = 0, max_token_id: int = MAX_TOKEN_ID
                           ) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [_ids(rng, prefix_len, max_token_id) for _ in range(groups)]
    return [Request(prefixes[rng.randrange(groups)] + _ids(rng, input_len, max_token_id),
                    output_len) for _ in range(num)]


def trace_workload(path: str | Path, seed: int = 0, max_token_id: int = MAX_TOKEN_ID
                   ) -> list[Request]:
    rng = random.Random(seed)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    shortest: dict[str, int] = {}
    for r in rows:
        if r.get("prefix_group") is not None:
            g = str(r["prefix_group"])
            shortest[g] = min(shortest.get(g, r["input_length"]), r["input_length"])
    prefixes = {g: _ids(rng, n // 2, max_token_id) for g, n in shortest.items()}
    out = []
    for r in rows:
        n = int(r["input_length"])
        prefix = prefixes.get(str(r.get("prefix_group")), []) if r.get("prefix_group") \
            is not None else []
        out.append(Request(prefix + _ids(rng, n - len(prefix), max_token_id),
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
