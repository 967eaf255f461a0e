"""``pdserve chaos``: faults injected into a serving cluster under steady load, judged
by a token-exact oracle.

Lifecycle of a run, per cluster shape (:func:`benchmarks.chaos_faults.shape_of`: 2
prefill + 2 decode workers, or 2 mixed ones for the mixed worker's kill, or 2 + 2 spread
over test hosts for the network faults, :mod:`benchmarks.chaos_hosts`), on one of
``pdserve up``'s launchers (:mod:`benchmarks.chaos_targets`): the process launcher
(the default; two routers, supervising as ``pdserve up`` does) or Ray
(:mod:`benchmarks.chaos_ray`: one router, Ray restarting actors; it refuses the
scenarios it cannot run, :func:`benchmarks.chaos_targets.refused`):

1. **start** the cluster and wait until it serves;
2. **references**: each prompt once, alone, greedy with ``ignore_eos``: the token ids
   every later stream of that prompt must equal (:mod:`benchmarks.chaos_oracle`);
3. **capacity**: the prompts in a closed loop, ``2 x workers`` in flight: requests/s;
   the load is ``load`` (70%) of it, Poisson arrivals;
4. per scenario, ``faults`` times: ``pre_s`` of load, the fault, ``post_s`` more load
   (longer while the fault lasts: a stop, or a killed component not back yet, then
   ``post_s / 2`` more); every stream is checked against its reference; a kill's
   restoration (until the component serves again, listed by every router) is timed;
   then the cluster must be **whole** again (every component running, every router
   listing every worker as serving) and **idle with every KV block free** (leaked
   blocks are counted, not waited for beyond 30 s). After the scenario's faults the
   TTFT recovery of each is measured against the scenario's pooled pre-fault p99
   (:mod:`benchmarks.chaos_oracle`).

The client is the resuming one (:class:`router.client.AsyncClient` over both routers),
so a router's death is a resume, not a failure. :mod:`benchmarks.chaos_report` writes
the JSON, the markdown table and the TTFT-around-the-fault plot.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.local import LocalCluster, LocalClusterConfig
from cluster.supervisor import RestartPolicy
from cluster.testhosts import unavailable as hosts_unavailable
from loadtest.workloads import arrival_times
from router.client import AsyncClient, Client

from .chaos_faults import (
    FLIP_ENV,
    FLIP_MARK,
    KILLS,
    NETWORK,
    SCENARIOS,
    WORKER_ROLES,
    Fault,
    component_of,
    inject,
    leaked_blocks,
    shape_of,
    victim_of,
    wait_restored,
    wait_whole,
)
from .chaos_hosts import HostsTarget
from .chaos_oracle import Outcome, Row, baseline_p99, pooled_recovery_s, recovery_s
from .chaos_targets import ChaosTarget, ProcessTarget
from .chaos_targets import refused as launcher_refuses

if TYPE_CHECKING:
    from cluster.ray_cluster import ParseComponent

SHAPES = {"disagg": {"prefill": 2, "decode": 2, "local_prefill_threshold": 0},
          "mixed": {"mixed": 2},
          "hosts": {"prefill": 2, "decode": 2, "local_prefill_threshold": 0}}
TEXT = ("The history of the city begins with a small settlement on the river bank, where "
        "traders met every spring to exchange salt, wool and iron tools. Over the centuries "
        "the market grew into a town with stone walls, a cathedral and a university. ")


@dataclass(frozen=True)
class ChaosOptions:
    model: str
    out_dir: str
    scenarios: tuple[str, ...] = SCENARIOS
    faults: int = 1
    """Faults per scenario (50 per type in the long run)."""
    prompts: int = 12
    prompt_tokens: tuple[int, int] = (40, 200)
    max_tokens: int = 24
    load: float = 0.7
    pre_s: float = 6.0
    post_s: float = 14.0
    stop_s: tuple[float, float] = (1.0, 10.0)
    cancel_fraction: float = 0.33
    seed: int = 0
    dtype: str = "float32"
    """fp32: the oracle compares tokens across batch compositions; fp32 keeps greedy
    ties apart."""
    kv_cache_gb: float = 0.2
    block_size: int = 16
    max_model_len: int = 512
    prefill_queue_limit: int = 2
    """The routers' overflow (``RouterConfig.prefill_queue_limit``): with two prefill
    workers at 70% of the cluster's capacity, one lost leaves its peer at ~140%, so
    prompts past this queue go to the decode workers (0: off, they queue)."""
    launcher: str = "process"
    """``process`` (two routers, supervised processes) or ``ray`` (one router, actors);
    see :func:`benchmarks.chaos_targets.refused` for what Ray cannot run."""


@dataclass
class ShapeRun:
    shape: str
    capacity_rps: float = 0.0
    rate_rps: float = 0.0
    rows: list[Row] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    outcomes: dict[str, list[dict]] = field(default_factory=dict)
    """Per scenario, each request's arrival, TTFT and class (for the plot)."""


