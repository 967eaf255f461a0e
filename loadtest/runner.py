"""``pdserve bench``: drive a router with a workload and report serving metrics.

Lifecycle: build the workload and the send schedule -> at each send time start one
session (a lone request, or a conversation whose turns follow one another) over the
router's gRPC API or an OpenAI-compatible HTTP server (bounded by ``max_concurrency``
when given; with an infinite rate that makes a closed loop), sampling the server's
queues meanwhile where it tells them -> record the arrival time of every token message,
the token counts and the cached tokens from the final usage -> print a progress line
while running and a table at the end -> ``--out`` writes the JSON with ``vllm bench
serve``'s field names (see :mod:`loadtest.metrics`) plus per-request details, and PNG
plots beside it (:mod:`loadtest.plots`). :func:`sweep` repeats the run over request
rates from low to saturation, tabulates and plots the goodput curve.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from .backends import Backend, GrpcBackend, OpenAIBackend, is_http
from .metrics import SLO, RequestRecord, compute_metrics
from .workloads import Request


@dataclass(frozen=True)
class RunOptions:
    target: str
    """gRPC ``HOST:PORT`` of a router, or an ``http(s)://`` base URL of any
    OpenAI-compatible server (see :mod:`loadtest.backends`)."""
    requests: tuple[Request, ...]
    send_times: tuple[float, ...]
    """One per session (a conversation's first turn, or a lone request), in order."""
    max_concurrency: int | None = None
    slo: SLO | None = None
    timeout_s: float = 600.0
    progress: bool = True
    think_time_s: float = 0.0
    """Multi-turn: pause between a reply and the conversation's next turn."""
    model: str | None = None
    """OpenAI backend: the model name to send (default: the server's first)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer`` (both backends) when the server wants keys."""
    tls_ca: str | None = None
    """gRPC backend: the CA that signed a TLS router's certificate."""
    queue_interval_s: float = 0.5


def backend_for(opts: RunOptions) -> Backend:
    """Build inside the event loop that will use it (gRPC's aio channel binds to it)."""
    if is_http(opts.target):
        return OpenAIBackend(opts.target, opts.model, opts.api_key)
    return GrpcBackend(opts.target, opts.api_key, opts.tls_ca)


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


@dataclass
class Trace:
    """Everything a run saw: per-request records and the server's queue over time."""

    records: list[RequestRecord]
    duration: float
    start: float
    queue: list[tuple[float, int, int, int]] = field(default_factory=list)
    """(s from start, waiting, running, reserved), when the backend can tell."""


async def drive(opts: RunOptions) -> Trace:
    """Run the schedule: each session starts at its send time; a conversation's turns
    follow one another (after ``think_time_s``, or a turn's own ``think_s``); at most
    ``max_concurrency`` requests are in flight."""
    sessions = group_sessions(opts.requests)
    if len(sessions) != len(opts.send_times):
        raise ValueError(f"{len(sessions)} sessions but {len(opts.send_times)} send times")
    limit = asyncio.Semaphore(opts.max_concurrency or len(opts.requests) or 1)
    progress = _Progress(len(opts.requests), opts.progress)
    records: list[RequestRecord] = []
    async with backend_for(opts) as backend:
        start = time.monotonic()
        trace = Trace(records, 0.0, start)

        async def one(req: Request) -> None:
            async with limit:
                rec = RequestRecord(sent=time.monotonic(), prompt_tokens=len(req.prompt))
                records.append(rec)
                try:
                    await backend.send(req.prompt, req.output_len, rec, opts.timeout_s)
                except Exception as e:  # noqa: BLE001 - every failure counts; the run goes on
                    rec.error = _describe_error(e)
                progress.tick(rec.ok)

        async def session(turns: list[Request], at: float) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            for i, req in enumerate(turns):
                pause = opts.think_time_s if req.think_s is None else req.think_s
                if i and pause > 0:
                    await asyncio.sleep(pause)
                await one(req)

        async def sample_queue() -> None:
            while True:
                depth = await backend.queue_depth()
                if depth is None and not trace.queue:
                    return  # the API does not expose queues
                if depth is not None:
                    trace.queue.append((time.monotonic() - start, *depth))
                await asyncio.sleep(opts.queue_interval_s)

        sampler = asyncio.create_task(sample_queue())
        await asyncio.gather(*(session(t, at) for t, at in zip(sessions, opts.send_times,
                                                               strict=True)))
        trace.duration = time.monotonic() - start
        sampler.cancel()
    return trace


def _describe_error(e: Exception) -> str:
    """A failed request's error in one line: a gRPC status as ``CODE: details`` (its
    ``str`` is a multi-line dump), anything else as ``Type: message``."""
    code, details = getattr(e, "code", None), getattr(e, "details", None)
    if callable(code) and callable(details):
        return f"{getattr(code(), 'name', code())}: {details()}"
    return f"{type(e).__name__}: {e}"


def group_sessions(requests: tuple[Request, ...] | list[Request]) -> list[list[Request]]:
    """Requests by conversation (in first-seen order; turns in order); a request without
    one is a session of its own."""
    sessions: list[list[Request]] = []
    by_id: dict[int, list[Request]] = {}
    for r in requests:
        if r.conversation is None:
            sessions.append([r])
        elif r.conversation in by_id:
            by_id[r.conversation].append(r)
        else:
            by_id[r.conversation] = [r]
            sessions.append(by_id[r.conversation])
    return sessions


def details(trace: Trace) -> dict:
    """Per-request series for plots and later analysis (seconds; times from the start)."""
    done = [r for r in trace.records if r.ok]
    return {
        "ttfts": [r.ttft for r in done], "tpots": [r.tpot for r in done],
        "e2els": [r.e2el for r in done], "itls": [g for r in done for g in r.itls],
        "sent": [r.sent - trace.start for r in done],
        "token_times": [[t - trace.start for t in r.token_times] for r in done],
        "output_tokens": [r.output_tokens for r in done],
        "queue": [list(q) for q in trace.queue],
    }


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
    """One run: drive, print the table, write ``out`` (the metrics, ``extra`` settings
    and the per-request ``details``) and, when ``out`` is given, its plots beside it."""
    trace = asyncio.run(drive(opts))
    metrics = compute_metrics(trace.records, trace.duration, opts.slo)
    metrics["first_error"] = next((r.error for r in trace.records if r.error), None)
    print(report(metrics))
    errors = sorted({r.error for r in trace.records if r.error})
    if errors:
        print(f"errors ({len(errors)} kinds): {errors[:3]}", file=sys.stderr)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        result = {**(extra or {}), "backend": "openai" if is_http(opts.target) else "grpc",
                  **metrics,
                  "details": details(trace)}
        Path(out).write_text(json.dumps(result, indent=1))
        from .plots import plot_run

        png = plot_run(result, Path(out).with_suffix(".png"))
        print(f"wrote {out} and {png}", file=sys.stderr)
    return metrics


def failed_verdict(points: list[dict], max_failed_fraction: float) -> str | None:
    """Why a run (its points: one, or a sweep's) failed, in one line; None when no more
    than ``max_failed_fraction`` of its requests failed (0: any failure fails it)."""
    failed = sum(p["failed"] for p in points)
    total = failed + sum(p["completed"] for p in points)
    if failed == 0 or failed <= max_failed_fraction * total:
        return None
    first = next((p["first_error"] for p in points if p.get("first_error")), None)
    allowed = f", more than --max-failed-fraction {max_failed_fraction:g}" \
        if max_failed_fraction else ""
    return (f"{failed} of {total} requests failed{allowed} (first error: "
            f"{' '.join(str(first).split())[:300]})")


def sweep(opts: RunOptions, rates: list[float],
          point_for: Callable[[float, int], tuple[list[Request], list[float]]],
          out_prefix: str) -> list[dict]:
    """One run per rate (low to high) with the requests and send times ``point_for(rate,
    i)`` gives (fresh prompts per point: earlier points must not warm the prefix cache
    for later ones), each written to ``{out_prefix}-rate{r}.json``, then the goodput
    curve as a table, ``{out_prefix}-sweep.json`` and its plot."""
    points = []
    for i, rate in enumerate(sorted(rates)):
        print(f"\n== request rate {rate:g} req/s ==", flush=True)
        requests, times = point_for(rate, i)
        point = replace(opts, requests=tuple(requests), send_times=tuple(times))
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
    from .plots import plot_sweeps

    png = plot_sweeps({Path(out_prefix).name: points}, Path(f"{out_prefix}-sweep.png"))
    print(f"wrote {out_prefix}-sweep.json and {png}", file=sys.stderr)
    return points
