"""``pdserve bench``: drive a router with a workload and report serving metrics.

Lifecycle: build the workload and the send schedule -> at each send time start one
streamed request over the router's gRPC API (bounded by ``max_concurrency`` when given;
with an infinite rate that makes a closed loop) -> record the arrival time of every
token message, the token counts and the cached tokens from the final usage -> print a
progress line while running and a table at the end -> ``--out`` writes the JSON with
``vllm bench serve``'s field names (see :mod:`loadtest.metrics`). :func:`sweep` repeats
the run over request rates from low to saturation and tabulates the goodput curve.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from router.client import AsyncClient

from .metrics import SLO, RequestRecord, compute_metrics
from .workloads import Request


@dataclass(frozen=True)
class RunOptions:
    target: str
    requests: tuple[Request, ...]
    send_times: tuple[float, ...]
    max_concurrency: int | None = None
    slo: SLO | None = None
    timeout_s: float = 600.0
    progress: bool = True


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done, self.failed = total, enabled, 0, 0
        self.started = time.monotonic()

    def tick(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if self.enabled:
            width = 30
            filled = width * self.done // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/"
                             f"{self.total} done, {self.failed} failed, "
                             f"{time.monotonic() - self.started:.1f}s")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def _one(client: AsyncClient, req: Request, rec: RequestRecord, timeout: float) -> None:
    try:
        async for msg in client.stream(req.prompt, timeout=timeout, max_tokens=req.output_len,
                                       temperature=0.0, ignore_eos=True):
            if msg.token_ids:
                rec.token_times.append(time.monotonic())
                rec.output_tokens += len(msg.token_ids)
            if msg.finish_reason:
                rec.cached_tokens = msg.usage.cached_tokens
                rec.prompt_tokens = msg.usage.prompt_tokens or rec.prompt_tokens
    except Exception as e:  # noqa: BLE001 - every failure is counted, the run goes on
        rec.error = f"{type(e).__name__}: {e}"


async def drive(opts: RunOptions) -> tuple[list[RequestRecord], float]:
    """Run the schedule; returns the records and the wall duration."""
    limit = asyncio.Semaphore(opts.max_concurrency or len(opts.requests) or 1)
    progress = _Progress(len(opts.requests), opts.progress)
    records: list[RequestRecord] = []
    async with AsyncClient(opts.target) as client:
        start = time.monotonic()

        async def send(req: Request, at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            async with limit:
                rec = RequestRecord(sent=time.monotonic(), prompt_tokens=len(req.prompt))
                records.append(rec)
                await _one(client, req, rec, opts.timeout_s)
                progress.tick(rec.ok)

        await asyncio.gather(*(send(r, t) for r, t in zip(opts.requests, opts.send_times,
                                                            strict=True)))
        duration = time.monotonic() - start
    return records, duration


def report(metrics: dict) -> str:
    """The end-of-run table."""
    lines = [f"{'Successful requests:':<40}{metrics['completed']:>12}",
             f"{'Failed requests:':<40}{metrics['failed']:>12}",
             f"{'Benchmark duration (s):':<40}{metrics['duration']:>12.2f}",
             f"{'Total input tokens:':<40}{metrics['total_input_tokens']:>12}",
             f"{'Total generated tokens:':<40}{metrics['total_output_tokens']:>12}",
             f"{'Request throughput (req/s):':<40}{metrics['request_throughput']:>12.2f}",
             f"{'Output token throughput (tok/s):':<40}{metrics['output_throughput']:>12.2f}",
             f"{'Cached prompt token ratio:':<40}{metrics['cached_token_ratio']:>12.1%}"]
    if "request_goodput" in metrics:
        lines.append(f"{'Request goodput (req/s):':<40}{metrics['request_goodput']:>12.2f}")
    lines.append(f"{'metric (ms)':<12}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(f"{name.upper():<12}" + "".join(
            f"{metrics[f'{k}_{name}_ms']:>10.1f}" for k in ("mean", "median", "p90", "p99")))
    return "\n".join(lines)


def run(opts: RunOptions, out: str | None = None, extra: dict | None = None) -> dict:
    records, duration = asyncio.run(drive(opts))
    metrics = compute_metrics(records, duration, opts.slo)
    print(report(metrics))
    errors = sorted({r.error for r in records if r.error})
    if errors:
        print(f"errors ({len(errors)} kinds): {errors[:3]}", file=sys.stderr)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({**(extra or {}), **metrics}, indent=2))
    return metrics


def sweep(opts: RunOptions, rates: list[float], times_for: Callable[[float], list[float]],
          out_prefix: str) -> list[dict]:
    """One run per rate (low to high), each written to ``{out_prefix}-rate{r}.json``, then
    the goodput curve as a table and ``{out_prefix}-sweep.json``."""
    points = []
    for rate in sorted(rates):
        print(f"\n== request rate {rate:g} req/s ==", flush=True)
        point = replace(opts, send_times=tuple(times_for(rate)))
        m = run(point, f"{out_prefix}-rate{rate:g}.json", {"request_rate": rate})
        points.append({"request_rate": rate, **m})
    print(f"\n{'rate':>8}{'req/s':>9}{'goodput':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'TPOT p99':>10}{'ITL p99':>9}{'failed':>8}")
    for p in points:
        print(f"{p['request_rate']:>8g}{p['request_throughput']:>9.2f}"
              f"{p.get('request_goodput', float('nan')):>9.2f}{p['median_ttft_ms']:>10.0f}"
              f"{p['p99_ttft_ms']:>10.0f}{p['p99_tpot_ms']:>10.1f}{p['p99_itl_ms']:>9.1f}"
              f"{p['failed']:>8}")
    Path(f"{out_prefix}-sweep.json").parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out_prefix}-sweep.json").write_text(json.dumps(points, indent=2))
    return points
