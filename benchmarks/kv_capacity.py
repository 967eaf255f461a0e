"""``pdserve bench-kv``: what a quantized KV cache buys in capacity, decode speed and
transfer size, against the model-precision cache (``auto``), in one run.

For each ``--kv-cache-dtype`` (``auto`` first, the reference; see
:mod:`workers.models.kv_format` for the row formats):

1. **Capacity at a fixed KV budget.** An offline :class:`~workers.engine.llm_engine.LLMEngine`
   with ``kv_cache_gb`` of cache: its blocks and bytes per block (the engine's own
   arithmetic, ``ModelRunner.block_bytes``), and the number of ``seq_tokens``-token
   sequences (prompt + ``output_tokens`` generated) that run **concurrently without
   preemption**: many distinct random prompts (no shared prefix) are admitted at once
   (``max_num_seqs`` far above what fits); every step records which sequences run; the
   result is the largest number that ran in one step among sequences that were never
   preempted and finished their whole length. The run stops once those have finished.
   :func:`expected_concurrent` is the arithmetic floor (every sequence at full length at
   once); admission is staggered (a 2048-token step prefills ~4 prompts), so the oldest
   finish while the newest still grow and the measured count can exceed it by one or two.
   The engine's steps run its scheduler, block pool, bookkeeping and detokenizer as
   always, but its forward is replaced by a stub that samples a fixed token
   (:func:`_without_forward`): with ``ignore_eos`` and no prefix caching the tokens
   cannot change a scheduling decision, so the count is the same, in seconds instead of
   minutes (``full_forward`` runs the model too).
2. **Decode throughput at a large batch and long context.** ``decode_batch`` sequences
   of ``decode_context`` distinct prompt tokens in an engine per dtype; once every
   sequence has its first token (prefill over), ``warmup_steps`` steps, then
   ``decode_rounds`` rounds that time ``decode_steps`` steps of each dtype's engine in
   turn (a shared machine's load drifts; interleaving gives every dtype the same
   conditions): ms per step is the best round (other work on the machine only ever adds
   time; the median is kept too), tokens/s ``decode_batch`` per step
   (each step decodes one token of every sequence, the native kernel reading the cache
   as stored). The prefill is the stub too unless ``full_forward`` (the cache then
   holds zeros: a decode step's work does not depend on the values it reads, every
   block is read and dequantized the same), so the timed steps are the real forward
   over a full-length context without minutes of prefill.
3. **KV transfer on the serving path.** A real :class:`~cluster.local.LocalCluster` per
   dtype (1 prefill + 1 decode worker, ``local_prefill_threshold`` 0, one thread each):
   one warm-up, then ``requests`` distinct ``request_tokens``-token prompts one at a time
   (``request_max_tokens`` each). Bytes per request: the decode worker's
   ``transfers.bytes_moved`` over its done transfers; time per request: the prefill
   worker's ``transfers.busy_s`` (KV ready, the gather out of the paged cache, to landed
   in the decode worker's blocks), the median of the requests' deltas after the warm-up
   (the mean is kept too). Every server binds 127.0.0.1; ``pdserve bench-kv`` runs
   itself inside a private network namespace (``unshare -n``, only ``lo``) where it can
   (:func:`netns_argv`).

Every ratio is against ``auto`` of the same run. Writes ``bench-kv.json``,
``bench-kv.md`` and ``bench-kv.png`` to ``out``.
"""

from __future__ import annotations

import fcntl
import math
import os
import random
import socket
import statistics
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.kv_cache_dtype import KV_CACHE_DTYPES, check_compared_kv_dtypes

if TYPE_CHECKING:
    from router.client import Client
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.sequence import Sequence

PARTS = ("capacity", "decode", "transfer")