def _prompt_texts(o: ChaosOptions) -> list[tuple[str, int]]:
    rng = random.Random(o.seed)
    return [(f"Request {i}. " + TEXT * 8, rng.randint(*o.prompt_tokens))
            for i in range(o.prompts)]


async def _prompts(target: str, o: ChaosOptions) -> list[list[int]]:
    async with AsyncClient(target) as client:
        return [(await client.tokenize(text))[:n] for text, n in _prompt_texts(o)]


async def _references(target: str, prompts: list[list[int]], max_tokens: int
                      ) -> list[list[int]]:
    async with AsyncClient(target) as client:
        return [(await client.generate(p, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True)).token_ids for p in prompts]


async def _capacity(target: str, prompts: list[list[int]], max_tokens: int,
                    in_flight: int) -> float:
    """Requests/s with ``in_flight`` requests always open (each prompt twice)."""
    todo = list(range(2 * len(prompts)))
    async with AsyncClient(target) as client:
        async def lane() -> None:
            while todo:
                i = todo.pop()
                await client.generate(prompts[i % len(prompts)], max_tokens=max_tokens,
                                      temperature=0.0, ignore_eos=True)
        start = time.monotonic()
        await asyncio.gather(*(lane() for _ in range(in_flight)))
        return 2 * len(prompts) / (time.monotonic() - start)


async def _one(client: AsyncClient, prompt: list[int], index: int, arrival: float,
               start: float, request_id: str, max_tokens: int,
               cancel_after: float | None) -> Outcome:
    out = Outcome(index, arrival)
    sent = time.monotonic()

    async def consume() -> None:
        async for msg in client.stream(prompt, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True, request_id=request_id,
                                       timeout=120):
            if msg.token_ids and out.ttft_s is None:
                out.ttft_s = time.monotonic() - sent
            out.tokens.extend(msg.token_ids)
            if msg.finish_reason:
                out.migrations = msg.routing.migrations
                r = msg.routing
                out.route = (f"{r.worker} -> {r.decode_worker}" if r.decode_worker
                             and r.decode_worker != r.worker else r.worker) + f" ({r.reason})"

    try:
        if cancel_after is None:
            await consume()
        else:
            await asyncio.wait_for(consume(), cancel_after)
    except TimeoutError:
        out.cancelled = True
    except Exception as e:  # noqa: BLE001 - the oracle counts it
        code = getattr(e, "code", None)
        out.error = code().name if callable(code) else type(e).__name__
    return out


