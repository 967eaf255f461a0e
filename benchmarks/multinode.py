"""``pdserve bench-multinode``: the KV transfer and the serving path across a link.

Three test hosts (network namespaces on a private bridge, :mod:`cluster.testhosts`);
every link condition is put on a host's veth link with ``tc`` (``Host.shape``): a token
bucket (``tbf``) for a rate, ``netem`` for a delay where the kernel has it (where it does
not, the condition is reported as not available, never faked). One run:

1. **Link rate.** :mod:`benchmarks.transfer`'s parent runs in host 1 and its child in
   host 2: one request's SmolLM2-135M-shaped KV (``--tokens``, per dtype) goes over the
   real channel (``KVSender`` -> ``KVReceiver``, the direct framing into reserved blocks
   of a paged cache, and ``send_blocks`` gathering out of the prefill's paged cache
   first), alternating per iteration with a raw TCP copy of the same bytes over the same
   link. Per link condition (``--link-conditions``, on the link into host 2): GB/s of
   each and channel / raw; host 2's ``eth0`` counters confirm the bytes crossed it.
2. **Serving across the link.** Ray's head and ``pdserve up`` on host 0 (``pdserve up``
   starts its own Redis there, bound to host 0's address, with a password), the prefill
   worker on host 1 and the decode worker on host 2 by node labels, every prompt sent
   remote (``--local-prefill-threshold 0``). Per condition (``--conditions``, on the
   links into hosts 1 and 2), lone greedy requests of ``--prompt-tokens`` random token
   ids (unique, with a distinct cache salt: nothing cached) and ``--max-tokens``,
   streamed by :class:`router.client.Client` from outside the hosts: TTFT (the first
   token comes from the prefill worker, before the KV moves) and the first -> second
   token gap (the KV transfer to host 2 plus the decode worker's first step), p50; and
   the KV rate the prefill worker's transfer counters saw. The cluster runs once per
   KV offer protocol of ``--kv-offers`` (``pdserve up --kv-offer``: ``layers`` streams
   each layer's KV while the prefill computes it, ``after`` offers the KV once the
   step has ended), each on a fresh Ray, the protocols alternated ``--rounds`` times (a
   row pools its rounds' requests); each condition's gap is also given as a ratio to the
   last protocol's in the same condition.

Prints the workload, the machine and markdown tables with the ratios on stdout (progress
on stderr); writes ``results.json``, ``results.md`` and ``results.png`` to ``--out``.
Runs only inside a private network namespace (``unshare -n``); the CLI re-executes
itself under one when it can.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.machine import machine_line
from benchmarks.transfer import BLOCK, HEAD_DIM, KV_HEADS, LAYERS
from cluster.deployment import KV_OFFERS
from cluster.testcluster import RayOnHosts
from cluster.testhosts import HostsError, TestHosts, interfaces, unavailable
from router.client import Client

PREFILL_LABEL = "pdserve.io/pool=prefill"
DECODE_LABEL = "pdserve.io/pool=decode"
LABELS = {1: PREFILL_LABEL, 2: DECODE_LABEL}
REEXEC_ENV = "PDSERVE_BENCH_MULTINODE_UNSHARED"
_RATE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_DELAY = re.compile(r"^(\d+(\.\d+)?)(us|ms|s)?$")
_DELAY_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, None: 1.0}


# --- link conditions ------------------------------------------------------------------

@dataclass(frozen=True)
class Condition:
    """One link condition: a ``tc tbf`` rate and/or a ``tc netem`` delay (neither: the
    link as it is)."""

    rate: str | None = None
    delay_ms: float = 0.0

    @property
    def name(self) -> str:
        parts = ([f"tbf {self.rate}"] if self.rate else []) + (
            [f"netem delay {self.delay_ms:g} ms"] if self.delay_ms else [])
        return " + ".join(parts) or "unshaped"

    @property
    def shaped(self) -> bool:
        return bool(self.rate or self.delay_ms)


def parse_condition(text: str) -> Condition:
    """``none`` (or ``unshaped``), ``rate=1gbit`` (or just ``1gbit``), ``delay=10ms`` (or
    just ``10ms``; a bare number is milliseconds), or a rate and a delay joined by
    ``+``."""
    text = text.strip().lower()
    if text in ("none", "unshaped"):
        return Condition()
    rate, delay = None, 0.0
    for part in text.split("+"):
        key, _, value = part.strip().rpartition("=")
        if key not in ("", "rate", "delay"):
            raise ValueError(f"{part!r}: a condition is rate=RATE, delay=DELAY or none")
        if key == "rate" or (not key and _RATE.match(value)):
            if not _RATE.match(value):
                raise ValueError(f"{part!r}: a rate is tc's, such as 100mbit or 1gbit")
            if rate is not None:
                raise ValueError(f"{text!r}: two rates")
            rate = value
            continue
        found = _DELAY.match(value)
        if not found:
            raise ValueError(f"{part!r}: a delay is such as 1ms or 10ms; a rate such as "
                             "1gbit")
        if delay:
            raise ValueError(f"{text!r}: two delays")
        delay = float(found.group(1)) * _DELAY_MS[found.group(3)]
        if delay <= 0:
            raise ValueError(f"{part!r}: a delay must be positive (none: no shaping)")
    return Condition(rate, delay)


def parse_conditions(text: str) -> tuple[Condition, ...]:
    """A comma-separated list of :func:`parse_condition`'s; no condition twice."""
    conds = tuple(parse_condition(t) for t in text.split(",") if t.strip())
    if not conds:
        raise ValueError("no link condition given")
    if len(set(conds)) != len(conds):
        raise ValueError(f"a link condition is listed twice in {text!r}")
    return conds


