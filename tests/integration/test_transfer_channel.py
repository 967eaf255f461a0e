"""The KV transfer channel across real processes: real TCPStore on a loopback port, real
gloo, real kills.

The decode end of most tests is this pytest process (a KVReceiver); the prefill ends
are agent subprocesses driven over stdin/stdout with JSON lines (no pickle, not even in
the harness). An agent regenerates a payload from a seed, so this process can check
every received byte without the payload crossing any other channel. Every test ends
with the leak check: no live reservation or parked offer, nothing in flight, and after
close no channel thread and a free store port.
"""

from __future__ import annotations

import json
import logging
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from common.process_exit import exit_after_shutdown
from workers.transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    PagedCacheDestination,
    TransferConfig,
    TransferHeader,
    TransferState,
    gather_blocks,
    request_id64,
    scatter_blocks,
)
from workers.transfer.channel import fault_hooks_from_env
from workers.transfer.header import (
    HeaderError,
    check_offer,
    decode_offer,
    encode_offer,
    message_plan,
    tag_for,
)
from workers.transfer.rendezvous import connect_store, listen_store
from workers.transfer.state import StateCounters, TransferHandle

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Small timeouts: a dead or hung peer must surface within seconds. connect_timeout_s
# stays at 10 s: in some sandboxes (gVisor) 1 in ~10 TCPStore connects stalls 5 s.
TEST_CFG: dict[str, Any] = dict(connect_timeout_s=10.0, offer_timeout_s=2.0,
                                data_timeout_s=3.0, expect_timeout_s=15.0,
                                chunk_bytes=48 << 10, direct_min_bytes=16 << 10,
                                recv_window=3)
SENTINEL = -7.0


def make_kv(seed: int, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.payload_shape(num_blocks), generator=g).to(layout.dtype)


def layout_of(item: dict[str, Any]) -> KVLayout:
    return KVLayout(item["layers"], item["block_size"], item["kv_heads"], item["head_dim"],
                    DTYPES[item["dtype"]])


def item(request_id: str, block_ids: list[int], seed: int, dtype: str = "float32",
         layers: int = 6, **kw: Any) -> dict[str, Any]:
    return dict(request_id=request_id, block_ids=block_ids, seed=seed, dtype=dtype,
                layers=layers, block_size=16, kv_heads=2, head_dim=32, **kw)


class CountingDestination(PagedCacheDestination):
    """Counts staged writes (a direct receive makes none)."""

    writes = 0

    def write(self, plane_start: int, kv: torch.Tensor) -> None:
        super().write(plane_start, kv)
        self.writes += 1


class SlowDestination(CountingDestination):
    """Staged only, and sleeps in every write, so a test can act mid-payload."""

    def __init__(self, *args: Any, delay_s: float):
        super().__init__(*args, direct=False)
        self.delay_s = delay_s

    def write(self, plane_start: int, kv: torch.Tensor) -> None:
        time.sleep(self.delay_s)
        super().write(plane_start, kv)


# --- the agent: a prefill (or decode) worker stand-in in its own process ---------------------

