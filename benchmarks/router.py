"""``pdserve bench-router``: latency the router adds over calling a worker directly.

One run, one cluster (``pdserve up``'s code, real processes on loopback): the same
prompts are sent alternately through the router's public API and straight to the
worker's internal API (already tokenized, as the router would send them), one at a time
so neither path queues behind the other. Reported: p50/p90/p99 of time to first token
and of end-to-end latency on both paths, and their differences (the router's overhead:
tokenization, validation, one extra gRPC hop and the relay of every message).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from cluster.local import LocalCluster, LocalClusterConfig, free_port
from loadtest.metrics import percentile
from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.client import Client, build_request


@dataclass(frozen=True)
class RouterBenchOptions:
    model: str
    num_requests: int = 200
    max_tokens: int = 8
    out: str | None = None


def _timed(stream) -> tuple[float, float]:  # noqa: ANN001 - any iterator of messages
    start = time.perf_counter()
    first = None
    for msg in stream:
        if first is None and msg.token_ids:
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start


def run(opts: RouterBenchOptions) -> dict:
    cfg = LocalClusterConfig(model=opts.model, port=free_port(), http_port=0, metrics_port=None,
                             kv_cache_gb=0.25)
    results: dict[str, dict[str, list[float]]] = {
        "router": {"ttft": [], "e2e": []}, "direct": {"ttft": [], "e2e": []}}
    with LocalCluster(cfg) as cluster:
        cluster.wait_ready()
        with Client(cluster.target) as client, \
                grpc.insecure_channel(cluster.worker_addresses[0]) as channel:
            worker = worker_pb2_grpc.WorkerStub(channel)
            sampling = {"max_tokens": opts.max_tokens, "temperature": 0.0, "ignore_eos": True}
            for i in range(opts.num_requests + 10):  # the first 10 warm up both paths
                prompt = f"Request {i}: tell me about the number {i * 7919 % 1000}."
                req = build_request(prompt, **sampling)
                ids = client.generate(prompt, max_tokens=1).prompt_token_ids
                direct = worker_pb2.WorkerGenerateRequest(
                    request_id=f"direct-{i}", prompt_token_ids=ids, sampling=req.sampling)
                paths = [("router", lambda r=req: client._stub.Generate(r)),
                         ("direct", lambda d=direct: worker.Generate(d))]
                if i % 2:
                    paths.reverse()
                for name, call in paths:
                    ttft, e2e = _timed(call())
                    if i >= 10:
                        results[name]["ttft"].append(ttft)
                        results[name]["e2e"].append(e2e)
    report = {"workload": f"{opts.num_requests} sequential requests, ~16-token prompts, "
                          f"{opts.max_tokens} tokens out, greedy", "model": opts.model}
    for metric in ("ttft", "e2e"):
        for q in (50, 90, 99):
            r = percentile(results["router"][metric], q)
            d = percentile(results["direct"][metric], q)
            report[f"{metric}_p{q}_ms"] = {
                "router": r * 1e3, "direct": d * 1e3, "overhead": (r - d) * 1e3}
        report[f"{metric}_mean_overhead_ms"] = 1e3 * (
            statistics.mean(results["router"][metric]) - statistics.mean(results["direct"][metric]))
    _print(report)
    if opts.out:
        Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.out).write_text(json.dumps(report, indent=2))
    return report


def _print(report: dict) -> None:
    print(f"router overhead: {report['workload']}; model {Path(report['model']).name}")
    print(f"  {'':10}{'via router':>12}{'direct':>10}{'overhead':>10}   (ms)")
    for metric in ("ttft", "e2e"):
        for q in (50, 90, 99):
            row = report[f"{metric}_p{q}_ms"]
            print(f"  {metric} p{q:<4}{row['router']:12.2f}{row['direct']:10.2f}"
                  f"{row['overhead']:10.2f}")
