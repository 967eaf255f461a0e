"""Transfer benchmark: KV bytes/s prefill -> decode over the channel vs a raw TCP copy.

    python -m benchmarks.transfer [--tokens 2048] [--iters 10] [--dtypes float32,bfloat16]
        [--modes raw,direct,staged,gather] [--bind ADDR] [--child-bind ADDR]
        [--child-netns /proc/PID/ns/net] [--json FILE]

Workload: one request's KV shaped like SmolLM2-135M (30 layers, 3 KV heads, head_dim 64,
block 16). This process plays the prefill worker; a child process (this module with
``--child``) plays the decode worker. Per iteration and dtype the same bytes go:

- raw:     ``socket.sendall`` of the payload into ``recv_into`` a preallocated buffer
           (the loopback link's practical limit, no framing, no copies after receipt);
- direct:  ``KVSender.send`` of the payload into ``KVReceiver`` reserved blocks of a
           paged cache that form one run of consecutive ids (offer, checks, accept,
           payload received in place: the direct framing);
- staged:  the same into scattered (reversed) block ids (payload lands in channel
           buffers and is scattered into the cache: one more copy on the decode side);
- gather:  as direct, but starting from the prefill's own paged cache
           (``send_blocks``: a gather copy on the prefill side first).

Each timing runs from the send call to the child's "done" line, so both paths pay the
same notification. The modes alternate per iteration so load drift hits both alike.
Parent and child talk in text lines over the child's stdin/stdout (no pickle).

By default both ends are on loopback (127.0.0.1). Across a link (``pdserve
bench-multinode``): ``--bind`` is the address this process's sender and raw socket use,
``--child-bind`` the one the child's receiver and raw listener bind, and
``--child-netns`` a network namespace the child runs in (``nsenter --net``), such as
another test host's (:mod:`cluster.testhosts`). ``--modes`` picks the modes timed (raw
always among them); ``--json`` writes every timing.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.process_exit import exit_after_shutdown
from workers.transfer.blocks import KVDestination, PagedCacheDestination, gather_blocks
from workers.transfer.channel import TransferConfig
from workers.transfer.header import KVLayout
from workers.transfer.receiver import KVReceiver
from workers.transfer.sender import KVSender
from workers.transfer.state import TransferState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ("raw", "direct", "staged", "gather")
LOOPBACK = "127.0.0.1"
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16


def target_ids(n: int, pattern: str) -> list[int]:
    """One run of consecutive ids, or the same ids reversed (no two adjacent)."""
    ids = list(range(n, 2 * n))
    return ids[::-1] if pattern == "staged" else ids


def layout(dtype: str) -> KVLayout:
    return KVLayout(LAYERS, BLOCK, KV_HEADS, HEAD_DIM, DTYPES[dtype])


def cache_for(lay: KVLayout, num_blocks: int) -> torch.Tensor:
    return torch.zeros(lay.num_layers, 2, num_blocks * BLOCK, KV_HEADS, HEAD_DIM,
                       dtype=lay.dtype)


# --- the child: decode worker stand-in -------------------------------------------------

class _Discard:
    """Diagnostic destination: drops the payload (isolates wire + protocol cost)."""

    direct = False

    def write(self, plane_start: int, kv: torch.Tensor) -> None:
        pass

    def region(self, plane: int, i0: int, i1: int) -> torch.Tensor:
        raise NotImplementedError


def child(args: argparse.Namespace) -> None:
    cfg = TransferConfig(host=args.bind, chunk_bytes=args.chunk_bytes, recv_window=args.window)
    rx = KVReceiver("bench-decode", cfg)
    raw = socket.socket()
    raw.bind((args.bind, 0))
    raw.listen(1)
    print(f"ready {rx.address} {raw.getsockname()[1]} {args.bind}", flush=True)
    conn, _ = raw.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    caches: dict[str, torch.Tensor] = {}
    buf = bytearray()
    for line in sys.stdin:
        op, *rest = line.split()
        if op == "raw":
            nbytes = int(rest[0])
            if len(buf) < nbytes:
                buf = bytearray(nbytes)
            view, got = memoryview(buf), 0
            while got < nbytes:
                got += conn.recv_into(view[got:nbytes])
            print("done", flush=True)
        elif op == "expect":
            request_id, dtype, n, pattern = rest[0], rest[1], int(rest[2]), rest[3]
            lay = layout(dtype)
            cache = caches.setdefault(dtype, cache_for(lay, 2 * n))
            ids = target_ids(n, pattern)
            dest: KVDestination = PagedCacheDestination(cache, ids, BLOCK)
            if args.dest == "discard":
                dest = _Discard()
            h = rx.expect(request_id, lay, ids, dest)
            print("ready", flush=True)
            r = h.wait(120)
            print(f"done {r.state.value}", flush=True)
        elif op == "exit":
            break
    conn.close()
    raw.close()
    rx.close()


# --- the parent: prefill worker stand-in -------------------------------------------------

def in_netns(netns: str) -> Callable[[list[str]], list[str]]:
    """A command wrapper that runs it in the network namespace ``netns`` (a
    ``/proc/PID/ns/net`` path)."""
    return lambda argv: ["nsenter", f"--net={netns}", "--", *argv]


class Child:
    """The decode stand-in, a child process: ``bind`` is the address it serves on,
    ``wrap`` turns its command line into one that runs elsewhere (another host)."""

    def __init__(self, args: argparse.Namespace, bind: str = LOOPBACK,
                 wrap: Callable[[list[str]], list[str]] | None = None):
        cmd = [sys.executable, "-m", "benchmarks.transfer", "--child",
               "--chunk-bytes", str(args.chunk_bytes), "--window", str(args.window),
               "--dest", args.dest, "--bind", bind]
        self.proc = subprocess.Popen(wrap(cmd) if wrap else cmd, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        words = self.read().split()
        self.address, self.raw_port, self.raw_host = words[1], int(words[2]), words[3]

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("bench child exited")
        return line.strip()


def parse_modes(text: str) -> tuple[str, ...]:
    """``--modes``: known modes, raw among them (every ratio is against it), in the
    canonical order."""
    asked = {m.strip() for m in text.split(",") if m.strip()}
    unknown = asked - set(MODES)
    if unknown:
        raise ValueError(f"unknown mode(s) {', '.join(sorted(unknown))}: "
                         f"choose from {', '.join(MODES)}")
    if "raw" not in asked:
        raise ValueError("--modes must include raw (the baseline every ratio is against)")
    return tuple(m for m in MODES if m in asked)


def run(args: argparse.Namespace) -> dict:
    """Time every mode per dtype; print the table and return the timings (what
    ``--json`` writes)."""
    torch.manual_seed(0)
    modes = parse_modes(args.modes)
    child_bind = args.child_bind or args.bind
    child_proc = Child(args, bind=child_bind,
                       wrap=in_netns(args.child_netns) if args.child_netns else None)
    raw = socket.create_connection((child_proc.raw_host, child_proc.raw_port),
                                   source_address=(args.bind, 0))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sender = KVSender("bench-prefill", TransferConfig(host=args.bind,
                                                       chunk_bytes=args.chunk_bytes,
                                                       recv_window=args.window))
    n = args.tokens // BLOCK
    load_before = os.getloadavg()
    print(f"workload: {args.tokens}-token KV, SmolLM2-135M shape ({LAYERS} layers, "
          f"{KV_HEADS} kv heads, head_dim {HEAD_DIM}, block {BLOCK}), {n} blocks; "
          f"{args.iters} timed iterations after {args.warmup} warm-up, modes interleaved; "
          f"chunk_bytes={args.chunk_bytes} window={args.window} dest={args.dest}")
    if (args.bind, child_bind, args.child_netns) != (LOOPBACK, LOOPBACK, None):
        print(f"link: {args.bind} -> {child_bind}"
              + (f" (child in {args.child_netns})" if args.child_netns else ""))
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), python {platform.python_version()}, "
          f"loadavg {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    print(f"{'dtype':<9} {'mode':<8} {'bytes':>11} {'median s':>9} {'best s':>8} "
          f"{'GB/s med':>9} {'GB/s best':>9} {'vs raw':>7}")
    counter = 0
    result: dict = {"tokens": args.tokens, "blocks": n, "iters": args.iters,
                    "warmup": args.warmup, "bind": args.bind, "child_bind": child_bind,
                    "modes": list(modes), "dtypes": {}}
    for dtype in args.dtypes.split(","):
        lay = layout(dtype)
        src_cache = cache_for(lay, n)
        src_cache.normal_()
        src_ids = list(range(n))
        kv = gather_blocks(src_cache, src_ids, BLOCK)
        nbytes = kv.numel() * kv.element_size()
        payload = memoryview(kv.view(torch.uint8).numpy()).cast("B")
        times: dict[str, list[float]] = {m: [] for m in modes}
        for it in range(args.warmup + args.iters):
            for mode in times:
                counter += 1
                if mode == "raw":
                    t0 = time.perf_counter()
                    child_proc.say(f"raw {nbytes}")
                    raw.sendall(payload)
                    reply = child_proc.read()
                else:
                    rid = f"bench-{counter}"
                    pattern = "staged" if mode == "staged" else "direct"
                    dst_ids = target_ids(n, pattern)
                    child_proc.say(f"expect {rid} {dtype} {n} {pattern}")
                    assert child_proc.read() == "ready"
                    t0 = time.perf_counter()
                    if mode != "gather":
                        h = sender.send(child_proc.address, rid, dst_ids, kv, timeout_s=60)
                    else:
                        h = sender.send_blocks(child_proc.address, rid, src_cache, src_ids,
                                               dst_ids, BLOCK, timeout_s=60)
                    reply = child_proc.read()
                    if h.wait(60).state is not TransferState.DONE or reply != "done done":
                        raise RuntimeError(f"{mode} transfer failed: {h.result()} / {reply}")
                elapsed = time.perf_counter() - t0
                if it >= args.warmup:
                    times[mode].append(elapsed)
        raw_med = statistics.median(times["raw"])
        for mode, ts in times.items():
            med, best = statistics.median(ts), min(ts)
            print(f"{dtype:<9} {mode:<8} {nbytes:>11} {med:>9.4f} {best:>8.4f} "
                  f"{nbytes / med / 1e9:>9.2f} {nbytes / best / 1e9:>9.2f} "
                  f"{raw_med / med:>6.0%}")
        result["dtypes"][dtype] = {"bytes": nbytes, "times_s": times}
    load_after = os.getloadavg()
    print(f"loadavg after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; "
          "'vs raw' = raw median time / mode median time (target >= 80%)")
    sender.close()  # while the child's store is up, so the pairs end cleanly
    child_proc.say("exit")
    child_proc.proc.wait(30)
    raw.close()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--chunk-bytes", type=int, default=TransferConfig.chunk_bytes)
    p.add_argument("--window", type=int, default=TransferConfig.recv_window)
    p.add_argument("--dest", choices=("paged", "discard"), default="paged",
                   help="decode-side destination; 'discard' skips the scatter (diagnostic)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated modes to time, raw among them (default: all)")
    p.add_argument("--bind", default=LOOPBACK,
                   help="address this process sends from (the child: the one it serves on)")
    p.add_argument("--child-bind", default=None,
                   help="address the child serves on (default: --bind)")
    p.add_argument("--child-netns", default=None, metavar="/proc/PID/ns/net",
                   help="run the child in this network namespace (nsenter --net)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every timing here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
    else:
        try:
            parse_modes(args.modes)
        except ValueError as e:
            p.error(str(e))
        run(args)
    exit_after_shutdown(0)  # both ends closed: no finalization (common.process_exit)


if __name__ == "__main__":
    main()