def agent_main() -> None:
    """Serve JSON-line commands on stdin until EOF or ``exit``."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(name)s %(message)s")
    senders: dict[str, KVSender] = {}  # one per config: a send's config must apply to it
    receiver: KVReceiver | None = None
    caches: dict[str, tuple[torch.Tensor, dict[str, Any], Any]] = {}
    out = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        reply: dict[str, Any] = {}
        cfg = TransferConfig(**cmd.get("config", TEST_CFG))
        if op in ("send", "early"):
            # the fault hook as the worker's command line reads it (cluster/cli/component.py)
            key = json.dumps(cmd.get("config", TEST_CFG), sort_keys=True)
            if key not in senders:
                senders[key] = KVSender(cmd["name"], fault_hooks_from_env(cfg))
            sender = senders[key]
        if op == "send":
            handles = []
            for it in cmd["items"]:
                lay = layout_of(it)
                n = it.get("num_blocks", len(it["block_ids"]))
                kv = make_kv(it["seed"], lay, n)
                handles.append(sender.send(cmd["address"], it["request_id"],
                                           it["block_ids"][:n], kv, it.get("timeout_s")))
            results = [h.wait(60.0) for h in handles]
            reply["results"] = [dict(state=r.state.value, reason=r.reason) for r in results]
        elif op == "early":
            # as a prefill worker does: offer from a paged cache whose blocks the step has
            # not written yet, "compute" for compute_s, then decide each offer
            offers = []
            for it in cmd["items"]:
                lay, n = layout_of(it), len(it["block_ids"])
                src = list(range(n - 1, -1, -1))  # reversed: a gather on the sender side
                cache = new_cache(lay, n)
                offers.append((sender.offer_paged(cmd["address"], it["request_id"], cache, src,
                                                  it["block_ids"], 16), cache, src, it))
            time.sleep(cmd["compute_s"])
            for offer, cache, src, it in offers:
                decide, kv = it.get("decide", "go"), make_kv(it["seed"], layout_of(it), len(src))
                if decide == "bye":  # the pair breaks on this side while gloo's connection
                    # stays up: the decode side hears the bye, and no reset (what a lossy
                    # link did in CI; a harness reaching in, as no public call does this)
                    sender._pairs[cmd["address"]].close("test: the prefill side's pair broke")
                layers = it["layers"] // 2 if decide == "void-midway" else it["layers"]
                if "layer_s" in cmd or decide in ("void-midway", "told-undecided"):
                    for layer in range(layers):  # layer by layer, told
                        scatter_blocks(cache, src, 16, kv[layer:layer + 1], layer)
                        offer.layers_done(layer + 1)
                        time.sleep(cmd.get("layer_s", 0.05))
                elif decide == "go":
                    scatter_blocks(cache, src, 16, kv)
                if decide == "go":
                    offer.go()
                elif decide in ("void", "void-midway"):
                    offer.void()
            results = [o.handle.wait(60.0) for o, *_ in offers]
            reply["results"] = [dict(state=r.state.value, reason=r.reason) for r in results]
        elif op == "serve":
            receiver = KVReceiver(cmd["name"], cfg)
            reply["address"] = receiver.address
        elif op == "expect":
            assert receiver is not None
            for it in cmd["items"]:
                lay = layout_of(it)
                cache = torch.full((lay.num_layers, 2, 64 * 16, 2, 32), SENTINEL,
                                   dtype=lay.dtype)
                dest = SlowDestination(cache, it["block_ids"], 16, delay_s=cmd["delay_s"])
                h = receiver.expect(it["request_id"], lay, it["block_ids"], dest)
                caches[it["request_id"]] = (cache, it, h)
        elif op != "exit":
            reply["error"] = f"unknown op {op}"
        out.write(json.dumps(reply) + "\n")
        out.flush()
        if op == "exit":
            break
    for sender in senders.values():
        sender.close()
    if receiver is not None:
        receiver.close()
    exit_after_shutdown(0)  # as a worker ends (common.process_exit says why)


class Agent:
    """A child process running :func:`agent_main`."""

    def __init__(self, name: str, log_dir: Path):
        self.name = name
        boot = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(HERE)!r}]; "
                "import test_transfer_channel as t; t.agent_main()")
        self.log = log_dir / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, "-c", boot], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log.open("wb"))
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)

    def submit(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(dict(op=op, name=self.name, **kw)) + "\n").encode())
        self.proc.stdin.flush()

    def reply(self, timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not self._sel.select(timeout):
            raise TimeoutError(f"agent {self.name} silent for {timeout}s; log:\n"
                               + self.log.read_text()[-3000:])
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent {self.name} exited; log:\n" + self.log.read_text()[-3000:])
        return json.loads(line)

    def call(self, op: str, timeout: float = 60.0, **kw: Any) -> dict[str, Any]:
        self.submit(op, **kw)
        return self.reply(timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
                self.proc.wait(10)
            except Exception:  # noqa: BLE001 - fall back to a kill
                self.proc.kill()
                self.proc.wait(10)
        self._sel.close()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Agent]]:
    log_dir = tmp_path_factory.mktemp("agents")
    a = {n: Agent(n, log_dir) for n in ("prefill-a", "prefill-b")}
    yield a
    for agent in a.values():
        agent.stop()
        assert agent.proc.returncode == 0, agent.log.read_text()[-3000:]


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


def channel_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvx-")]


def assert_receiver_idle(rx: KVReceiver) -> None:
    deadline = time.monotonic() + 5.0
    while rx.live_transfers() or rx.parked_offers() or rx.stats().in_flight:
        assert time.monotonic() < deadline, (f"leaked: live={rx.live_transfers()} "
                                             f"parked={rx.parked_offers()} {rx.stats()}")
        time.sleep(0.05)


def assert_released(port: int) -> None:
    deadline = time.monotonic() + 5.0
    while channel_threads():
        assert time.monotonic() < deadline, f"threads left: {channel_threads()}"
        time.sleep(0.05)
    assert port not in listening_ports(), f"store port {port} still listening"


def listening_ports() -> set[int]:
    """Local ports in LISTEN state (connections the peers still hold may linger; the
    store itself must not)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                fields = row.split()
                if fields[3] == "0A":
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.fixture
def decode() -> Iterator[KVReceiver]:
    rx = KVReceiver("decode-test", TransferConfig(**{**TEST_CFG, "offer_timeout_s": 1.0}))
    yield rx
    assert_receiver_idle(rx)
    port = int(rx.address.rsplit(":", 1)[1])
    rx.close()
    assert_released(port)


def new_cache(layout: KVLayout, num_blocks: int = 64) -> torch.Tensor:
    return torch.full((layout.num_layers, 2, num_blocks * layout.block_size, layout.kv_heads,
                       layout.head_dim), SENTINEL, dtype=layout.dtype)


def assert_only_blocks_written(cache: torch.Tensor, expected: dict[int, torch.Tensor],
                               block_size: int) -> None:
    """``expected``: block id -> [layers, 2, block_size, heads, dim]; every other block
    still holds the sentinel."""
    view = cache.view(cache.shape[0], 2, -1, block_size, *cache.shape[3:])
    for b in range(view.shape[2]):
        if b in expected:
            assert torch.equal(view[:, :, b], expected[b]), f"block {b} differs"
        else:
            assert bool((view[:, :, b] == SENTINEL).all()), f"block {b} was touched"


# --- wire format and state machine, in-process -------------------------------------------

def test_request_id64_is_pinned_and_process_independent() -> None:
    assert request_id64("req-0") == -6735903450509273110
    assert request_id64("chatcmpl-abc") == -2116468612567243121


