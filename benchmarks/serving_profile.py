"""Where a served token's CPU time goes: snapshots of processes and their /metrics, and
the arithmetic that turns two snapshots into CPU milliseconds per generated token.

Inputs, taken before and after a measured run (``benchmarks.serving``):

- ``/proc/PID/stat`` (the whole process, exited threads included) and
  ``/proc/PID/task/TID/stat`` + ``comm`` (each live thread and its kernel name): user +
  system ticks / ``SC_CLK_TCK``. Kernel names are the profile's contract
  (:mod:`common.threads`): a worker's engine thread and the intra-op helpers it starts
  are ``pds-engine``; the router's tokenizer thread is ``pds-tokenize``;
- each process's Prometheus text: the worker's forward wall / forward CPU / engine-thread
  CPU counters and the router's stream messages and bytes per hop.

A worker's CPU splits three ways (the counters give the engine thread's own forward CPU;
its helpers run only inside the forward):

- forward = forward CPU of the engine thread + (all ``pds-engine`` threads - the engine
  thread's whole CPU);
- engine thread outside the forward = the engine thread's whole CPU - its forward CPU
  (scheduling, sampling, bookkeeping, hand-offs);
- I/O and the rest = the process - all ``pds-engine`` threads (gRPC, asyncio, KV
  channel, publishers, metrics).

Pure apart from :func:`snapshot` and :func:`descendants`, which read ``/proc``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.threads import ENGINE, TOKENIZER

PROC = Path("/proc")
HOPS = ("worker", "grpc", "http")
"""The router's stream hops: messages from workers, to gRPC clients, SSE events."""


def clock_ticks() -> int:
    """Ticks per second of the times in ``/proc/*/stat``."""
    try:
        return os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError, AttributeError):
        return 100


@dataclass(frozen=True)
class Stat:
    """What the profile reads from one ``/proc/.../stat`` line."""

    comm: str
    ppid: int
    cpu_ticks: int
    """utime + stime."""


def parse_stat(line: str) -> Stat:
    """Parse a ``/proc/PID/stat`` (or ``task/TID/stat``) line. The name sits in
    parentheses and may itself hold spaces and parentheses, so the fields are counted
    from the last ``)``. Raises ValueError on anything else."""
    open_, close = line.find("("), line.rfind(")")
    if open_ < 0 or close < open_:
        raise ValueError(f"not a /proc stat line: {line[:80]!r}")
    rest = line[close + 1:].split()
    if len(rest) < 13:
        raise ValueError(f"/proc stat line too short ({len(rest)} fields after the "
                         f"name): {line[:80]!r}")
    # rest[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    return Stat(comm=line[open_ + 1:close], ppid=int(rest[1]),
                cpu_ticks=int(rest[11]) + int(rest[12]))


@dataclass(frozen=True)
class ProcSnapshot:
    """One process's CPU seconds at one moment: all of it, and each live thread's."""

    pid: int
    cpu_s: float
    threads: Mapping[int, tuple[str, float]] = field(default_factory=dict)
    """tid -> (kernel name, CPU seconds)."""


def named_cpu_delta(before: ProcSnapshot, after: ProcSnapshot, name: str) -> float:
    """CPU seconds the threads named ``name`` (in ``after``) spent between the two
    snapshots; a thread born in between counts from zero. A thread that exited in
    between is lost (the process total keeps it)."""
    total = 0.0
    for tid, (comm, cpu) in after.threads.items():
        if comm == name:
            prev = before.threads.get(tid)
            total += cpu - (prev[1] if prev is not None else 0.0)
    return total


def cpu_by_name(before: ProcSnapshot, after: ProcSnapshot) -> dict[str, float]:
    """CPU seconds between the two snapshots per thread name (live threads only), most
    first: what :func:`named_cpu_delta` gives for every name."""
    names = {comm for comm, _ in after.threads.values()}
    spent = {n: named_cpu_delta(before, after, n) for n in names}
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