def apply(hosts: Sequence, cond: Condition) -> str | None:
    """Put ``cond`` on the link into each of ``hosts``; None, or why it cannot be (then
    every one of them is left unshaped)."""
    try:
        for h in hosts:
            h.shape(rate=cond.rate, delay_ms=cond.delay_ms)
    except HostsError as e:
        clear(hosts)
        return str(e)
    return None


def clear(hosts: Sequence) -> None:
    for h in hosts:
        h.shape()


# --- statistics and tables --------------------------------------------------------------

def p50(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None or math.isnan(x) else format(x, fmt)


@dataclass
class LinkRow:
    """One dtype under one link condition: the channel's and raw TCP's timings."""

    condition: str
    dtype: str = ""
    bytes: int = 0
    times_s: dict[str, list[float]] = field(default_factory=dict)
    link_rx_bytes: int = 0  # what entered host 2 over its link during the condition's run
    link_payload_bytes: int = 0  # the KV and raw payloads sent in it (every dtype and mode)
    unavailable: str | None = None

    def gbps(self, mode: str) -> float:
        return ratio(self.bytes, p50(self.times_s.get(mode, []))) / 1e9

    def vs_raw(self, mode: str) -> float:
        return ratio(self.gbps(mode), self.gbps("raw"))


@dataclass
class SweepRow:
    """One link condition on the serving cluster (under one KV offer protocol)."""

    condition: str
    ttft_s: list[float] = field(default_factory=list)
    gap_s: list[float] = field(default_factory=list)
    kv_bytes: int = 0  # the prefill worker's transfer counters, over the timed requests
    kv_busy_s: float = 0.0
    unavailable: str | None = None
    kv_offer: str = ""  # the cluster's ``pdserve up --kv-offer``

    @property
    def ttft_p50(self) -> float:
        return p50(self.ttft_s)

    @property
    def gap_p50(self) -> float:
        return p50(self.gap_s)

    @property
    def kv_gbps(self) -> float:
        return ratio(self.kv_bytes, self.kv_busy_s) / 1e9


def link_table(rows: Sequence[LinkRow]) -> str:
    lines = ["| link into host 2 | dtype | KV MB | raw TCP GB/s | channel direct GB/s | "
             "direct / raw | channel gather GB/s | gather / raw |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.unavailable:
            lines.append(f"| {r.condition} | not available: {r.unavailable} |"
                         + " |" * 6)
            continue
        lines.append(
            f"| {r.condition} | {r.dtype} | {r.bytes / 1e6:.1f} | {_num(r.gbps('raw'), '.3f')} "
            f"| {_num(r.gbps('direct'), '.3f')} | {_num(r.vs_raw('direct'), '.0%')} "
            f"| {_num(r.gbps('gather'), '.3f')} | {_num(r.vs_raw('gather'), '.0%')} |")
    return "\n".join(lines)


def _row(rows: Sequence[SweepRow], condition: str, kv_offer: str) -> SweepRow | None:
    return next((r for r in rows if r.condition == condition and r.kv_offer == kv_offer
                 and not r.unavailable), None)


def sweep_table(rows: Sequence[SweepRow]) -> str:
    """The serving sweep, a row per KV offer protocol and condition. Ratios: against the
    unshaped row of the same protocol, and the gap against the last protocol's in the
    same condition (the baseline: with the default ``--kv-offers``, ``after``)."""
    offers = list(dict.fromkeys(r.kv_offer for r in rows))
    baseline = offers[-1] if len(offers) > 1 else None
    lines = ["| KV offer | links into hosts 1, 2 | n | TTFT p50 ms | TTFT / unshaped | "
             "1st→2nd token gap p50 ms | gap / unshaped | "
             f"gap / {baseline or 'baseline'} | KV GB/s (prefill counters) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.unavailable:
            lines.append(f"| {r.kv_offer} | {r.condition} | not available: {r.unavailable} |"
                         + " |" * 6)
            continue
        base = _row(rows, "unshaped", r.kv_offer)
        other = _row(rows, r.condition, baseline) if baseline else None
        t, g = r.ttft_p50, r.gap_p50
        lines.append(
            f"| {r.kv_offer} | {r.condition} | {len(r.ttft_s)} | {_num(t * 1e3, '.1f')} "
            f"| {_num(ratio(t, base.ttft_p50) if base else math.nan, '.2f')} "
            f"| {_num(g * 1e3, '.1f')} "
            f"| {_num(ratio(g, base.gap_p50) if base else math.nan, '.2f')} "
            f"| {_num(ratio(g, other.gap_p50) if other else math.nan, '.2f')} "
            f"| {_num(r.kv_gbps, '.3f')} |")
    return "\n".join(lines)


# --- the benchmark ----------------------------------------------------------------------

@dataclass(frozen=True)
class MultinodeOptions:
    model: str
    tokens: int = 2048
    dtypes: str = "float32,bfloat16"
    link_conditions: tuple[Condition, ...] = (Condition(), Condition("1gbit"))
    transfer_iters: int = 4
    conditions: tuple[Condition, ...] = (Condition(), Condition("1gbit"),
                                         Condition("100mbit"), Condition(delay_ms=1.0),
                                         Condition(delay_ms=10.0))
    kv_offers: tuple[str, ...] = ("layers", "after")
    rounds: int = 2
    requests: int = 8
    prompt_tokens: int = 512
    max_tokens: int = 8
    dtype: str = "float32"
    seed: int = 0
    out: str = "loadtest/results/multinode"


def _say(msg: str) -> None:
    print(f"[bench-multinode {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure_link(hosts: TestHosts, opts: MultinodeOptions, cond: Condition,
                 out: Path) -> list[LinkRow]:
    """:mod:`benchmarks.transfer` from host 1 to host 2 under ``cond`` (on the link into
    host 2)."""
    why = apply([hosts[2]], cond)
    if why:
        _say(f"link rate, {cond.name}: not available: {why}")
        return [LinkRow(cond.name, unavailable=why)]
    _say(f"link rate, {cond.name}: KV host 1 -> host 2 ({opts.tokens} tokens, "
         f"{opts.dtypes}), channel and raw TCP alternating")
    try:
        rx0 = hosts[2].counters()["rx_bytes"]
        r = hosts[1].run([sys.executable, "-m", "benchmarks.transfer",
                          "--tokens", str(opts.tokens), "--dtypes", opts.dtypes,
                          "--iters", str(opts.transfer_iters), "--warmup", "1",
                          "--modes", "raw,direct,gather", "--bind", hosts[1].ip,
                          "--child-bind", hosts[2].ip, "--child-netns", hosts[2].netns,
                          "--json", str(out)],
                         timeout=600, stdout=sys.stderr, stderr=sys.stderr)
        rx = hosts[2].counters()["rx_bytes"] - rx0
    finally:
        clear([hosts[2]])
    if r.returncode:
        raise RuntimeError(f"the transfer benchmark across the link failed ({r.returncode})")
    data = json.loads(out.read_text())
    sent = sum(d["bytes"] * len(data["modes"]) * (data["iters"] + data["warmup"])
               for d in data["dtypes"].values())
    return [LinkRow(cond.name, dtype, d["bytes"], d["times_s"], rx, sent)
            for dtype, d in data["dtypes"].items()]


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def time_request(client: Client, prompt: list[int], max_tokens: int, salt: str
                 ) -> tuple[float, float]:
    """One streamed greedy request: (TTFT, first -> second token gap), seconds, as the
    client sees the tokens arrive."""
    t0 = time.perf_counter()
    at: list[float] = []
    for msg in client.stream(prompt, max_tokens=max_tokens, temperature=0.0,
                             ignore_eos=True, cache_salt=salt):
        now = time.perf_counter()
        at.extend([now] * len(msg.token_ids))
    if len(at) < 2:
        raise RuntimeError(f"a request streamed {len(at)} token(s), wanted {max_tokens}")
    return at[0] - t0, at[1] - at[0]


def _prefill_counters(client: Client, prefill_ip: str) -> tuple[int, float]:
    [w] = [w for w in client.status().workers
           if w.role == "prefill" and w.address.startswith(prefill_ip + ":")]
    return w.transfers.bytes_moved, w.transfers.busy_s


RAY_PORT = 6480  # not RayOnHosts' default: a test run beside this one keeps its own


def pool_rounds(rows: Sequence[SweepRow]) -> list[SweepRow]:
    """One row per (protocol, condition), in first-seen order: the requests of every
    round's row together, the prefill counters summed; unavailable only where every
    round's was."""
    pooled: dict[tuple[str, str], SweepRow] = {}
    for r in rows:
        key = (r.kv_offer, r.condition)
        if key not in pooled:
            pooled[key] = SweepRow(r.condition, unavailable=r.unavailable, kv_offer=r.kv_offer)
        p = pooled[key]
        p.ttft_s += r.ttft_s
        p.gap_s += r.gap_s
        p.kv_bytes += r.kv_bytes
        p.kv_busy_s += r.kv_busy_s
        p.unavailable = p.unavailable if p.unavailable and r.unavailable else None
    return list(pooled.values())


def parse_kv_offers(text: str) -> tuple[str, ...]:
    """A comma-separated list of ``pdserve up --kv-offer`` protocols, none twice."""
    offers = tuple(t.strip().lower() for t in text.split(",") if t.strip())
    if not offers:
        raise ValueError("no KV offer protocol given")
    bad = [o for o in offers if o not in KV_OFFERS]
    if bad:
        raise ValueError(f"unknown KV offer protocol {bad[0]!r}: one of {', '.join(KV_OFFERS)}")
    if len(set(offers)) != len(offers):
        raise ValueError(f"a KV offer protocol is listed twice in {text!r}")
    return offers


def measure_serving(hosts: TestHosts, opts: MultinodeOptions, log_dir: Path, kv_offer: str,
                    rng: random.Random) -> tuple[list[SweepRow], dict]:
    """The cluster on the hosts (a fresh Ray, ``pdserve up --kv-offer kv_offer``), and
    every condition of ``opts.conditions`` on it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    ray = RayOnHosts(hosts, LABELS, log_dir, port=RAY_PORT)
    rows: list[SweepRow] = []
    info: dict = {}
    try:
        _say("serving: starting Ray (head on host 0, nodes on hosts 1 and 2)")
        ray.start()
        _say(f"serving, --kv-offer {kv_offer}: pdserve up on host 0 (its own Redis), "
             "prefill on host 1, decode on host 2")
        target = ray.up("--model", opts.model, "--prefill", "1", "--decode", "1",
                        "--prefill-node-labels", PREFILL_LABEL,
                        "--decode-node-labels", DECODE_LABEL,
                        "--local-prefill-threshold", "0", "--dtype", opts.dtype,
                        "--threads", "1", "--kv-cache-gb", "0.25",
                        "--max-model-len", str(max(1024, opts.prompt_tokens + 64)),
                        "--kv-offer", kv_offer, "--no-dashboard")
        info = _placement(ray, hosts)
        _say(f"serving: up in {ray.started_s():.1f}s; {info}")
        with Client(target) as client:
            for i in range(2):  # warm-up: pairs open, first steps
                time_request(client, _prompt(rng, opts.prompt_tokens), opts.max_tokens,
                             f"warm-{i}")
            for cond in opts.conditions:
                rows.append(_condition(client, hosts, opts, cond, rng, kv_offer))
    finally:
        clear([hosts[1], hosts[2]])
        code = ray.stop()  # SIGTERM to pdserve up, then every process on every host
    info["pdserve_up_exit"] = code
    return rows, info


def _condition(client: Client, hosts: TestHosts, opts: MultinodeOptions, cond: Condition,
               rng: random.Random, kv_offer: str) -> SweepRow:
    why = apply([hosts[1], hosts[2]], cond)
    if why:
        _say(f"serving, {kv_offer}, {cond.name}: not available: {why}")
        return SweepRow(cond.name, unavailable=why, kv_offer=kv_offer)
    row = SweepRow(cond.name, kv_offer=kv_offer)
    try:
        time_request(client, _prompt(rng, opts.prompt_tokens), opts.max_tokens,
                     f"{cond.name}-warm")
        b0, s0 = _prefill_counters(client, hosts[1].ip)
        for i in range(opts.requests):
            ttft, gap = time_request(client, _prompt(rng, opts.prompt_tokens),
                                     opts.max_tokens, f"{cond.name}-{i}")
            row.ttft_s.append(ttft)
            row.gap_s.append(gap)
        time.sleep(0.3)  # the counters are final once the last transfer is done
        b1, s1 = _prefill_counters(client, hosts[1].ip)
        row.kv_bytes, row.kv_busy_s = b1 - b0, s1 - s0
    finally:
        clear([hosts[1], hosts[2]])
    _say(f"serving, {kv_offer}, {cond.name}: TTFT p50 {row.ttft_p50 * 1e3:.1f} ms, "
         f"1st->2nd gap p50 {row.gap_p50 * 1e3:.1f} ms, KV {row.kv_bytes / 1e6:.0f} MB at "
         f"{row.kv_gbps:.3f} GB/s")
    return row


def _placement(ray: RayOnHosts, hosts: TestHosts) -> dict:
    """Where the actors landed (``pdserve status --ray``) and where the Redis ``pdserve
    up`` started listens, and whether it refuses a client without the password."""
    actors = {a["name"]: a.get("node_ip") for a in ray.view()["ray"]["actors"]}
    r = hosts[0].run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=10)
    found = [line.split()[3] for line in r.stdout.splitlines() if '"redis-server"' in line]
    return {"actors": actors, "redis": found, "redis_auth": [_redis_auth(a) for a in found]}


def _redis_auth(address: str) -> str:
    import redis

    host, port = address.rsplit(":", 1)
    try:
        redis.Redis(host=host, port=int(port), socket_timeout=5).ping()
    except redis.AuthenticationError:
        return "refuses a client without the password"
    except redis.RedisError as e:
        return f"no answer ({e})"
    return "NO PASSWORD: answered a client without one"


def plot(link: Sequence[LinkRow], sweep: Sequence[SweepRow], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2),
                               gridspec_kw={"width_ratios": [2, 3]})
    ok = [r for r in link if not r.unavailable]
    xs = range(len(ok))
    w = 0.27
    for k, (mode, label, color) in enumerate((("raw", "raw TCP", "#999999"),
                                              ("direct", "KV channel, direct", "#4c72b0"),
                                              ("gather", "KV channel, gather", "#8172b3"))):
        a.bar([x + (k - 1) * w for x in xs], [r.gbps(mode) for r in ok], w, label=label,
              color=color)
    a.set_yscale("log")
    a.set_xticks(list(xs), [f"{r.condition}\n{r.dtype}" for r in ok], fontsize=8)
    a.set_ylabel("GB/s, host 1 → host 2 (p50, log scale)")
    a.set_title("KV transfer across the veth link", fontsize=10)
    a.legend(fontsize=8)
    conds = list(dict.fromkeys(r.condition for r in sweep))
    offers = list(dict.fromkeys(r.kv_offer for r in sweep))
    xs = range(len(conds))
    w = 0.8 / (2 * len(offers))
    colors = (("#dd8452", "#55a868"), ("#f0b27a", "#a9d18e"), ("#c44e52", "#2f6b3a"))
    for k, offer in enumerate(offers):
        rows = [_row(sweep, c, offer) for c in conds]
        for j, (what, label) in enumerate((("ttft_p50", "TTFT p50"),
                                           ("gap_p50", "1st→2nd token gap p50"))):
            off = (2 * k + j - len(offers) + 0.5) * w
            b.bar([x + off for x in xs],
                  [0.0 if r is None else getattr(r, what) * 1e3 for r in rows],
                  w, label=f"{label}, --kv-offer {offer}", color=colors[k % 3][j])
    for x, c in zip(xs, conds, strict=True):
        if all(r.unavailable for r in sweep if r.condition == c):
            b.text(x, 0, "not\navailable", ha="center", va="bottom", fontsize=8)
    b.set_xticks(list(xs), [c.replace("netem ", "netem\n") for c in conds], fontsize=8)
    b.set_ylabel("ms")
    b.set_title("Serving across the links (links into hosts 1 and 2 shaped)", fontsize=10)
    b.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _kv_mb(tokens: int, itemsize: int) -> float:
    return LAYERS * 2 * tokens * KV_HEADS * HEAD_DIM * itemsize / 1e6


def report(opts: MultinodeOptions, link: Sequence[LinkRow], sweep: Sequence[SweepRow],
           info: dict, load: tuple[tuple[float, ...], tuple[float, ...]],
           elapsed_s: float) -> str:
    """The markdown: workload, machine, both tables, the ratios."""
    model = Path(opts.model).name
    itemsize = 4 if opts.dtype == "float32" else 2
    lines = [
        "# pdserve bench-multinode",
        "",
        f"Workload: 3 test hosts (network namespaces on a veth bridge). **Link rate**: one "
        f"request's {opts.tokens}-token KV of {model}'s shape ({LAYERS} layers, {KV_HEADS} kv "
        f"heads, head_dim {HEAD_DIM}, block {BLOCK}; {opts.dtypes}) from a process in host 1 "
        f"to one in host 2 over the real channel (direct: into reserved blocks; gather: "
        f"send_blocks out of a paged cache) alternating with a raw TCP copy of the same "
        f"bytes over the same link, {opts.transfer_iters} timed iterations after 1 warm-up, "
        f"p50. **Serving**: Ray head + `pdserve up` (its own Redis) on host 0, prefill on "
        f"host 1 and decode on host 2 by node labels, --local-prefill-threshold 0, "
        f"{model} {opts.dtype}, 1 thread per worker, once per `--kv-offer` of "
        f"{', '.join(opts.kv_offers)} (each on a fresh Ray, alternated {opts.rounds} "
        f"time(s)); per condition and round {opts.requests} sequential greedy requests "
        f"(after 1 warm-up) of {opts.prompt_tokens} random token "
        f"ids with distinct cache salts (nothing cached; {_kv_mb(opts.prompt_tokens, itemsize):.1f}"
        f" MB of KV each), max_tokens {opts.max_tokens}, streamed from outside the hosts.",
        "",
        f"Machine: {machine_line()}; loadavg before {' '.join(f'{x:.2f}' for x in load[0])}, "
        f"after {' '.join(f'{x:.2f}' for x in load[1])}; run took {elapsed_s:.0f} s "
        "(another workload may share the cores: compare ratios within the run).",
        "",
        "## KV transfer across the link (host 1 → host 2)",
        "",
        link_table(link),
        "",
    ]
    for r in link:
        if not r.unavailable:
            lines.append(f"- {r.condition}, {r.dtype}: channel direct / raw TCP = "
                         f"{_num(r.vs_raw('direct'), '.0%')}, gather / raw = "
                         f"{_num(r.vs_raw('gather'), '.0%')}")
    for cond in dict.fromkeys(r.condition for r in link if not r.unavailable):
        r = next(x for x in link if x.condition == cond)
        lines.append(f"- {cond}: {r.link_rx_bytes / 1e6:.0f} MB entered host 2 over its "
                     f"link while {r.link_payload_bytes / 1e6:.0f} MB of payload were sent "
                     "(every dtype and mode, warm-up included)")
    lines += ["", "## Serving across the links (TTFT, first → second token gap)", "",
              sweep_table(sweep), ""]
    baseline = opts.kv_offers[-1] if len(opts.kv_offers) > 1 else None
    for r in sweep:
        base = _row(sweep, "unshaped", r.kv_offer)
        if base is not None and r is not base and not r.unavailable:
            t, g = ratio(r.ttft_p50, base.ttft_p50), ratio(r.gap_p50, base.gap_p50)
            lines.append(f"- {r.kv_offer}, {r.condition} vs unshaped: TTFT x{_num(t, '.2f')}, "
                         f"first → second token gap x{_num(g, '.2f')}")
    for r in sweep:
        other = _row(sweep, r.condition, baseline) if baseline else None
        if other is not None and r.kv_offer != baseline and not r.unavailable:
            lines.append(f"- {r.condition}: `--kv-offer {r.kv_offer}` vs `{baseline}`: first → "
                         f"second token gap x{_num(ratio(r.gap_p50, other.gap_p50), '.2f')}, "
                         f"TTFT x{_num(ratio(r.ttft_p50, other.ttft_p50), '.2f')}")
    if info:
        redis = "; ".join(f"{a} ({why})" for a, why in
                          zip(info.get("redis", []), info.get("redis_auth", []), strict=True))
        actors = ", ".join(f"{k} on {v}" for k, v in sorted(info.get("actors", {}).items()))
        lines += ["", f"Placement: {actors}. Redis started by `pdserve up`: "
                  f"{redis or 'none found listening on host 0'}. `pdserve up` exited "
                  f"{info.get('pdserve_up_exit')} on SIGTERM (each cluster's, in order)."]
    lines += ["", "The first token comes from the prefill worker before any KV moves (TTFT "
              "pays the prompt's trip and the prefill); the gap to the second pays what is "
              "left of the KV transfer into host 2 and the decode worker's first step. "
              "Under `layers` most of the KV crosses while the prefill computes; the "
              "prefill's counters time a transfer from the whole KV's being ready, so "
              "their rate reads the link only under `after`. tbf shapes the bridge's "
              "egress into a host; netem needs the kernel's sch_netem."]
    return "\n".join(lines) + "\n"


def run(opts: MultinodeOptions) -> dict:
    start = time.monotonic()
    load0 = os.getloadavg()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdsmn-") as tmp, TestHosts(3) as hosts:
        work = Path(tmp)
        link: list[LinkRow] = []
        for i, cond in enumerate(opts.link_conditions):
            link += measure_link(hosts, opts, cond, work / f"transfer-{i}.json")
        rng = random.Random(opts.seed)
        sweep: list[SweepRow] = []
        info: dict = {}
        logs = out / "logs"
        logs.mkdir(exist_ok=True)
        for k in range(opts.rounds):
            for offer in opts.kv_offers:
                rows, placed = measure_serving(hosts, opts, work / f"{offer}-{k}", offer, rng)
                sweep += rows
                exits = info.get("pdserve_up_exit", [])
                info = {**placed, "pdserve_up_exit": [*exits, placed.get("pdserve_up_exit")]}
                shutil.copy(work / f"{offer}-{k}" / "up.log", logs / f"up-{offer}-{k}.log")
        rounds, sweep = sweep, pool_rounds(sweep)
    load1 = os.getloadavg()
    elapsed = time.monotonic() - start
    md = report(opts, link, sweep, info, (load0, load1), elapsed)
    print(md)
    result = {
        "options": {**asdict(opts), "link_conditions": [c.name for c in opts.link_conditions],
                    "conditions": [c.name for c in opts.conditions]},
        "machine": machine_line(), "loadavg_before": load0, "loadavg_after": load1,
        "elapsed_s": elapsed, "placement": info,
        "link": [{**asdict(r), "gbps_raw": r.gbps("raw"), "gbps_direct": r.gbps("direct"),
                  "gbps_gather": r.gbps("gather"), "direct_vs_raw": r.vs_raw("direct"),
                  "gather_vs_raw": r.vs_raw("gather")} for r in link],
        "serving": [{**asdict(r), "ttft_p50_s": r.ttft_p50, "gap_p50_s": r.gap_p50,
                     "kv_gbps": r.kv_gbps} for r in sweep],
        "serving_rounds": [{**asdict(r), "gap_p50_s": r.gap_p50} for r in rounds],
    }
    (out / "results.json").write_text(json.dumps(_no_nan(result), indent=2))
    (out / "results.md").write_text(md)
    plot(link, sweep, out / "results.png", machine_line())
    _say(f"wrote {out}/results.json, results.md, results.png ({elapsed:.0f} s)")
    return result


def _no_nan(x: object) -> object:
    """``x`` with every NaN float as None (strict JSON)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_no_nan(v) for v in x]
    return x


# --- a private network namespace ---------------------------------------------------------

def private_netns_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` run in a new, private network namespace with only ``lo`` up."""
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


def ensure_private_netns(argv: Sequence[str], env: dict[str, str], again: bool,
                         say: Callable[[str], None]) -> int | None:
    """None: test hosts can be made here, go on. Otherwise run ``argv`` again (with
    ``env``) inside a private network namespace and return its exit code; or, when this
    already is that run again (``again``) or ``unshare -n`` fails, say why not and
    return 1."""
    why = unavailable()
    if why is None:
        return None
    if again or interfaces() == ["lo"]:
        say(f"cannot make test hosts: {why}")
        return 1
    probe = subprocess.run(private_netns_argv(["true"]), capture_output=True, text=True)
    if probe.returncode:
        say(f"test hosts need a private network namespace and `unshare -n` failed "
            f"({probe.stderr.strip()}); as root: unshare -n sh -c 'ip link set lo up && "
            f"{' '.join(argv)}'")
        return 1
    say("not in a private network namespace: running again under `unshare -n sh -c 'ip "
        "link set lo up && ...'` (the test hosts' bridge is all it can reach)")
    return subprocess.run(private_netns_argv(argv), env=env).returncode