@dataclass(frozen=True)
class BenchKVOptions:
    model: str
    kv_dtypes: tuple[str, ...] = KV_CACHE_DTYPES
    dtype: str = "auto"
    kv_cache_gb: float = 0.25
    seq_tokens: int = 512
    output_tokens: int = 64
    block_size: int = 16
    max_num_seqs: int = 1024
    decode_batch: int = 32
    decode_context: int = 1024
    decode_steps: int = 4
    decode_rounds: int = 5
    warmup_steps: int = 4
    requests: int = 8
    request_tokens: int = 512
    request_max_tokens: int = 2
    threads: int = 2
    worker_threads: int = 1
    parts: tuple[str, ...] = PARTS
    full_forward: bool = False
    """Run the model for the capacity run and the decode batch's prefill too (see the
    module doc: the same numbers, much slower with NVFP4's torch encoder)."""
    seed: int = 0

    def __post_init__(self) -> None:
        check_compared_kv_dtypes(self.kv_dtypes)
        if not self.parts or set(self.parts) - set(PARTS):
            raise ValueError(f"parts must be some of {', '.join(PARTS)}, got {self.parts}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if not 1 <= self.output_tokens < self.seq_tokens:
            raise ValueError(f"output_tokens must be in [1, seq_tokens), got "
                             f"{self.output_tokens} of {self.seq_tokens}")
        for name in ("block_size", "max_num_seqs", "decode_batch", "decode_context",
                     "decode_steps", "decode_rounds", "requests", "request_tokens",
                     "request_max_tokens", "threads", "worker_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")

    @property
    def prompt_tokens(self) -> int:
        return self.seq_tokens - self.output_tokens


@dataclass
class KVResult:
    kv_cache_dtype: str
    row_bytes: int = 0
    block_bytes: int = 0
    num_blocks: int = 0
    token_slots: int = 0
    concurrent_expected: int = 0
    concurrent: int = 0
    """Sequences that ran in one step, never preempted, each to its full length."""
    peak_running: int = 0
    """The most sequences running in one step, later-preempted ones included."""
    preemptions: int = 0
    capacity_s: float = 0.0
    decode_ms_per_step: float = 0.0
    decode_tokens_per_s: float = 0.0
    decode_round_ms: list[float] = field(default_factory=list)
    """ms per step of each timing round (``decode_ms_per_step`` is the best one)."""
    decode_ms_median: float = 0.0
    decode_cpu_ms_per_step: float = 0.0
    """The process's CPU time per step (all its threads), best round."""
    decode_kv_mb: float = 0.0
    """The cache bytes the batch's context occupies (what each step's attention reads)."""
    transfer_bytes_per_request: float = 0.0
    transfer_ms_per_request: float = 0.0
    """Median over the requests (each one's busy_s delta); the mean is ``transfer_ms_mean``."""
    transfer_ms_mean: float = 0.0
    transfer_request_ms: list[float] = field(default_factory=list)
    transfers_done: int = 0
    transfers_failed: int = 0
    ratios: dict[str, float | None] = field(default_factory=dict)


@dataclass
class BenchKVReport:
    model: str
    dtype: str
    machine: str
    options: dict
    netns: str
    results: list[KVResult] = field(default_factory=list)
    loadavg: dict[str, list[float]] = field(default_factory=dict)
    """The box's 1/5/15-minute load averages before and after (a shared machine)."""


# -- pure arithmetic and formatting (unit-tested) --------------------------------------------


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, row_bytes: int) -> int:
    """One block: K and V planes of every layer, ``block_size`` rows of every KV head
    (``ModelRunner.block_bytes``)."""
    return num_layers * 2 * block_size * num_kv_heads * row_bytes


def blocks_for_budget(kv_cache_gb: float, bytes_per_block: int) -> int:
    """Blocks a ``kv_cache_gb`` (GiB) cache holds, as the engine sizes it."""
    return int(kv_cache_gb * 2**30) // bytes_per_block


