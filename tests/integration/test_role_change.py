"""A worker changes role in place (``SetRole``, workers/roles.py) while a steady stream
of greedy requests runs through the router, on real processes: 2 prefill + 1 decode
workers on the tiny llama; ``prefill-1`` goes prefill -> decode -> mixed -> prefill, and
gets a stall-free cap while mixed (``SetRole`` on the role it has).

Every request completes with Hugging Face's greedy tokens, the router routes to the
worker in each new role, the worker keeps its process, engine counters and prefix cache
(its weights were not reloaded), and the test ends with every KV block free.
"""

from __future__ import annotations

import queue
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from cluster_helpers import Load, assert_cluster_idle, start
from conftest import hf_greedy
from prometheus_client.parser import text_string_to_metric_families

from protos.pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

MAX_TOKENS = 8
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(9 + 3 * i)] for i in range(8)]
PROBE = list(range(300, 340))  # 10 blocks of 4, only ever sent to prefill-1 directly


def stub(address: str) -> tuple[grpc.Channel, worker_pb2_grpc.WorkerStub]:
    channel = grpc.insecure_channel(address)
    return channel, worker_pb2_grpc.WorkerStub(channel)


def load_of(address: str) -> worker_pb2.WorkerLoad:
    channel, s = stub(address)
    with channel:
        return s.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def probe(address: str) -> int:
    """Generate PROBE on the worker itself (any role serves it); its cached tokens."""
    channel, s = stub(address)
    with channel:
        out = list(s.Generate(worker_pb2.WorkerGenerateRequest(
            request_id=f"probe-{time.monotonic_ns()}", prompt_token_ids=PROBE,
            sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0)), timeout=30))
    return out[-1].usage.cached_tokens


def generate(address: str, prompt: list[int]) -> list[int]:
    """Greedy MAX_TOKENS of ``prompt`` on the worker itself; its tokens."""
    channel, s = stub(address)
    with channel:
        return [t for out in s.Generate(worker_pb2.WorkerGenerateRequest(
            request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                               ignore_eos=True)), timeout=30)
                for t in out.token_ids]


GRACE_S = 0.5  # the workers' --drain-grace-s: shorter than a long request's decode
LONG = [(5 * j) % 97 + 120 for j in range(30)]
LONG_TOKENS = 470  # max positions 512
CHOICES = 16  # greedy, all alike: 16 sequences decode ~3x longer than GRACE_S here


def stream_long(address: str, tokens: list[int]) -> list[int]:
    """Generate LONG for LONG_TOKENS greedy tokens on the worker, CHOICES times,
    appending the first choice's to ``tokens`` as they stream; all of them."""
    channel, s = stub(address)
    with channel:
        for out in s.Generate(worker_pb2.WorkerGenerateRequest(
                request_id=f"long-{time.monotonic_ns()}", prompt_token_ids=LONG,
                sampling=common_pb2.SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0,
                                                   ignore_eos=True), n=CHOICES), timeout=120):
            if out.index == 0:
                tokens.extend(out.token_ids)
    return list(tokens)


def decode_long(address: str, tokens: list[int]) -> list[int]:
    """A ``Decode`` stream of LONG on the (decode) worker, its prompt computed there
    (committed without a first token, as after a failed prefill): LONG_TOKENS greedy
    tokens, CHOICES times, the first choice's appended to ``tokens`` as they stream;
    all of them."""
    reserved: queue.Queue[bool] = queue.Queue()

    def messages():  # noqa: ANN202 - a request iterator
        yield worker_pb2.DecodeRequest(start=worker_pb2.WorkerGenerateRequest(
            request_id=f"long-decode-{time.monotonic_ns()}", prompt_token_ids=LONG,
            sampling=common_pb2.SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0,
                                               ignore_eos=True), n=CHOICES))
        if not reserved.get(timeout=60):
            return  # local: no commit
        yield worker_pb2.DecodeRequest(commit=worker_pb2.DecodeCommit())

    channel, s = stub(address)
    with channel:
        for msg in s.Decode(messages(), timeout=120):
            if msg.HasField("reservation"):
                reserved.put(not msg.reservation.local)
            elif msg.output.index == 0:
                tokens.extend(msg.output.token_ids)
    return list(tokens)


def running_across(change, stream, address: str, tokens_of):  # noqa: ANN001, ANN201
    """Start ``stream(address, tokens)`` (a long request on the worker), make
    ``change()`` once it streams, and check the change did not wait for it and it ends
    with HF's tokens; the change's answer."""
    with ThreadPoolExecutor(1) as pool:
        tokens: list[int] = []
        running = pool.submit(stream, address, tokens)
        deadline = time.monotonic() + 30
        while not tokens:
            assert time.monotonic() < deadline and not running.done()
            time.sleep(0.01)
        answer = change()
        assert len(tokens) < LONG_TOKENS, "the long request ended before the change"
        assert running.result(60) == tokens_of()
    return answer


@pytest.fixture(scope="module")
def role_cluster(tiny_checkpoints, tmp_path_factory):
    c = start(tiny_checkpoints["llama"], tmp_path_factory.mktemp("role-logs"), prefill=2,
              decode=1, block_size=4, local_prefill_threshold=0, drain_grace_s=GRACE_S)
    yield c
    c.stop()