async def _cycle(cluster: ChaosTarget, o: ChaosOptions, scenario: str, k: int,
                 prompts: list[list[int]], rate: float, rng: random.Random
                 ) -> tuple[list[Outcome], Fault, int]:
    """One fault under load: ``pre_s`` of load, the fault, ``post_s`` more, and on
    while the fault lasts (a stop, a killed component not yet back) plus ``post_s / 2``
    after it ends, so that a recovery slower than ``post_s`` is measured, not cut off.
    Returns the outcomes, the fault and how many times streams resumed on another
    router."""
    duration = o.pre_s + o.post_s
    horizon = duration + 180.0  # arrivals drawn this far; the load ends well before
    times = [t for t in arrival_times(int(rate * horizon * 1.5) + 10, rate,
                                      seed=rng.randrange(1 << 30)) if t < horizon]
    victim = victim_of(cluster, scenario, k) if scenario not in ("none", "flip-kv",
                                                                "cancel") else ""
    fault = Fault(scenario, victim, o.pre_s)
    flip_window = (o.pre_s, o.pre_s + 2.0)
    end = duration  # the load's end: pushed past a fault that outlasts post_s
    async with AsyncClient(cluster.targets) as client:
        start = time.monotonic()

        async def at(t: float) -> None:
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))

        async def do_fault() -> None:
            nonlocal end
            await at(o.pre_s)
            before = (await asyncio.to_thread(component_of, cluster, victim)).restarts \
                if scenario in KILLS else 0
            fault.note = await inject(cluster, scenario, victim, rng, o.stop_s)
            if scenario in KILLS:  # inject's last act was the signal
                fault.at_s = time.monotonic() - start
                fault.restored_s = await asyncio.to_thread(wait_restored, cluster, victim,
                                                           before)
            end = max(end, time.monotonic() - start + o.post_s / 2)

        async def request(n: int, t: float) -> Outcome:
            i = n % len(prompts)
            rid = f"chaos-{scenario}-{k}-{n}"
            if scenario == "flip-kv" and flip_window[0] <= t < flip_window[1]:
                rid += f"-{FLIP_MARK}"
            # Log-uniform over 5 ms .. 1.5 s: as many cuts early as late in a request's
            # life, for a tiny model's 50 ms requests as for a real one's seconds.
            cancel = (math.exp(rng.uniform(math.log(0.005), math.log(1.5)))
                      if scenario == "cancel" and t >= o.pre_s
                      and rng.random() < o.cancel_fraction else None)
            return await _one(client, prompts[i], i, t, start, rid, o.max_tokens, cancel)

        fault_task = asyncio.ensure_future(do_fault())
        sent = []
        for n, t in enumerate(times):
            await at(t)
            if t >= end and fault_task.done():
                break
            sent.append(asyncio.ensure_future(request(n, t)))
        outcomes = await asyncio.gather(*sent)
        await fault_task
        return list(outcomes), fault, client.resumes


def _window_s(rate_rps: float) -> float:
    """The recovery rule's window: ~10 arrivals, at least 3 s (at a few requests per
    second a 3 s window's p99 is the max of a handful: noise, not an outage)."""
    return max(3.0, 10.0 / max(rate_rps, 1e-9))


def _score(row: Row, cycles: list[tuple[list[Outcome], float]], pre_s: float,
           rate_rps: float) -> None:
    """``row``'s pooled baseline and its recoveries, per fault and pooled."""
    row.baseline_ttft_s = baseline_p99(cycles, pre_s)
    if row.baseline_ttft_s is None:
        row.recovery_s, row.pooled_recovery_s = [None] * len(cycles), None
        return
    row.recovery_s = [recovery_s(outs, t, pre_s, baseline_s=row.baseline_ttft_s,
                                 window_s=_window_s(rate_rps)) for outs, t in cycles]
    row.pooled_recovery_s = pooled_recovery_s(
        cycles, row.baseline_ttft_s, window_s=_pooled_window_s(rate_rps, len(cycles)))


def _cycles_of(points: list[dict]) -> list[tuple[list[Outcome], float]]:
    """A report's outcomes of one scenario (time since their fault) back into cycles,
    each with its fault at 0: by their ``fault`` index, or, in reports written before
    it was recorded, where time since the fault drops (the next cycle's pre window)."""
    cycles: list[list[Outcome]] = []
    last: object = None
    prev = math.inf
    for p in points:
        key = p.get("fault")
        if not cycles or (key != last if key is not None else p["t"] < prev - 1.0):
            cycles.append([])
        last, prev = key, p["t"]
        cycles[-1].append(Outcome(-1, p["t"], ttft_s=p["ttft_s"], error=p["error"],
                                  cancelled=p["cancelled"]))
    return [(c, 0.0) for c in cycles]