def test_offer_roundtrip_and_corruption_is_refused() -> None:
    lay = KVLayout(30, 16, 3, 64, torch.bfloat16)
    h = TransferHeader(request_id64("r"), 7, 3, 2, lay, lay.payload_bytes(2), 4, -5)
    data = encode_offer(h, [9, 4])
    assert decode_offer(data) == (h, [9, 4])
    assert check_offer(h, [9, 4], lay, [9, 4], 1 << 30) is None
    assert "count" in check_offer(h, [9, 4], lay, [9, 4, 1], 1 << 30)
    assert "block ids" in check_offer(h, [9, 4], lay, [4, 9], 1 << 30)
    assert "exceeds" in check_offer(h, [9, 4], lay, [9, 4], 100)
    corrupt = bytearray(data)
    corrupt[12 * 8] ^= 1  # one bit of payload_bytes
    with pytest.raises(HeaderError, match="checksum") as e:
        decode_offer(bytes(corrupt))
    assert e.value.seq is None  # a corrupt header names no transfer to refuse
    with pytest.raises(HeaderError, match="block ids") as e:
        decode_offer(data[:-8])  # one block id short
    assert (e.value.seq, e.value.pair_id) == (7, 3)
    staged = message_plan(h, [9, 4], direct=False)
    assert [(m.p0, m.p1) for m in staged][-1] == (56, 60) and len(staged) == 15
    runs = [5, 6, 7, 1, 2, 9]
    h6 = TransferHeader(1, 1, 1, 6, lay, lay.payload_bytes(6), 60, 0)
    direct = message_plan(h6, runs, direct=True)
    assert [(m.i0, m.i1) for m in direct[:3]] == [(0, 3), (3, 5), (5, 6)] and len(direct) == 180
    assert sum((m.p1 - m.p0) * (m.i1 - m.i0) for m in direct) * lay.plane_block_bytes == (
        h6.payload_bytes)
    tags = {tag_for(s, c) for s in range(1, 200) for c in range(31)}
    assert len(tags) == 199 * 31 and all(1 << 30 <= t < 1 << 31 for t in tags)


def test_state_machine_has_one_terminal_winner_and_counts() -> None:
    counters = StateCounters()
    h = TransferHandle("r", counters)
    seen: list[TransferState] = []
    h.add_done_callback(lambda r: seen.append(r.state))
    with pytest.raises(AssertionError):
        h.advance(TransferState.DONE)  # PENDING -> DONE is not a transition
    assert h.advance(TransferState.SENDING)
    assert not h.cancel()  # a sender's accepted payload runs to its end
    assert h.advance(TransferState.TIMED_OUT, "deadline")
    assert not h.advance(TransferState.DONE)  # the first terminal state wins
    assert seen == [TransferState.TIMED_OUT] and h.wait(0.1).reason == "deadline"
    snap = counters.snapshot(0)
    assert snap.entered["sending"] == 1 and snap.current["timed_out"] == 1
    assert snap.in_flight == 0
    rx = TransferHandle("r2", counters, frozenset({TransferState.PENDING,
                                                   TransferState.RECEIVING}))
    assert rx.seal() and rx.advance(TransferState.RECEIVING)
    assert not rx.cancel()  # a direct receive cannot be called back
    assert rx.advance(TransferState.DONE) and counters.snapshot(0).current["done"] == 1


def test_memory_is_returned_only_once_lingering_messages_resolve() -> None:
    counters = StateCounters()
    h = TransferHandle("q", counters)
    returned: list[str] = []
    h.add_quiesced_callback(lambda: returned.append("early"))
    assert h.advance(TransferState.SENDING)
    settle = h.linger()  # a posted message gloo cannot take back
    assert h.advance(TransferState.FAILED, "transport error")
    assert h.state.terminal and not h.quiesced and not returned
    settle()
    settle()  # idempotent
    assert h.quiesced and returned == ["early"]
    h.add_quiesced_callback(lambda: returned.append("late"))  # already quiesced: now
    assert returned == ["early", "late"]
    pending = TransferHandle("p", counters)
    assert pending.advance(TransferState.SENDING) and not pending.cancel_pending()
    assert TransferHandle("c", counters).cancel_pending("gone")


def test_an_abandoned_transfer_ends_now_and_quiesces_when_its_thread_lets_go() -> None:
    """What a receive pair's close does to a transfer still landing on it: FAILED at
    once (the request goes on), the memory held until its receive thread settles."""
    counters = StateCounters()
    h = TransferHandle("a", counters, frozenset({TransferState.PENDING}))
    assert h.seal() and h.advance(TransferState.RECEIVING)  # direct: not cancellable
    ended: list[TransferState] = []
    returned: list[int] = []
    h.add_done_callback(lambda r: ended.append(r.state))
    h.add_quiesced_callback(lambda: returned.append(1))
    settle = h.abandon("pair 3 closed under the transfer")
    assert settle is not None and ended == [TransferState.FAILED]
    assert h.result().reason == "pair 3 closed under the transfer"
    assert not h.quiesced and not returned
    assert h.abandon("again") is None  # ended already: nothing more to settle
    assert not h.advance(TransferState.DONE)  # the thread's late outcome loses
    settle()
    assert h.quiesced and returned == [1] and counters.snapshot(0).current["failed"] == 1
    # Nothing is held where nothing can write any more: a staged receive (cancellable,
    # it writes under the handle), or where the caller knows (hold=False: it landed).
    staged = TransferHandle("s", counters, frozenset({TransferState.PENDING,
                                                      TransferState.RECEIVING}))
    assert staged.advance(TransferState.RECEIVING)
    staged.abandon("pair closed")
    assert staged.quiesced
    landed = TransferHandle("l", counters)
    assert landed.seal() and landed.advance(TransferState.RECEIVING)
    landed.abandon("pair closed", hold=False)
    assert landed.quiesced
    # A done callback that raises is logged; the memory still comes back.
    broken = TransferHandle("b", counters)
    broken.add_done_callback(lambda r: 1 / 0)
    assert broken.advance(TransferState.FAILED, "x") and broken.quiesced