def snapshot(pid: int, proc: Path = PROC, ticks: int | None = None) -> ProcSnapshot:
    """Read process ``pid``'s and its threads' CPU times. Raises OSError when the
    process is gone; a thread that ends while being read is skipped."""
    hz = ticks or clock_ticks()
    whole = parse_stat((proc / str(pid) / "stat").read_text())
    threads: dict[int, tuple[str, float]] = {}
    for task in (proc / str(pid) / "task").iterdir():
        try:
            st = parse_stat((task / "stat").read_text())
            comm = (task / "comm").read_text().rstrip("\n")
        except (OSError, ValueError):
            continue
        threads[int(task.name)] = (comm, st.cpu_ticks / hz)
    return ProcSnapshot(pid, whole.cpu_ticks / hz, threads)


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), by scanning
    ``/proc`` for parent ids."""
    parent_of: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent_of[int(entry.name)] = parse_stat((entry / "stat").read_text()).ppid
        except (OSError, ValueError):
            continue
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = sorted(c for c, pp in parent_of.items() if pp == p)
        found += kids
        frontier += kids
    return found


# -- Prometheus text ----------------------------------------------------------------------

_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _unescape(v: str) -> str:
    return v.replace(r"\"", '"').replace(r"\n", "\n").replace("\\\\", "\\")


@dataclass(frozen=True)
class Scrape:
    """One ``/metrics`` text: (metric name, labels, value) per sample."""

    samples: tuple[tuple[str, Mapping[str, str], float], ...]

    def total(self, name: str, **match: str) -> float:
        """The sum of ``name`` over the series whose labels include ``match`` (0 when
        none: a counter not yet incremented is not exported)."""
        return sum(v for n, labels, v in self.samples
                   if n == name and all(labels.get(k) == want for k, want in match.items()))


def parse_prometheus(text: str) -> Scrape:
    """Parse the Prometheus text exposition format (comments skipped; a trailing
    timestamp ignored). Raises ValueError on a malformed sample line."""
    samples = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        labels: dict[str, str] = {}
        brace = line.find("{")
        if brace >= 0:
            end = line.rfind("}")
            if end < brace:
                raise ValueError(f"unclosed labels: {line[:120]!r}")
            name, body, rest = line[:brace], line[brace + 1:end], line[end + 1:]
            pos = 0
            while pos < len(body):
                m = _LABEL.match(body, pos)
                if m is None:
                    if body[pos:].strip():
                        raise ValueError(f"bad labels: {line[:120]!r}")
                    break
                labels[m.group(1)] = _unescape(m.group(2))
                pos = m.end()
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not parts:
            raise ValueError(f"sample without a value: {line[:120]!r}")
        samples.append((name.strip(), labels, float(parts[0])))
    return Scrape(tuple(samples))


# -- the arithmetic -----------------------------------------------------------------------

PREFIX = "pdserve:"


def _grew(m0: Scrape, m1: Scrape, name: str, **match: str) -> float:
    return m1.total(PREFIX + name, **match) - m0.total(PREFIX + name, **match)


@dataclass(frozen=True)
class WorkerProfile:
    """One worker's CPU seconds over the run, split (see the module docstring)."""

    process_s: float
    forward_s: float
    engine_outside_forward_s: float
    io_rest_s: float
    forward_wall_s: float
    generated_tokens: float
    kv_bytes: float


def worker_profile(before: ProcSnapshot, after: ProcSnapshot, m0: Scrape,
                   m1: Scrape, engine: str = ENGINE) -> WorkerProfile:
    process = after.cpu_s - before.cpu_s
    engine_threads = named_cpu_delta(before, after, engine)
    fwd_cpu = _grew(m0, m1, "engine_forward_cpu_seconds_total")
    thread_cpu = _grew(m0, m1, "engine_thread_cpu_seconds_total")
    return WorkerProfile(
        process_s=process,
        forward_s=fwd_cpu + (engine_threads - thread_cpu),
        engine_outside_forward_s=thread_cpu - fwd_cpu,
        io_rest_s=process - engine_threads,
        forward_wall_s=_grew(m0, m1, "engine_forward_seconds_total"),
        generated_tokens=_grew(m0, m1, "engine_generation_tokens_total"),
        kv_bytes=_grew(m0, m1, "kv_transfer_bytes_total"))


@dataclass(frozen=True)
class RouterProfile:
    process_s: float
    tokenizer_s: float
    rest_s: float
    messages: Mapping[str, float]
    """Stream messages per hop over the run (:data:`HOPS`)."""
    bytes: Mapping[str, float]


def router_profile(before: ProcSnapshot, after: ProcSnapshot, m0: Scrape, m1: Scrape,
                   tokenizer: str = TOKENIZER) -> RouterProfile:
    process = after.cpu_s - before.cpu_s
    tok = named_cpu_delta(before, after, tokenizer)
    return RouterProfile(
        process_s=process, tokenizer_s=tok, rest_s=process - tok,
        messages={h: _grew(m0, m1, "stream_messages_total", hop=h) for h in HOPS},
        bytes={h: _grew(m0, m1, "stream_bytes_total", hop=h) for h in HOPS})


def tree_cpu(before: Iterable[ProcSnapshot], after: Iterable[ProcSnapshot]) -> float:
    """CPU seconds a set of processes spent between two snapshots of each (a process
    born in between counts from zero; one that ended in between is lost)."""
    start = {s.pid: s.cpu_s for s in before}
    return sum(s.cpu_s - start.get(s.pid, 0.0) for s in after)


def per_token_ms(seconds: float, tokens: float) -> float:
    """CPU milliseconds per generated token (NaN when nothing was generated)."""
    return seconds * 1e3 / tokens if tokens else float("nan")