def rescore(report: dict) -> dict:
    """The report with each row's baseline and recoveries computed again from its own
    outcomes by this version's rule (how a run is read again after the rule changed,
    without rerunning it). Pure: a new dict."""
    pre_s = report["options"]["pre_s"]
    shapes = []
    for shape in report["shapes"]:
        rows = []
        for r in shape["rows"]:
            row = Row(**{f.name: r[f.name] for f in fields(Row) if f.name in r})
            _score(row, _cycles_of(shape["outcomes"].get(r["scenario"], [])), pre_s,
                   shape["rate_rps"])
            rows.append({**r, "baseline_ttft_s": row.baseline_ttft_s,
                         "recovery_s": row.recovery_s,
                         "pooled_recovery_s": row.pooled_recovery_s,
                         "worst_recovery_s": row.worst_recovery_s})
        shapes.append({**shape, "rows": rows})
    return {**report, "shapes": shapes}


def _pooled_window_s(rate_rps: float, faults: int) -> float:
    """The pooled rule's window: ~150 arrivals over all faults (100 must be there for a
    window to be judged), at least 0.5 s."""
    return max(0.5, 150.0 / max(rate_rps * faults, 1e-9))


def _failed_transfers(cluster: ChaosTarget) -> int:
    """KV transfers the decode workers counted as failed so far (a corrupted payload
    refused by its checksum is one)."""
    with Client(cluster.target) as client:
        return sum(w.transfers.entered["failed"] for w in client.status().workers
                   if w.role == "decode")


def _cluster(o: ChaosOptions, shape: str, parse: ParseComponent | None) -> ChaosTarget:
    from cluster.net import free_port

    os.environ[FLIP_ENV] = FLIP_MARK  # the prefill workers' hook; inherited at start
    config = LocalClusterConfig(
        model=o.model, port=free_port(), http_port=0, dtype=o.dtype,
        kv_cache_gb=o.kv_cache_gb, block_size=o.block_size, max_model_len=o.max_model_len,
        transfer_timeout_s=5.0, prefill_queue_limit=o.prefill_queue_limit,
        log_dir=str(Path(o.out_dir) / f"logs-{shape}"),
        **SHAPES[shape])  # type: ignore[arg-type]
    if o.launcher == "ray":
        from .chaos_ray import RayTarget  # imports Ray: only when asked for

        assert parse is not None  # run_chaos checked
        # The router actor serves no /metrics: the default port (9400) may be taken on a
        # shared machine, and the harness reads the router's status over gRPC.
        return RayTarget(replace(config, launcher="ray", metrics_port=None), parse)
    policy = RestartPolicy(max_restarts=10, window_s=60.0)
    if shape == "hosts":
        # The routers' /metrics stay in their host; the harness reads status over gRPC.
        return HostsTarget(replace(config, metrics_port=None), policy)
    return ProcessTarget(LocalCluster(config, policy, routers=2))