def test_gather_scatter_roundtrip_through_block_ids() -> None:
    lay = KVLayout(3, 4, 2, 8, torch.float32)
    cache = new_cache(lay, 10)
    kv = make_kv(1, lay, 3)
    scatter_blocks(cache, [7, 0, 4], 4, kv)
    assert torch.equal(gather_blocks(cache, [7, 0, 4], 4), kv)
    assert_only_blocks_written(cache, {7: kv[:, :, 0], 0: kv[:, :, 1], 4: kv[:, :, 2]}, 4)
    with pytest.raises(ValueError, match="outside"):
        PagedCacheDestination(cache, [10], 4)


# --- across processes ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("framing,block_ids", [
    ("staged", [11, 3, 7, 0, 20]),  # scattered ids: messages land in a buffer, then scatter
    ("direct", [*range(20, 36), *range(40, 48)]),  # two runs: received in place
])
def test_kv_arrives_bit_exact_in_target_blocks(agents: dict[str, Agent], decode: KVReceiver,
                                               dtype: str, framing: str,
                                               block_ids: list[int]) -> None:
    it = item(f"exact-{dtype}-{framing}", block_ids, seed=5, dtype=dtype)
    lay = layout_of(it)
    cache = new_cache(lay)
    dest = CountingDestination(cache, block_ids, 16)
    h = decode.expect(it["request_id"], lay, block_ids, dest)
    reply = agents["prefill-a"].call("send", address=decode.address, items=[it])
    assert reply["results"] == [dict(state="done", reason=None)]
    result = h.wait(10)
    assert result.ok and result.nbytes == lay.payload_bytes(len(block_ids))
    assert (dest.writes == 0) == (framing == "direct")
    kv = make_kv(5, lay, len(block_ids))
    assert_only_blocks_written(cache, {b: kv[:, :, i] for i, b in enumerate(block_ids)}, 16)
    stats = decode.stats()
    assert stats.entered["receiving"] == 1 and stats.current["done"] == 1
    assert stats.pairs_open == 1


def test_two_pairs_and_concurrent_transfers_do_not_mix(agents: dict[str, Agent],
                                                       decode: KVReceiver) -> None:
    lay = layout_of(item("x", [], 0))
    cache = new_cache(lay)
    # a: runs of 3 blocks (staged framing); b: runs of 6 (direct); both on one decode
    plan = {name: [item(f"{name}-{k}", list(range(base + size * k, base + size * (k + 1))),
                        seed=100 * i + k) for k in range(3)]
            for i, (name, base, size) in enumerate((("prefill-a", 0, 3), ("prefill-b", 20, 6)))}
    late = plan["prefill-b"][2]  # reserved only after its offer may have arrived
    handles, dests = {}, {}
    for its in plan.values():
        for it in its:
            dests[it["request_id"]] = CountingDestination(cache, it["block_ids"], 16)
            if it is not late:
                handles[it["request_id"]] = decode.expect(
                    it["request_id"], lay, it["block_ids"], dests[it["request_id"]])
    for name, its in plan.items():
        agents[name].submit("send", address=decode.address, items=its)
    time.sleep(0.3)
    handles[late["request_id"]] = decode.expect(late["request_id"], lay, late["block_ids"],
                                                dests[late["request_id"]])
    for name in plan:
        assert [r["state"] for r in agents[name].reply()["results"]] == ["done"] * 3
    expected = {}
    for its in plan.values():
        for it in its:
            assert handles[it["request_id"]].wait(10).ok
            staged = dests[it["request_id"]].writes > 0
            assert staged == (len(it["block_ids"]) == 3)
            kv = make_kv(it["seed"], lay, len(it["block_ids"]))
            expected.update({b: kv[:, :, i] for i, b in enumerate(it["block_ids"])})
    assert_only_blocks_written(cache, expected, 16)
    assert decode.stats().pairs_open == 2


def test_pair_closed_by_decode_is_reopened_by_the_next_send(agents: dict[str, Agent],
                                                            decode: KVReceiver) -> None:
    for k in range(2):
        it = item(f"reopen-{k}", [k], seed=30 + k)
        h = decode.expect(it["request_id"], layout_of(it), [k],
                          PagedCacheDestination(new_cache(layout_of(it)), [k], 16))
        assert agents["prefill-b"].call("send", address=decode.address,
                                        items=[it])["results"][0]["state"] == "done"
        assert h.wait(10).ok
        assert decode.close_pair("prefill-b", "test: registry says it restarted")
    assert decode.stats().pairs_open == 0 and decode.stats().entered["done"] == 2


def test_mismatched_offer_is_refused_without_touching_destination(
        agents: dict[str, Agent], decode: KVReceiver) -> None:
    lay = layout_of(item("x", [], 0))
    cache = new_cache(lay)
    wrong_dtype = item("wrong-dtype", [1, 2, 3, 4], seed=1, dtype="bfloat16")
    wrong_count = item("wrong-count", [5, 6, 7, 8], seed=2, num_blocks=3)
    h1 = decode.expect("wrong-dtype", lay, [1, 2, 3, 4],
                       PagedCacheDestination(cache, [1, 2, 3, 4], 16))
    h2 = decode.expect("wrong-count", lay, [5, 6, 7, 8],
                       PagedCacheDestination(cache, [5, 6, 7, 8], 16))
    unreserved = item("nobody-reserved", [9], seed=3, timeout_s=0.5)
    reply = agents["prefill-a"].call("send", address=decode.address,
                                     items=[wrong_dtype, wrong_count, unreserved])
    (r1, r2, r3) = reply["results"]
    assert r1["state"] == "failed" and "dtype mismatch" in r1["reason"], r1
    assert r2["state"] == "failed" and "block count mismatch" in r2["reason"], r2
    assert r3["state"] == "timed_out" and "did not accept" in r3["reason"], r3
    assert h1.wait(5).state is TransferState.FAILED and "dtype" in h1.result().reason
    assert h2.wait(5).state is TransferState.FAILED and "count" in h2.result().reason
    assert_only_blocks_written(cache, {}, 16)
    assert decode.stats().entered["receiving"] == 0


