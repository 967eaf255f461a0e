"""Serving metrics from recorded request event streams. Pure: no I/O, no clocks.

Definitions follow ``vllm bench serve`` so figures line up (field names too):

- TTFT: request sent -> first token received;
- TPOT: per request, (end-to-end - TTFT) / (output tokens - 1), for requests with more
  than one output token;
- ITL: every gap between two successive token messages of a request, all requests
  pooled (a message carrying several tokens counts as one gap);
- E2EL: request sent -> last token received;
- percentiles: linear interpolation between closest ranks (numpy's default);
- goodput: requests per second that met *every* given SLO (TTFT, TPOT, E2EL, in ms).

Throughputs divide by the benchmark's wall duration. ``cached_token_ratio`` is cached
prompt tokens over prompt tokens, from the responses' usage.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """What the harness saw of one request; times in seconds on one monotonic clock."""

    sent: float
    prompt_tokens: int = 0
    token_times: list[float] = field(default_factory=list)  # one per message with tokens
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2el(self) -> float:
        return self.token_times[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        return tpot_s(self.ttft, self.e2el, self.output_tokens)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        return self.met(r.ttft, r.tpot, r.e2el)

    def met(self, ttft_s: float, tpot_s: float | None, e2el_s: float) -> bool:
        """Whether a request with these latencies (seconds; TPOT None: one output token)
        meets every SLO given."""
        if self.ttft_ms is not None and ttft_s * 1e3 > self.ttft_ms:
            return False
        if self.tpot_ms is not None and tpot_s is not None and tpot_s * 1e3 > self.tpot_ms:
            return False
        return not (self.e2el_ms is not None and e2el_s * 1e3 > self.e2el_ms)


def tpot_s(ttft_s: float, e2el_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first (None: fewer than two tokens)."""
    if output_tokens < 2:
        return None
    return (e2el_s - ttft_s) / (output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, and ``vllm bench
    serve``'s), ``p`` in [0, 100]; 0.0 for no values. pdserve's one percentile: the
    load-test reports and the benchmarks (``benchmarks/``) all use it."""
    if not 0 <= p <= 100:
        raise ValueError(f"percentile p must be in [0, 100] (p99: 99), got {p}")
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _summary(name: str, seconds: list[float], percentiles: tuple[float, ...]) -> dict:
    ms = [v * 1e3 for v in seconds]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = percentile(ms, p)
    return out


def compute_metrics(records: list[RequestRecord], duration_s: float, slo: SLO | None = None,
                    percentiles: tuple[float, ...] = (90, 99)) -> dict:
    """The report, with ``vllm bench serve``'s field names."""
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    out: dict = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(records) - len(done),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output / duration_s,
        "total_token_throughput": (prompt + output) / duration_s,
        "cached_token_ratio": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
    }
    if slo is not None:
        good = sum(slo.met_by(r) for r in done)
        out["request_goodput"] = good / duration_s
        out["goodput_fraction"] = good / len(records) if records else 0.0
    out.update(_summary("ttft", [r.ttft for r in done], percentiles))
    out.update(_summary("tpot", [t for r in done if (t := r.tpot) is not None], percentiles))
    out.update(_summary("itl", [g for r in done for g in r.itls], percentiles))
    out.update(_summary("e2el", [r.e2el for r in done], percentiles))
    return out
