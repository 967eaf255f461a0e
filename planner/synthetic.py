"""Made-up machines and traces: for tests, for planning before anything was profiled,
and for the planner's scale check (1,000 GPUs, an hour). Pure, seeded.

- :func:`synthetic_profile`: a :class:`~common.cost_model.Profile` from a few figures
  (step floor, seconds per batched token past the floor, per attention pair, per
  sequence; transfer latency and bandwidth), not from measurements. ``cpu`` and ``gpu``
  presets (:data:`PRESETS`) are shaped like a 2-core machine on a 135M model and a
  datacenter GPU on an 8B model; they are illustrations, not any real machine.
- :class:`SyntheticTrace`: Poisson arrivals at ``rate`` for ``duration_s``, each request
  short (``input_len`` -> ``output_len``) or, with probability ``long_fraction``, long
  (``long_input_len`` -> ``long_output_len``), lengths varying within ``range_ratio``.
  :meth:`SyntheticTrace.sample` draws the requests a slice of the cluster sees, a
  ``fraction`` of them: a Poisson process thinned with probability ``fraction`` is a
  Poisson process of rate ``rate * fraction``, so the slice's own arrivals are drawn
  directly and the full trace (millions of requests for a large cluster) is never
  built. The draw is conditioned on its expected count (``round(rate * fraction *
  duration)`` arrivals, uniform over the duration), so slices of different sizes carry
  exactly their share of the load rather than a few percent of count noise each. Prompts
  are random ids (numpy), so they share no prefix.
- :func:`rate_for`: a request rate sized to resources: ``utilization`` of what the
  profile says one worker sustains on that length mix, times the workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from common.cost_model import Profile, StepModel, TransferModel, knots
from loadtest.workloads import Request

PRESETS: dict[str, dict] = {
    # 2 cores, a 135M model in float32: ~20 ms decode floor, ~0.5 ms a prompt token.
    "cpu": dict(floor_s=0.020, per_token_s=0.0005, per_pair_s=2e-7, per_seq_s=1e-4,
                threads={1: 1.8, 2: 1.0}, num_blocks=2048, block_size=16,
                max_num_batched_tokens=2048, max_num_seqs=256, max_model_len=4096,
                kv_bytes_per_token=18432, latency_s=0.002, bytes_per_s=3e9),
    # One GPU, an 8B model: ~12 ms decode floor, ~60 us a prompt token, big KV pool.
    "gpu": dict(floor_s=0.012, per_token_s=6e-5, per_pair_s=2e-10, per_seq_s=2e-5,
                threads={1: 1.0}, num_blocks=16384, block_size=16,
                max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192,
                kv_bytes_per_token=131072, latency_s=0.001, bytes_per_s=25e9),
}


def synthetic_profile(preset: str = "cpu", **overrides: object) -> Profile:
    """A profile from :data:`PRESETS` ``preset`` with ``overrides``; thread count ``t``
    runs ``threads[t]`` times slower than the figures."""
    p = {**PRESETS[preset], **overrides}
    steps = {}
    for t, slow in p["threads"].items():  # type: ignore[union-attr]
        pair = p["per_pair_s"] * slow  # the same for decode, fresh and prefix attention
        # The per-token slope starts at 16 tokens; no GEMV handover step.
        slopes = [p["per_token_s"] * slow if k == 16 else 0.0 for k in knots()]
        coef = [p["floor_s"] * slow, 0.0, *slopes, 0.0, pair, pair, pair, p["per_seq_s"] * slow]
        steps[int(t)] = StepModel(tuple(coef), p["floor_s"] * slow)  # type: ignore[operator]
    return Profile(f"synthetic-{preset}", "float32", {"synthetic": preset}, p["block_size"],
                   p["kv_bytes_per_token"], p["num_blocks"], p["max_num_batched_tokens"],
                   p["max_num_seqs"], p["max_model_len"], steps,
                   TransferModel(p["latency_s"], p["bytes_per_s"]))  # type: ignore[arg-type]


@dataclass(frozen=True)
class SyntheticTrace:
    rate: float
    """Requests per second over the whole cluster."""
    duration_s: float
    input_len: int = 512
    output_len: int = 128
    long_fraction: float = 0.1
    long_input_len: int = 2048
    long_output_len: int = 64
    range_ratio: float = 0.5
    seed: int = 0
    token_range: tuple[int, int] = (1000, 30000)

    @property
    def description(self) -> str:
        return (f"synthetic Poisson trace, {self.rate:g} req/s for {self.duration_s:g} s "
                f"(~{self.rate * self.duration_s:,.0f} requests), {self.input_len} -> "
                f"{self.output_len} tokens, {self.long_fraction:.0%} {self.long_input_len} -> "
                f"{self.long_output_len}, lengths +-{self.range_ratio:.0%}")

    def mean_lengths(self) -> tuple[float, float]:
        f = self.long_fraction
        return ((1 - f) * self.input_len + f * self.long_input_len,
                (1 - f) * self.output_len + f * self.long_output_len)

    def sample(self, fraction: float = 1.0) -> tuple[list[Request], list[float]]:
        """The requests and arrival times a ``fraction`` of the cluster sees (seeded:
        the same fraction gives the same requests)."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        rng = np.random.default_rng([self.seed, round(fraction * 1e9)])
        n = round(self.rate * fraction * self.duration_s)
        times = np.sort(rng.uniform(0.0, self.duration_s, n)).tolist()
        long = rng.random(n) < self.long_fraction
        r = self.range_ratio

        def lengths(base: np.ndarray) -> np.ndarray:
            lo, hi = np.floor(base * (1 - r)), np.ceil(base * (1 + r))
            return np.maximum(1, rng.integers(lo, hi + 1)).astype(int)

        ins = lengths(np.where(long, self.long_input_len, self.input_len).astype(float))
        outs = lengths(np.where(long, self.long_output_len, self.output_len).astype(float))
        ids = rng.integers(*self.token_range, size=int(ins.sum())).tolist()
        reqs, at = [], 0
        for i, o in zip(ins.tolist(), outs.tolist(), strict=True):
            reqs.append(Request(ids[at:at + i], o))
            at += i
        return reqs, times


def worker_capacity(profile: Profile, threads: int, mean_in: float, mean_out: float,
                    batch: int = 64) -> float:
    """Requests/s one worker sustains on this length mix, by the profile: its prompt's
    prefill plus its share of ``mean_out`` decode steps of a ``batch``-request batch."""
    step = profile.step(threads)
    b = max(1, min(batch, profile.max_num_seqs))
    ctx = int(mean_in + mean_out / 2)
    per_request = (step.prefill_seconds(int(mean_in))
                   + mean_out * step.decode_seconds(b, ctx) / b)
    return 1.0 / per_request


def rate_for(profile: Profile, workers: int, trace: SyntheticTrace, utilization: float = 0.6,
             threads: int = 1) -> float:
    """A cluster request rate: ``utilization`` of ``workers`` workers' capacity."""
    mean_in, mean_out = trace.mean_lengths()
    rate = utilization * workers * worker_capacity(profile, threads, mean_in, mean_out)
    return float(f"{rate:.3g}") if rate > 0 and math.isfinite(rate) else rate