def blocks_per_sequence(seq_tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``seq_tokens`` (prompt + generated) holds at its end: every
    token but the last sampled one has its K/V written."""
    return -(-(seq_tokens - 1) // block_size)


def expected_concurrent(num_blocks: int, block_size: int, seq_tokens: int) -> int:
    """How many ``seq_tokens``-token sequences fit in the pool at once, to their end."""
    return num_blocks // blocks_per_sequence(seq_tokens, block_size)


def concurrent_without_preemption(steps: Iterable[Iterable[str]], preempted: set[str],
                                  finished: set[str]) -> int:
    """The most sequences running in one step among those never preempted that finished
    (``steps``: the running sequence ids of each step)."""
    ok = finished - preempted
    return max((sum(1 for s in running if s in ok) for running in steps), default=0)


def ratio(value: float, reference: float) -> float | None:
    """``value / reference``; None where the reference is zero or missing."""
    return value / reference if reference else None


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def compute_ratios(results: list[KVResult]) -> None:
    """Each result's ratios to the first (``auto``)."""
    ref = results[0]
    for r in results:
        r.ratios = {
            "concurrent": ratio(r.concurrent, ref.concurrent),
            "token_slots": ratio(r.token_slots, ref.token_slots),
            "decode_tokens_per_s": ratio(r.decode_tokens_per_s, ref.decode_tokens_per_s),
            "transfer_bytes": ratio(r.transfer_bytes_per_request, ref.transfer_bytes_per_request),
            "transfer_time": ratio(r.transfer_ms_per_request, ref.transfer_ms_per_request),
        }


def transfer_per_request(prefill_before: tuple[int, float, int],
                         prefill_after: tuple[int, float, int],
                         decode_before: tuple[int, int], decode_after: tuple[int, int]
                         ) -> tuple[float, float, int]:
    """(bytes per request, ms per request, transfers) from counter snapshots: the prefill
    worker's (bytes_moved, busy_s, done) and the decode worker's (bytes_moved, done)."""
    done_p = prefill_after[2] - prefill_before[2]
    done_d = decode_after[1] - decode_before[1]
    per_bytes = (decode_after[0] - decode_before[0]) / done_d if done_d else 0.0
    per_ms = 1e3 * (prefill_after[1] - prefill_before[1]) / done_p if done_p else 0.0
    return per_bytes, per_ms, done_d


def _name(r: KVResult, dtype: str) -> str:
    return f"auto ({dtype})" if r.kv_cache_dtype == "auto" else r.kv_cache_dtype


def markdown(report: BenchKVReport, header: str) -> str:
    o = report.options
    parts = set(o["parts"])
    lines = [f"**{header}**", "", f"Workload: {workload_line(o)}.", "",
             f"Network: {report.netns}." + "".join(
                 f" Load average {k}: {' '.join(f'{x:.2f}' for x in v)}."
                 for k, v in report.loadavg.items()), ""]
    cols = ["KV cache", "bytes/row", "bytes/block"]
    if "capacity" in parts:
        cols += ["blocks", f"concurrent {o['seq_tokens']}-tok seqs (expected)", "vs auto"]
    if "decode" in parts:
        cols += ["decode ms/step", "CPU ms/step", "decode tok/s", "vs auto"]
    if "transfer" in parts:
        cols += ["KV bytes/request", "vs auto", "transfer ms/request (median)", "vs auto"]
    lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in report.results:
        cells = [_name(r, report.dtype), str(r.row_bytes), f"{r.block_bytes:,}"]
        if "capacity" in parts:
            cells += [f"{r.num_blocks:,}", f"{r.concurrent} ({r.concurrent_expected})",
                      fmt_ratio(r.ratios.get("concurrent"))]
        if "decode" in parts:
            cells += [f"{r.decode_ms_per_step:.1f}", f"{r.decode_cpu_ms_per_step:.1f}",
                      f"{r.decode_tokens_per_s:.1f}",
                      fmt_ratio(r.ratios.get("decode_tokens_per_s"))]
        if "transfer" in parts:
            cells += [f"{r.transfer_bytes_per_request / 1e6:.2f} MB",
                      fmt_ratio(r.ratios.get("transfer_bytes")),
                      f"{r.transfer_ms_per_request:.1f}",
                      fmt_ratio(r.ratios.get("transfer_time"))]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if "capacity" in parts:
        notes.append("concurrent: sequences running in one step, never preempted, each "
                     "to its full length; expected: blocks // blocks per full sequence (all "
                     "at full length at once; staggered admission can fit one more); peak "
                     "running incl. later-preempted: "
                     + ", ".join(f"{r.kv_cache_dtype} {r.peak_running}"
                                 for r in report.results))
    if "decode" in parts:
        notes.append("decode: timed steps only, after every sequence has its first token; "
                     "ms/step and CPU ms/step (the process's CPU time, all threads): the "
                     "best round; "
                     "ms/step of each round: " + "; ".join(
                         f"{r.kv_cache_dtype} " + " ".join(f"{x:.0f}" for x in r.decode_round_ms)
                         for r in report.results) + "; context KV per step: " + ", ".join(
                         f"{r.kv_cache_dtype} {r.decode_kv_mb:.0f} MB" for r in report.results))
    if "transfer" in parts:
        notes.append("transfer: bytes from the decode worker's bytes_moved / done "
                     "transfers; time: median per request of the prefill worker's busy_s "
                     "delta (KV ready -> landed; means: " + ", ".join(
                         f"{r.kv_cache_dtype} {r.transfer_ms_mean:.1f}" for r in report.results)
                     + " ms); failed: " + ", ".join(
                         f"{r.kv_cache_dtype} {r.transfers_failed}" for r in report.results))
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def workload_line(o: dict) -> str:
    parts, out = set(o["parts"]), []
    if "capacity" in parts:
        out.append(f"capacity: {o['kv_cache_gb']} GiB KV, distinct random prompts of "
                   f"{o['seq_tokens'] - o['output_tokens']} + {o['output_tokens']} generated "
                   f"= {o['seq_tokens']} tokens, max_num_seqs {o['max_num_seqs']}"
                   + ("" if o.get("full_forward") else " (forward stubbed: scheduler, "
                      "block pool and bookkeeping only)"))
    if "decode" in parts:
        out.append(f"decode: {o['decode_batch']} sequences x {o['decode_context']}-token "
                   f"prompts ({'computed' if o.get('full_forward') else 'prefill stubbed'}), "
                   f"{o['warmup_steps']} warm-up steps, then {o['decode_rounds']} rounds of "
                   f"{o['decode_steps']} timed steps per dtype in turn (best round), "
                   f"{o['threads']} threads")
    if "transfer" in parts:
        out.append(f"transfer: 1 prefill + 1 decode worker ({o['worker_threads']} thread "
                   f"each, local_prefill_threshold 0), 1 warm-up + {o['requests']} distinct "
                   f"{o['request_tokens']}-token prompts one at a time, max_tokens "
                   f"{o['request_max_tokens']}")
    return "; ".join(out) + f"; block size {o['block_size']}, dtype {o['dtype']}"


def plot(report: BenchKVReport, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = set(report.options["parts"])
    panels = [(p, label, key) for p, label, key in (
        ("capacity", f"concurrent {report.options['seq_tokens']}-token sequences\n"
                     f"({report.options['kv_cache_gb']} GiB KV)", "concurrent"),
        ("decode", f"decode tokens/s (batch {report.options['decode_batch']}, "
                   f"ctx {report.options['decode_context']})", "decode_tokens_per_s"),
        ("transfer", "KV MB per request (transfer)", "transfer_bytes_per_request"),
        ("transfer", "transfer ms per request", "transfer_ms_per_request"),
    ) if p in parts]
    names = [r.kv_cache_dtype for r in report.results]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), squeeze=False)
    colors = ["#777777", "#4c72b0", "#55a868", "#dd8452", "#8172b2"]
    for ax, (_, label, key) in zip(axes[0], panels, strict=True):
        scale = 1e-6 if key == "transfer_bytes_per_request" else 1.0
        values = [getattr(r, key) * scale for r in report.results]
        bars = ax.bar(names, values, color=colors[:len(names)])
        ref = values[0]
        for b, v in zip(bars, values, strict=True):
            ax.annotate(fmt_ratio(ratio(v, ref)), (b.get_x() + b.get_width() / 2, v),
                        ha="center", va="bottom", fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.margins(y=0.15)
    fig.suptitle(f"{Path(report.model).name} ({report.dtype}): quantized KV cache, "
                 f"capacity / speed / transfer (ratio to auto)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- network namespace ------------------------------------------------------------------------


NETNS_ENV = "PDSERVE_BENCH_KV_NETNS"


def interfaces() -> list[str]:
    """Network interfaces of this process's namespace (``/proc/net/dev``; ``/sys/class/net``
    may show the host's)."""
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines)


def isolated(names: list[str]) -> bool:
    return names == ["lo"]


def netns_argv(python: str, argv: list[str]) -> list[str]:
    """The command that runs ``python -m cluster.cli *argv`` in a fresh network
    namespace (``lo`` is brought up by the child itself: :func:`lo_up`)."""
    return ["unshare", "-n", python, "-m", "cluster.cli", *argv]


def lo_up() -> None:
    """Bring ``lo`` up (a fresh namespace starts with it down); what ``ip link set lo up``
    does, without iproute2."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, siocgifflags, req))[1]
        if not flags & iff_up:
            fcntl.ioctl(s, siocsifflags, struct.pack("16sH", b"lo", flags | iff_up))


# -- measurement --------------------------------------------------------------------------------


def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct random prompts; each starts with its own token, so no two share a block
    (ids past the special tokens at the vocabulary's start, all inside a small one)."""
    low = min(1000, vocab // 8)
    high = max(low + 1, min(vocab, 40000))
    firsts = rng.sample(range(low, high), n) if n <= high - low else [
        low + i % (high - low) for i in range(n)]
    return [[f] + [rng.randrange(low, high) for _ in range(length - 1)] for f in firsts]


@contextmanager
def _without_forward(engine: LLMEngine) -> Iterator[None]:
    """While inside, ``engine.step`` samples one fixed token (1000, or the vocabulary's
    last id when it is smaller) for every sampling chunk instead of running the model
    (nothing is written to the cache); everything else is the engine's."""
    from workers.engine.model_runner import StepResult
    from workers.engine.sampler import SampleResult

    token = min(1000, engine.runner.vocab_size - 1)

    def execute(chunks: list, masks: object = None, forks: object = None,
                prompt_logprobs: object = None, after_layer: object = None) -> StepResult:
        # the benchmark's requests are n=1, no prompt logprobs: nothing to fork or score
        ids = [c.seq.seq_id for c in chunks if c.samples]
        return StepResult(ids, SampleResult([token] * len(ids), [None] * len(ids)))

    engine.runner.execute = execute  # type: ignore[method-assign]
    try:
        yield
    finally:
        del engine.runner.execute


def _engine(o: BenchKVOptions, kv: str, **kw: object) -> LLMEngine:
    from workers.engine.llm_engine import LLMEngine
    from workers.engine.params import EngineConfig

    config = EngineConfig(model=o.model, dtype=o.dtype, kv_cache_dtype=kv,
                          block_size=o.block_size, num_threads=o.threads,
                          **kw)  # type: ignore[arg-type]
    return LLMEngine(config)


def _capacity_steps(engine: LLMEngine, steps: list[list[str]], seqs: dict[str, Sequence],
                    finished: set[str], kv: str, log: Callable[[str], None]) -> None:
    """Step until the sequences that ran, never preempted, when the first one finished
    have all finished; ``steps`` gets each step's running ids (those finishing in it
    included), ``seqs`` every sequence seen running."""
    watch: set[str] | None = None
    last = time.monotonic()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        running = list(engine.scheduler.running)
        for seq in running:
            seqs[seq.seq_id] = seq
        done = [out.request_id for out in outputs if out.finished]
        finished.update(done)
        steps.append([seq.seq_id for seq in running] + done)
        if finished and watch is None:
            watch = {seq.seq_id for seq in running if not seq.num_preemptions}
        if watch is not None and watch <= finished:
            return
        if time.monotonic() - last > 5:
            last = time.monotonic()
            log(f"  capacity {kv}: step {len(steps)}, {len(running)} running, "
                f"{len(finished)} finished")


def measure_capacity(o: BenchKVOptions, kv: str, r: KVResult,
                     log: Callable[[str], None]) -> None:
    from workers.engine.params import SamplingParams

    t0 = time.perf_counter()
    engine = _engine(o, kv, kv_cache_memory_gb=o.kv_cache_gb, max_num_seqs=o.max_num_seqs,
                     enable_prefix_caching=False)
    runner = engine.runner
    r.row_bytes = runner.kv_format.row_bytes
    r.block_bytes = runner.block_bytes
    r.num_blocks = runner.num_blocks
    r.token_slots = r.num_blocks * o.block_size
    r.concurrent_expected = expected_concurrent(r.num_blocks, o.block_size, o.seq_tokens)
    n = min(o.max_num_seqs, math.ceil(r.concurrent_expected * 1.25) + 4)
    rng = random.Random(o.seed)
    params = SamplingParams(max_tokens=o.output_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(_prompts(rng, n, o.prompt_tokens, runner.vocab_size)):
        engine.add_request(f"cap-{i}", p, params)
    steps: list[list[str]] = []
    seqs: dict[str, Sequence] = {}
    finished: set[str] = set()
    stub = nullcontext() if o.full_forward else _without_forward(engine)
    with stub:
        _capacity_steps(engine, steps, seqs, finished, kv, log)
    for rid in [f"cap-{i}" for i in range(n)]:
        engine.abort_request(rid)
    preempted = {sid for sid, s in seqs.items() if s.num_preemptions}
    r.preemptions = sum(s.num_preemptions for s in seqs.values())
    r.peak_running = max((len(s) for s in steps), default=0)
    r.concurrent = concurrent_without_preemption(steps, preempted, finished)
    r.capacity_s = time.perf_counter() - t0
    log(f"  capacity {kv}: {r.num_blocks} blocks of {r.block_bytes:,} B; {r.concurrent} "
        f"concurrent (expected {r.concurrent_expected}, peak running {r.peak_running}, "
        f"{r.preemptions} preemptions) in {r.capacity_s:.0f} s")


def _decode_engine(o: BenchKVOptions, kv: str, r: KVResult,
                   log: Callable[[str], None]) -> tuple[LLMEngine, list[str]]:
    """An engine with ``decode_batch`` sequences of ``decode_context`` prompt tokens, each
    past its first token (every later step is a pure decode step)."""
    from workers.engine.params import SamplingParams

    # Early sequences decode while later prompts prefill (2048 tokens a step): room for it.
    prefill_steps = -(-o.decode_batch * o.decode_context // 2048)
    steps = prefill_steps + o.warmup_steps + o.decode_rounds * o.decode_steps + 2
    per_seq = blocks_per_sequence(o.decode_context + steps + 1, o.block_size)
    engine = _engine(o, kv, num_blocks=o.decode_batch * per_seq + 2,
                     max_num_seqs=o.decode_batch, enable_prefix_caching=False,
                     max_num_batched_tokens=2048, max_model_len=o.decode_context + steps + 1)
    runner = engine.runner
    r.row_bytes, r.block_bytes = runner.kv_format.row_bytes, runner.block_bytes
    r.decode_kv_mb = (o.decode_batch * o.decode_context * r.block_bytes / o.block_size) / 1e6
    rng = random.Random(o.seed + 1)
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    ids = [f"dec-{i}" for i in range(o.decode_batch)]
    for rid, p in zip(ids, _prompts(rng, o.decode_batch, o.decode_context,
                                    runner.vocab_size), strict=True):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    t0, last = time.perf_counter(), time.monotonic()
    with nullcontext() if o.full_forward else _without_forward(engine):
        while len(started) < len(ids):
            for out in engine.step():
                if out.token_ids:
                    started.add(out.request_id)
            if time.monotonic() - last > 5:
                last = time.monotonic()
                log(f"  decode {kv}: prefill, {len(started)}/{len(ids)} sequences started")
    log(f"  decode {kv}: {o.decode_batch} sequences running after "
        f"{time.perf_counter() - t0:.0f} s (prefill "
        f"{'computed' if o.full_forward else 'stubbed'})")
    return engine, ids


def measure_decode(o: BenchKVOptions, results: dict[str, KVResult],
                   log: Callable[[str], None]) -> None:
    """Every dtype's batch in its own engine, then ``decode_rounds`` rounds that time
    ``decode_steps`` steps of each engine in turn: the dtypes share the machine's
    conditions (a shared box's load drifts); each one's ms/step is its best round."""
    engines = {kv: _decode_engine(o, kv, results[kv], log) for kv in o.kv_dtypes}
    for engine, _ in engines.values():  # untimed, every engine just before the rounds:
        for _ in range(o.warmup_steps):  # first touches of a cache's pages are slow
            engine.step()
    rounds: dict[str, list[float]] = {kv: [] for kv in o.kv_dtypes}
    cpu: dict[str, list[float]] = {kv: [] for kv in o.kv_dtypes}
    for i in range(o.decode_rounds):
        for kv, (engine, _) in engines.items():
            tokens = 0
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(o.decode_steps):
                tokens += sum(len(out.new_token_ids) for out in engine.step())
            elapsed = time.perf_counter() - t0
            cpu[kv].append(1e3 * (time.process_time() - c0) / o.decode_steps)
            assert tokens == o.decode_batch * o.decode_steps, (
                f"{tokens} tokens in {o.decode_steps} steps of {o.decode_batch} sequences: "
                "one was preempted or finished early")
            rounds[kv].append(1e3 * elapsed / o.decode_steps)
        log(f"  decode round {i + 1}/{o.decode_rounds}: " + ", ".join(
            f"{kv} {ms[-1]:.0f} ms/step ({cpu[kv][-1]:.0f} CPU)" for kv, ms in rounds.items()))
    for kv, (engine, ids) in engines.items():
        for rid in ids:
            engine.abort_request(rid)
        r = results[kv]
        r.decode_round_ms = rounds[kv]
        r.decode_ms_per_step = min(rounds[kv])
        r.decode_ms_median = statistics.median(rounds[kv])
        r.decode_cpu_ms_per_step = min(cpu[kv])
        r.decode_tokens_per_s = 1e3 * o.decode_batch / r.decode_ms_per_step
    engines.clear()


def _counters(client: Client) -> tuple[tuple[int, float, int], tuple[int, int], int]:
    status = client.status()
    [p] = [w for w in status.workers if w.role == "prefill"]
    [d] = [w for w in status.workers if w.role == "decode"]
    failed = sum(d.transfers.entered.get(k, 0) for k in ("failed", "timed_out", "cancelled"))
    return ((p.transfers.bytes_moved, p.transfers.busy_s, p.transfers.entered.get("done", 0)),
            (d.transfers.bytes_moved, d.transfers.entered.get("done", 0)), failed)


def measure_transfer(o: BenchKVOptions, kv: str, r: KVResult, log_dir: Path,
                     log: Callable[[str], None]) -> None:
    from cluster.local import LocalCluster, LocalClusterConfig, free_port
    from router.client import Client

    t0 = time.perf_counter()
    cfg = LocalClusterConfig(model=o.model, port=free_port(), http_port=0, metrics_port=None,
                             prefill=1, decode=1, local_prefill_threshold=0, dtype=o.dtype,
                             kv_cache_dtype=kv, kv_cache_gb=o.kv_cache_gb,
                             block_size=o.block_size, threads_per_worker=o.worker_threads,
                             log_dir=str(log_dir / kv))
    rng = random.Random(o.seed + 2)
    prompts = _prompts(rng, o.requests + 1, o.request_tokens, 40001)
    with LocalCluster(cfg) as cluster:
        cluster.wait_ready()
        log(f"  transfer {kv}: cluster ready in {time.perf_counter() - t0:.0f} s")
        with Client(cluster.target) as client:
            snaps = [_counters(client)]
            for p in prompts:
                expect = snaps[-1][1][1] + 1
                client.generate(p, max_tokens=o.request_max_tokens, temperature=0.0,
                                ignore_eos=True)
                deadline = time.monotonic() + 10
                while True:  # the counters are final once the transfer is done
                    now = _counters(client)
                    if (now[1][1] >= expect and now[0][2] >= expect) or now[2] \
                            or time.monotonic() > deadline:
                        break
                    time.sleep(0.02)
                snaps.append(now)
    measured = snaps[1:]  # after the warm-up
    per_bytes, mean_ms, done = transfer_per_request(measured[0][0], measured[-1][0],
                                                    measured[0][1], measured[-1][1])
    each = [transfer_per_request(a[0], b[0], a[1], b[1]) for a, b in zip(
        measured, measured[1:], strict=False)]
    r.transfer_request_ms = [ms for _, ms, n in each if n]
    r.transfer_bytes_per_request = per_bytes
    r.transfer_ms_mean = mean_ms
    r.transfer_ms_per_request = statistics.median(r.transfer_request_ms or [0.0])
    r.transfers_done, r.transfers_failed = done, measured[-1][2]
    log(f"  transfer {kv}: {per_bytes / 1e6:.2f} MB, {r.transfer_ms_per_request:.1f} ms "
        f"per request (median; mean {mean_ms:.1f}; {done} done, {measured[-1][2]} failed) "
        f"in {time.perf_counter() - t0:.0f} s")


def run_bench(o: BenchKVOptions, out: Path, machine: str, netns: str,
              log: Callable[[str], None] = print) -> BenchKVReport:
    from workers.engine.params import EngineConfig

    dtype = EngineConfig(model=o.model, dtype=o.dtype).resolved()[0].dtype
    report = BenchKVReport(o.model, dtype, machine, asdict(o), netns,
                           loadavg={"before": list(os.getloadavg())})
    results = {kv: KVResult(kv) for kv in o.kv_dtypes}
    report.results = list(results.values())
    if "capacity" in o.parts:
        for kv in o.kv_dtypes:
            log(f"[capacity] {kv}")
            measure_capacity(o, kv, results[kv], log)
    if "decode" in o.parts:
        log(f"[decode] {', '.join(o.kv_dtypes)}")
        measure_decode(o, results, log)
    if "transfer" in o.parts:
        for kv in o.kv_dtypes:
            log(f"[transfer] {kv}")
            measure_transfer(o, kv, results[kv], out / "logs", log)
    compute_ratios(report.results)
    report.loadavg["after"] = list(os.getloadavg())
    return report


__all__ = ["PARTS", "BenchKVOptions", "BenchKVReport", "KVResult", "block_bytes",
           "blocks_for_budget", "blocks_per_sequence", "compute_ratios",
           "concurrent_without_preemption", "expected_concurrent", "fmt_ratio", "interfaces",
           "isolated", "lo_up", "markdown", "netns_argv", "plot", "ratio", "run_bench",
           "transfer_per_request", "workload_line"]