def test_role_changes_under_load_lose_no_request_and_no_block(role_cluster,
                                                               tiny_checkpoints) -> None:
    c = role_cluster
    names = [n for n, _ in c.workers]
    worker = c.worker_addresses[names.index("prefill-1")]
    proc = c.procs[c.names.index("prefill-1")]
    assert probe(worker) == 0
    before = load_of(worker)
    load = Load(c.target, PROMPTS, MAX_TOKENS)
    try:
        load.wait_routed("worker", worker, 0)  # prefill-1 computes prompts as a prefill

        # prefill -> decode, with a second change and a bad role asked meanwhile
        with ThreadPoolExecutor(1) as pool:
            changing = pool.submit(c.set_role, "prefill-1", "decode", "test: more decode")
            time.sleep(0.2)  # it drains for the grace at least
            channel, s = stub(worker)
            with channel:
                with pytest.raises(grpc.RpcError) as e:
                    s.SetRole(worker_pb2.SetRoleRequest(role="mixed"), timeout=10)
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "under way" in e.value.details()
                with pytest.raises(grpc.RpcError) as e:
                    s.SetRole(worker_pb2.SetRoleRequest(role="verifier"), timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert all(r in e.value.details() for r in ("prefill", "decode", "mixed"))
            answer = changing.result(60)
        assert (answer.previous_role, answer.role) == ("prefill", "decode")
        assert answer.kv_address and answer.drained_s >= GRACE_S
        assert c.workers[names.index("prefill-1")] == ("prefill-1", "decode")
        load.wait_routed("decode_worker", worker, len(load.results))

        # decode -> mixed with a long disaggregated request decoding here: the drain
        # waits for reservations' KV, not for the sequences decoding.
        long_reference = hf_greedy(tiny_checkpoints["llama"], [LONG], LONG_TOKENS)[0]
        answer = running_across(lambda: c.set_role(worker, "mixed", "test: colocate"),
                                decode_long, worker, lambda: long_reference)  # by address
        assert (answer.previous_role, answer.role, answer.kv_address) == ("decode", "mixed", "")
        assert load_of(worker).role == "mixed"

        # The stall-free cap, set live on the role it has while a long request decodes
        # here: a prompt sent meanwhile computes 4 tokens a step beside those decodes,
        # and ends with HF's tokens.
        def cap_then_prompt() -> worker_pb2.SetRoleResponse:
            answer = c.set_role(worker, "mixed", "test: cap", prefill_cap=4)
            capped.extend(generate(worker, PROMPTS[-1]))
            return answer

        capped: list[int] = []
        answer = running_across(cap_then_prompt, stream_long, worker,
                                lambda: long_reference)
        assert (answer.previous_role, answer.role, answer.drained_s,
                answer.prefill_tokens_while_decoding) == ("mixed", "mixed", 0, 4)
        assert capped == hf_greedy(tiny_checkpoints["llama"], [PROMPTS[-1]], MAX_TOKENS)[0]
        log = (Path(c.config.log_dir) / "prefill-1.log").read_text()
        assert "prompt tokens per step while decoding: no cap -> 4 (reason: test: cap)" in log
        assert c.prefill_caps["prefill-1"] == 4  # what a restart would start it with

        # mixed -> prefill with a long request decoding here: a mixed worker has no KV
        # channel end to drain, so the change does not wait for it, and it ends in the
        # new role with HF's tokens.
        mark = len(load.results)
        answer = running_across(
            lambda: c.set_role(names.index("prefill-1"), "prefill", "test: back",  # by index
                               prefill_cap=0),
            stream_long, worker, lambda: long_reference)
        assert (answer.previous_role, answer.role, answer.drained_s,
                answer.prefill_tokens_while_decoding) == ("mixed", "prefill", 0, 0)
        load.wait_routed("worker", worker, mark)
        assert c.set_role("prefill-1", "prefill").drained_s == 0.0  # already: no-op

        # A drain that cannot finish in time (shorter than the grace) keeps the role.
        other = c.worker_addresses[names.index("prefill-0")]
        with pytest.raises(grpc.RpcError) as e:
            c.set_role("prefill-0", "decode", drain_timeout_s=0.3)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "still prefill" in e.value.details()
        assert load_of(other).role == "prefill"
        load.wait_routed("worker", other, len(load.results))  # registered and chosen again
    finally:
        load.finish()

    errors = [r for _, r in load.results if isinstance(r, Exception)]
    assert not errors, errors[:3]
    reference = hf_greedy(tiny_checkpoints["llama"], PROMPTS, MAX_TOKENS)
    wrong = [p for p, r in load.results if r.token_ids != reference[p]]  # type: ignore[attr-defined]
    assert not wrong, f"{len(wrong)} of {len(load.results)} requests differ from HF"
    assert len(load.results) >= 30
    assert_cluster_idle(c)

    # Same process, same engine: its counters went on and its prefix cache survived.
    assert proc.poll() is None
    after = load_of(worker)
    assert after.role == "prefill" and after.prompt_tokens > before.prompt_tokens
    assert probe(worker) >= 36  # PROBE's blocks, computed before the first change
    text = urllib.request.urlopen(c.metrics_urls["prefill-1"], timeout=5).read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    changes = {(s.labels["from_role"], s.labels["to_role"]): s.value for s in samples
               if s.name == "pdserve:worker_role_changes_total"}
    assert changes == {("prefill", "decode"): 1, ("decode", "mixed"): 1, ("mixed", "prefill"): 1}
    # gauges carry the role it has now, and only that one
    assert {s.labels["role"] for s in samples if s.name == "pdserve:kv_blocks_total"} == {
        "prefill"}