def test_flipped_kv_byte_fails_either_framing_and_keeps_the_pair(
        decode: KVReceiver, log_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault hook (read from the prefill process's environment) flips one byte on the
    wire after the sender took the checksum: the sender cannot tell, the decode side
    lands the payload, finds the mismatch and fails the transfer, in the staged and the
    direct framing alike; the pair stays in step for the next transfer."""
    monkeypatch.setenv("PDSERVE_FAULT_FLIP_KV_BYTE", "flip-")
    agent = Agent("prefill-flip", log_dir)
    try:
        flips = [item("flip-staged", [1, 3, 5], seed=41),  # runs of 1 block: staged
                 item("flip-direct", list(range(20, 36)), seed=42)]  # one long run: direct
        clean = item("clean", [40, 41], seed=43)
        lay = layout_of(clean)
        cache = new_cache(lay)
        dests = {it["request_id"]: CountingDestination(cache, it["block_ids"], 16)
                 for it in [*flips, clean]}
        handles = {rid: decode.expect(rid, lay, d.block_ids, d) for rid, d in dests.items()}
        reply = agent.call("send", address=decode.address, items=flips)
        assert [r["state"] for r in reply["results"]] == ["done", "done"], reply
        for it in flips:
            result = handles[it["request_id"]].wait(10)
            assert result.state is TransferState.FAILED, result
            assert "checksum mismatch" in (result.reason or ""), result
        assert dests["flip-staged"].writes > 0 and dests["flip-direct"].writes == 0
        # exactly one byte of what landed in place differs from what was sent
        kv = make_kv(42, lay, 16)
        landed = cache.view(lay.num_layers, 2, -1, 16, 2, 32)[:, :, 20:36]
        sent = kv.contiguous().view(-1).view(torch.uint8)
        assert int((landed.contiguous().view(-1).view(torch.uint8) != sent).sum()) == 1
        # an early offer's checksum comes in its trailer, taken from the blocks while the
        # flipped copy is on the wire: caught the same way
        early = item("flip-early", [44, 45, 46], seed=44)
        h = decode.expect("flip-early", lay, [44, 45, 46],
                          PagedCacheDestination(cache, [44, 45, 46], 16))
        assert agent.call("early", address=decode.address, items=[early],
                          compute_s=0.1)["results"][0]["state"] == "done"
        assert "checksum mismatch" in (h.wait(10).reason or "")
        assert agent.call("send", address=decode.address,
                          items=[clean])["results"][0]["state"] == "done"
        assert handles["clean"].wait(10).ok
        kv = make_kv(43, lay, 2)
        view = cache.view(lay.num_layers, 2, -1, 16, 2, 32)
        assert torch.equal(view[:, :, 40:42], kv)
        stats = decode.stats()
        assert stats.checksum_failures == 3 and stats.entered["failed"] == 3
        assert stats.entered["done"] == 1 and stats.pairs_open == 1
    finally:
        agent.stop()
    assert agent.proc.returncode == 0, agent.log.read_text()[-3000:]


def test_cancel_while_receiving_stops_writes_and_keeps_the_pair(
        agents: dict[str, Agent], decode: KVReceiver) -> None:
    it = item("cancel-me", [1, 2], seed=21, layers=12)
    lay = layout_of(it)
    cache = new_cache(lay)
    # 0.3 s a write: the cancel below must land before the payload ends, even when this
    # thread is descheduled for a while on a loaded machine (0.1 s flaked once in CI).
    dest = SlowDestination(cache, [1, 2], 16, delay_s=0.3)
    h = decode.expect("cancel-me", lay, [1, 2], dest)
    one_plane = {**TEST_CFG, "chunk_bytes": 1}  # 24 messages, one plane each: 7 s of writes
    agents["prefill-a"].submit("send", address=decode.address, items=[it], config=one_plane)
    deadline = time.monotonic() + 30
    while dest.writes < 2:
        assert time.monotonic() < deadline, "transfer never started writing"
        time.sleep(0.01)
    assert h.cancel("client went away"), h.result()
    written = dest.writes
    assert agents["prefill-a"].reply()["results"][0]["state"] == "done"  # drained
    assert h.result().state is TransferState.CANCELLED and dest.writes == written < 24
    again = item("after-cancel", [5], seed=22)
    cache2 = new_cache(layout_of(again))
    h2 = decode.expect("after-cancel", layout_of(again), [5],
                       PagedCacheDestination(cache2, [5], 16))
    assert agents["prefill-a"].call("send", address=decode.address, items=[again],
                                    config=one_plane)["results"][0]["state"] == "done"
    assert h2.wait(10).ok and decode.stats().pairs_open == 1  # same pair, still healthy
    kv = make_kv(22, layout_of(again), 1)
    assert_only_blocks_written(cache2, {5: kv[:, :, 0]}, 16)


def test_prefill_killed_mid_transfer_fails_reservation_and_decode_serves_another_pair(
        agents: dict[str, Agent], decode: KVReceiver, log_dir: Path) -> None:
    victim = Agent("prefill-victim", log_dir)
    try:
        it = item("victim", [1, 2], seed=7, layers=12)
        lay = layout_of(it)
        cache = new_cache(lay)
        h = decode.expect("victim", lay, [1, 2],
                          SlowDestination(cache, [1, 2], 16, delay_s=0.25))
        victim.submit("send", address=decode.address, items=[it],
                      config={**TEST_CFG, "chunk_bytes": 1})  # one layer per message
        deadline = time.monotonic() + 30
        while h.state is TransferState.PENDING:
            assert time.monotonic() < deadline, "transfer never started"
            time.sleep(0.02)
        assert h.state is TransferState.RECEIVING
        victim.kill()
        killed = time.monotonic()
        result = h.wait(TEST_CFG["data_timeout_s"] + 2)
        assert result.state in (TransferState.FAILED, TransferState.TIMED_OUT), result
        assert time.monotonic() - killed < TEST_CFG["data_timeout_s"] + 1
        assert "broke" in result.reason
    finally:
        victim.proc.kill()
        victim.stop()
    ok = item("after-victim", [30, 31], seed=8)
    lay = layout_of(ok)
    cache = new_cache(lay)
    h2 = decode.expect("after-victim", lay, [30, 31], PagedCacheDestination(cache, [30, 31], 16))
    assert agents["prefill-b"].call("send", address=decode.address,
                                    items=[ok])["results"][0]["state"] == "done"
    assert h2.wait(10).ok
    kv = make_kv(8, lay, 2)
    assert_only_blocks_written(cache, {30: kv[:, :, 0], 31: kv[:, :, 1]}, 16)


def test_hung_prefill_times_out_within_the_data_timeout(decode: KVReceiver,
                                                        log_dir: Path) -> None:
    victim = Agent("prefill-hung", log_dir)
    try:
        it = item("hung", [4], seed=9, layers=12)
        lay = layout_of(it)
        h = decode.expect("hung", lay, [4],
                          SlowDestination(new_cache(lay), [4], 16, delay_s=0.2))
        victim.submit("send", address=decode.address, items=[it],
                      config={**TEST_CFG, "chunk_bytes": 1})
        deadline = time.monotonic() + 30
        while h.state is TransferState.PENDING:
            assert time.monotonic() < deadline, "transfer never started"
            time.sleep(0.02)
        victim.kill(signal.SIGSTOP)
        stopped = time.monotonic()
        result = h.wait(TEST_CFG["data_timeout_s"] + 3)
        assert result.state is TransferState.TIMED_OUT, result
        assert time.monotonic() - stopped < TEST_CFG["data_timeout_s"] + 2
    finally:
        victim.proc.kill()
        victim.stop()


def test_decode_killed_mid_transfer_fails_send_and_prefill_serves_another_pair(
        decode: KVReceiver, log_dir: Path) -> None:
    victim = Agent("decode-victim", log_dir)
    sender = KVSender("prefill-here", TransferConfig(**{**TEST_CFG, "chunk_bytes": 1}))
    try:
        address = victim.call("serve", config=TEST_CFG)["address"]
        it = item("to-dead-decode", [3, 4], seed=11, layers=12)
        lay = layout_of(it)
        victim.call("expect", items=[it], delay_s=0.25)
        h = sender.send(address, "to-dead-decode", [3, 4], make_kv(11, lay, 2))
        deadline = time.monotonic() + 30
        while h.state is TransferState.PENDING:
            assert time.monotonic() < deadline, "transfer never started"
            time.sleep(0.02)
        assert h.state is TransferState.SENDING
        victim.kill()
        killed = time.monotonic()
        result = h.wait(TEST_CFG["data_timeout_s"] + 2)
        assert result.state in (TransferState.FAILED, TransferState.TIMED_OUT), result
        assert time.monotonic() - killed < TEST_CFG["data_timeout_s"] + 1
        # Sending to the dead address again fails at once (connection refused), not
        # after the 10 s connect timeout: nothing waits on a worker that is gone. (Once
        # reaped; while it tears down, within a store try: the next test.)
        victim.proc.wait(10)
        again = sender.send(address, "to-dead-decode-2", [3, 4], make_kv(11, lay, 2))
        result = again.wait(TEST_CFG["connect_timeout_s"] / 2)
        assert result.state is TransferState.FAILED and "refused" in result.reason, result
        # and the same sender still serves another pair
        cache = new_cache(lay)
        h2 = decode.expect("other-pair", lay, [8, 9], PagedCacheDestination(cache, [8, 9], 16))
        kv = make_kv(12, lay, 2)
        assert sender.send(decode.address, "other-pair", [8, 9], kv).wait(10).ok
        assert h2.wait(10).ok
        assert torch.equal(gather_blocks(cache, [8, 9], 16), kv)
        assert sender.stats().in_flight == 0
    finally:
        sender.close()
        victim.proc.kill()
        victim.stop()


def test_joining_the_store_of_a_process_tearing_down_fails_within_a_try() -> None:
    """A killed process still tearing down (torch's mappings, on busy cores) keeps its
    listening socket a moment: its backlog takes the connect, then resets it, and
    TCPStore's client alone retries for its whole timeout (10 s here). connect_store
    joins in 1 s tries and probes the listener before each: refused once it is gone."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=8)  # never accepts
    port = listener.getsockname()[1]
    closer = threading.Timer(0.5, listener.close)
    closer.start()
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionRefusedError):
            connect_store("127.0.0.1", port, 10.0)
        assert time.monotonic() - started < 5
    finally:
        closer.cancel()
        listener.close()
    server = listen_store("127.0.0.1", 0, 10.0)  # a live one: joined, with the whole timeout
    try:
        client = connect_store("127.0.0.1", server.port, 10.0)
        client.set("k", b"v")
        assert server.get("k") == b"v" and client.timeout == timedelta(seconds=10)
    finally:
        del server


# --- early offers: offered while the prefill computes, decided after ---------------------


def test_early_offer_is_accepted_before_the_kv_exists_and_lands_bit_exact(
        agents: dict[str, Agent], decode: KVReceiver) -> None:
    """The offer and the accept happen while the sender's blocks are still empty; the
    payload and its trailer (the checksum) follow ``go``, in either framing."""
    its = [item("early-staged", [1, 3, 5], seed=51),  # runs of 1 block: staged
           item("early-direct", list(range(20, 36)), seed=52)]  # one long run: direct
    lay = layout_of(its[0])
    cache = new_cache(lay)
    dests = {it["request_id"]: CountingDestination(cache, it["block_ids"], 16) for it in its}
    handles = {rid: decode.expect(rid, lay, d.block_ids, d) for rid, d in dests.items()}
    agents["prefill-a"].submit("early", address=decode.address, items=its, compute_s=1.5)
    deadline = time.monotonic() + 10
    while any(h.state is not TransferState.RECEIVING for h in handles.values()):
        assert time.monotonic() < deadline, {r: h.state for r, h in handles.items()}
        time.sleep(0.01)
    assert bool((cache == SENTINEL).all())  # accepted; nothing has landed yet
    assert agents["prefill-a"].reply()["results"] == [dict(state="done", reason=None)] * 2
    expected = {}
    for it in its:
        assert handles[it["request_id"]].wait(10).ok
        kv = make_kv(it["seed"], lay, len(it["block_ids"]))
        expected.update({b: kv[:, :, i] for i, b in enumerate(it["block_ids"])})
    assert dests["early-staged"].writes > 0 and dests["early-direct"].writes == 0
    assert_only_blocks_written(cache, expected, 16)
    stats = decode.stats()
    assert stats.entered["done"] == 2 and stats.checksum_failures == 0


def test_void_or_undecided_early_offer_fails_both_ends_and_keeps_the_pair(
        agents: dict[str, Agent], decode: KVReceiver) -> None:
    """``void`` (the request ended without its KV) ends the transfer CANCELLED on both
    ends, no decision within early_go_timeout_s TIMED_OUT; the decode side is told by the
    trailer, not by a receive timing out: the pair stays in step for the next transfer."""
    quick = {**TEST_CFG, "early_go_timeout_s": 1.0}
    its = [item("void-direct", list(range(8, 16)), seed=61, decide="void"),
           item("void-staged", [1, 3], seed=62, decide="void"),
           item("undecided", [40, 41, 42, 43], seed=63, decide="none")]
    lay = layout_of(its[0])
    cache = new_cache(lay)
    handles = {it["request_id"]: decode.expect(
        it["request_id"], lay, it["block_ids"],
        PagedCacheDestination(cache, it["block_ids"], 16)) for it in its}
    started = time.monotonic()
    reply = agents["prefill-b"].call("early", address=decode.address, items=its,
                                     compute_s=0.2, config=quick)
    void, expired = reply["results"][:2], reply["results"][2]
    for r in void:
        assert r["state"] == "cancelled" and "withdrawn after the accept" in r["reason"], r
    assert expired["state"] == "timed_out" and "early_go_timeout_s" in expired["reason"]
    for it in its:
        result = handles[it["request_id"]].wait(10)
        want = ((TransferState.TIMED_OUT, "in time") if it["decide"] == "none"
                else (TransferState.CANCELLED, "withdrew"))
        assert (result.state, want[1] in (result.reason or "")) == (want[0], True), result
    assert time.monotonic() - started < TEST_CFG["data_timeout_s"] + 2.5  # no receive timed out
    stats = decode.stats()
    assert stats.checksum_failures == 0 and stats.pairs_open == 1
    assert stats.entered["failed"] == 0
    again = item("after-void", [50, 51], seed=64)
    h = decode.expect("after-void", lay, [50, 51], PagedCacheDestination(cache, [50, 51], 16))
    assert agents["prefill-b"].call("early", address=decode.address, items=[again],
                                    compute_s=0.0, config=quick)["results"][0]["state"] == "done"
    assert h.wait(10).ok and decode.stats().pairs_open == 1
    view = cache.view(lay.num_layers, 2, -1, 16, 2, 32)
    assert torch.equal(view[:, :, 50:52], make_kv(64, lay, 2))


def test_early_offer_streams_each_layer_as_it_is_done(agents: dict[str, Agent],
                                                      decode: KVReceiver) -> None:
    """Told layer by layer (as a prefill worker's forward tells it), an early offer sends
    each layer's KV while the next ones compute: the first layer lands while the last is
    not even written on the sender. A void after half the layers went still ends the
    transfer CANCELLED on both ends, the pair in step."""
    it = item("streamed", list(range(8, 24)), seed=71)  # one long run: direct, per plane
    lay = layout_of(it)
    cache = new_cache(lay)
    h = decode.expect("streamed", lay, it["block_ids"],
                      PagedCacheDestination(cache, it["block_ids"], 16))
    agents["prefill-a"].submit("early", address=decode.address, items=[it], compute_s=0.0,
                               layer_s=0.5)  # 6 layers: 3 s
    kv = make_kv(71, lay, 16)
    view = cache.view(lay.num_layers, 2, -1, 16, 2, 32)
    deadline = time.monotonic() + 20
    while not torch.equal(view[0, :, 8:24], kv[0]):
        assert time.monotonic() < deadline, "the first layer never landed"
        time.sleep(0.01)
    assert bool((view[-1, :, 8:24] == SENTINEL).all())  # the last layer is still to come
    assert h.state is TransferState.RECEIVING
    assert agents["prefill-a"].reply()["results"] == [dict(state="done", reason=None)]
    assert h.wait(10).ok and torch.equal(view[:, :, 8:24], kv)
    midway = item("void-midway", list(range(30, 40)), seed=72, decide="void-midway")
    h = decode.expect("void-midway", lay, midway["block_ids"],
                      PagedCacheDestination(cache, midway["block_ids"], 16))
    r = agents["prefill-a"].call("early", address=decode.address, items=[midway],
                                 compute_s=0.0)["results"][0]
    assert r["state"] == "cancelled", r
    assert h.wait(10).state is TransferState.CANCELLED
    stats = decode.stats()
    assert stats.pairs_open == 1 and stats.entered["failed"] == 0


def test_an_early_offer_whose_layers_all_went_may_wait_longer_than_a_message(
        agents: dict[str, Agent], decode: KVReceiver) -> None:
    """Every layer sent as it was done, then no decision for longer than one message's
    data_timeout_s: the decode side waits for the trailer as long as the sender may wait
    for its decision, so the transfer ends TIMED_OUT by the expired trailer, and the pair
    stays open and in step."""
    slow_go = {**TEST_CFG, "early_go_timeout_s": TEST_CFG["data_timeout_s"] + 1.5}
    it = item("told-undecided", [60, 61], seed=81, decide="told-undecided")
    lay = layout_of(it)
    cache = new_cache(lay)
    h = decode.expect("told-undecided", lay, [60, 61], PagedCacheDestination(cache, [60, 61], 16))
    r = agents["prefill-b"].call("early", address=decode.address, items=[it], compute_s=0.0,
                                 config=slow_go)["results"][0]
    assert r["state"] == "timed_out" and "early_go_timeout_s" in r["reason"], r
    assert h.wait(10).state is TransferState.TIMED_OUT
    assert decode.stats().pairs_open == 1
    again = item("after-undecided", [62], seed=82)
    h = decode.expect("after-undecided", lay, [62], PagedCacheDestination(cache, [62], 16))
    assert agents["prefill-b"].call("early", address=decode.address, items=[again],
                                    compute_s=0.0, config=slow_go)["results"][0]["state"] == "done"
    assert h.wait(10).ok and decode.stats().pairs_open == 1


def test_a_pair_closed_under_an_early_offer_fails_it_at_once_and_holds_its_blocks(
        agents: dict[str, Agent], decode: KVReceiver) -> None:
    """The prefill side closes a pair (its bye) while an accepted early offer's first
    message is still awaited, and gloo's connection stays up (a lossy link once hid the
    reset from a posted receive). The transfer ends FAILED after the bye's 1 s grace,
    where before it waited out ``data_timeout_s + early_go_timeout_s`` (65 s in a CI
    run); its memory stays held (not quiesced: a direct receive is posted into it) until
    the payload lands, here the filler the sender sends when the offer expires. A next
    transfer opens a new pair."""
    slow_go = {**TEST_CFG, "early_go_timeout_s": 4.0}
    it = item("bye-early", list(range(8, 16)), seed=91, decide="bye")
    lay = layout_of(it)
    cache = new_cache(lay)
    h = decode.expect("bye-early", lay, it["block_ids"],
                      PagedCacheDestination(cache, it["block_ids"], 16))
    agents["prefill-a"].submit("early", address=decode.address, items=[it], compute_s=0.3,
                               config=slow_go)
    deadline = time.monotonic() + 10
    while h.state is TransferState.PENDING:
        assert time.monotonic() < deadline, "the early offer was never accepted"
        time.sleep(0.01)
    accepted = time.monotonic()
    result = h.wait(10)
    took = time.monotonic() - accepted
    assert result.state is TransferState.FAILED and "closed under the transfer" in (
        result.reason or ""), result
    # the bye's grace (1 s: what was sent before it may be on the way), then at once
    assert took < 3.0, f"the closed pair's transfer ended {took:.1f}s after the accept"
    assert not h.quiesced  # its receive thread still waits: the blocks stay held
    sent = agents["prefill-a"].reply()["results"][0]
    assert sent["state"] == "timed_out", sent  # expired on the prefill side: trailer sent
    deadline = time.monotonic() + 10
    while not h.quiesced:
        assert time.monotonic() < deadline, "the abandoned transfer never let go"
        time.sleep(0.05)
    assert decode.stats().entered["failed"] == 1
    again = item("after-bye", [50, 51], seed=92)
    h = decode.expect("after-bye", lay, [50, 51], PagedCacheDestination(cache, [50, 51], 16))
    assert agents["prefill-a"].call("early", address=decode.address, items=[again],
                                    compute_s=0.0, config=slow_go)["results"][0]["state"] == "done"
    assert h.wait(10).ok
    view = cache.view(lay.num_layers, 2, -1, 16, 2, 32)
    assert torch.equal(view[:, :, 50:52], make_kv(92, lay, 2))