def run_shape(o: ChaosOptions, shape: str, scenarios: list[str],
              say: Callable[[str], None] = print,
              parse: ParseComponent | None = None) -> ShapeRun:
    """Every scenario of one cluster shape (module docstring); ``parse``: see
    :func:`run_chaos`."""
    result = ShapeRun(shape)
    cluster = _cluster(o, shape, parse)
    cluster.start()
    try:
        cluster.wait_ready(300)
        prompts = asyncio.run(_prompts(cluster.target, o))
        refs = asyncio.run(_references(cluster.target, prompts, o.max_tokens))
        workers = sum(c.role in WORKER_ROLES for c in cluster.components())
        result.capacity_rps = asyncio.run(_capacity(cluster.target, prompts, o.max_tokens,
                                                    2 * workers))
        result.rate_rps = o.load * result.capacity_rps
        say(f"[{shape}] capacity {result.capacity_rps:.2f} req/s; load "
            f"{result.rate_rps:.2f} req/s ({o.load:.0%})")
        rng = random.Random(o.seed)
        for scenario in scenarios:
            row = Row(scenario, 0, 0)
            restarts_before = sum(c.restarts for c in cluster.components())
            seen: list[dict] = []
            cycles: list[tuple[list[Outcome], float]] = []
            for k in range(o.faults):
                refused = _failed_transfers(cluster)
                outcomes, fault, resumes = asyncio.run(_cycle(cluster, o, scenario, k,
                                                              prompts, result.rate_rps, rng))
                row.resumes += resumes
                row.faults += scenario != "none"
                row.add(outcomes, refs)
                cycles.append((outcomes, fault.at_s))
                if scenario in KILLS:
                    row.restored_s.append(None if fault.restored_s is None
                                          else round(fault.restored_s, 2))
                back = wait_whole(cluster)
                row.failed_transfers += max(0, _failed_transfers(cluster) - refused)
                leaked, detail = leaked_blocks(cluster)
                row.leaked_blocks += leaked
                if detail:
                    row.notes.append(f"fault {k}: not idle: {detail}")
                if fault.note:
                    row.notes.append(f"fault {k}: {fault.note}")
                result.faults.append(fault)
                seen += [{"t": x.arrival_s - fault.at_s, "ttft_s": x.ttft_s,
                          "error": x.error, "cancelled": x.cancelled, "fault": k,
                          "route": x.route}
                         for x in outcomes]
                restored = ("" if scenario not in KILLS else
                            f"back and listed {fault.restored_s:.1f} s after the kill, "
                            if fault.restored_s is not None else "NOT back, ")
                say(f"[{shape}] {scenario} {k + 1}/{o.faults}: {len(outcomes)} requests, "
                    f"{row.failures} failed, {row.bad_tokens} bad streams, {restored}"
                    f"whole {back:.1f} s after the load, {leaked} blocks leaked")
            _score(row, cycles, o.pre_s, result.rate_rps)
            say(f"[{shape}] {scenario}: pre-fault TTFT p99 {row.baseline_ttft_s} s "
                f"(pooled), recovery {row.pooled_recovery_s} s (pooled), per fault "
                f"{row.recovery_s}")
            row.restarts = sum(c.restarts for c in cluster.components()) - restarts_before
            result.rows.append(row)
            result.outcomes[scenario] = seen
    finally:
        cluster.stop()
    return result


def run_chaos(o: ChaosOptions, say: Callable[[str], None] = print,
              parse: ParseComponent | None = None) -> dict:
    """Every scenario asked for, shape by shape; the report's JSON object. ``parse``:
    with ``launcher="ray"``, the CLI's component parser (``cluster.cli.component.
    component_config``), which this layer may not import (the composition root hands it
    in, as ``pdserve up`` does). Raises ValueError before starting anything when a
    scenario is unknown or the launcher cannot run it."""
    unknown = sorted(set(o.scenarios) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"unknown scenarios {unknown}; choose from {list(SCENARIOS)}")
    why = launcher_refuses(o.launcher, o.scenarios)
    if why:
        raise ValueError("; ".join(why))
    if o.launcher == "ray" and parse is None:
        raise ValueError("launcher 'ray' needs parse (cluster.cli.component.component_config)")
    if set(o.scenarios) & set(NETWORK) and (no_hosts := hosts_unavailable()):
        raise ValueError(f"the network scenarios ({', '.join(NETWORK)}) run the cluster over "
                         f"test hosts, which cannot be made here: {no_hosts}")
    runs = []
    for shape in SHAPES:
        mine = [s for s in o.scenarios if shape_of(s) == shape]
        if mine:
            runs.append(run_shape(o, shape, mine, say, parse))
    return {"options": asdict(o), "shapes": [
        {"shape": r.shape, "capacity_rps": r.capacity_rps, "rate_rps": r.rate_rps,
         "rows": [{**asdict(row), "bad_tokens": row.bad_tokens,
                   "worst_recovery_s": row.worst_recovery_s,
                   "worst_restored_s": row.worst_restored_s} for row in r.rows],
         "faults": [asdict(f) for f in r.faults], "outcomes": r.outcomes}
        for r in runs]}
