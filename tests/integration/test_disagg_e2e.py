"""Disaggregated serving end to end: router -> decode reserve -> prefill -> KV over gloo
between real worker processes -> decode -> client, on real gRPC over loopback.

Greedy output must equal Hugging Face ``generate``; every test ends with the leak check
(no request running, waiting or reserved, every block free, no transfer in flight, on
every worker still alive). Fault tests kill real processes; every SmolLM2 test shares one
supervised cluster (each starting its own cost four model loads), the fault tests last,
counting what they check as differences from what the cluster had counted before them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request

import grpc
import pytest
from cluster_helpers import assert_cluster_idle, start
from conftest import hf_greedy
from transformers import AutoTokenizer

from protos.pdserve.v1 import worker_pb2, worker_pb2_grpc
from router.client import AsyncClient, Client

GREEDY = {"max_tokens": 8, "temperature": 0.0}
CONTEXT = 384  # the SmolLM2 cluster's max_model_len: prompts go up to it
TEXT = ("The history of the city begins with a small settlement on the river bank, where "
        "traders met every spring to exchange salt, wool and iron tools. Over the centuries "
        "the market grew into a town with stone walls, a cathedral and a university. ")


def prompt_of(tok, n: int, text: str = TEXT) -> list[int]:  # noqa: ANN001
    ids = tok(text * (1 + n // 40)).input_ids
    assert len(ids) >= n
    return ids[:n]


def worker_load(address: str) -> worker_pb2.WorkerLoad:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(), timeout=5)


def _answers(address: str) -> bool:
    try:
        return worker_load(address).role != ""
    except grpc.RpcError:
        return False


async def run_all(target: str, prompts: list[list[int]], **kw: object) -> list[object]:
    async with AsyncClient(target) as client:
        return await asyncio.gather(*(client.generate(p, **kw) for p in prompts),
                                    return_exceptions=True)


_HF: dict[tuple[str, tuple[int, ...]], tuple[int, list[int]]] = {}
"""(model, prompt) -> (max_tokens, HF's greedy tokens): greedy is a prefix of any longer
greedy run (and stops at EOS either way), so a reference is computed once per prompt."""


def hf_reference(path, prompts, max_tokens: int) -> list[list[int]]:  # noqa: ANN001
    todo = [p for p in prompts if _HF.get((str(path), tuple(p)), (0, []))[0] < max_tokens]
    for p, r in zip(todo, hf_greedy(path, todo, max_tokens, stop_at_eos=True) if todo else [],
                    strict=True):
        _HF[(str(path), tuple(p))] = (max_tokens, r)
    return [_HF[(str(path), tuple(p))][1][:max_tokens] for p in prompts]


def served_equals_hf(path, served, prompts, max_tokens: int) -> None:  # noqa: ANN001
    """Each completion equals HF's greedy tokens (HF stops at EOS; ours too, or at the
    context limit, so compare the served length)."""
    ref = hf_reference(path, prompts, max_tokens)
    for s, r, p in zip(served, ref, prompts, strict=True):
        assert s.token_ids == r[: len(s.token_ids)], f"prompt of {len(p)} tokens"
        assert len(s.token_ids) == len(r) or len(p) + len(s.token_ids) == CONTEXT


@pytest.fixture(scope="module")
def smol_disagg(smollm2_path, tmp_path_factory):
    """2 prefill + 2 decode workers on SmolLM2; every prompt goes remote (threshold 0).
    One cluster for every SmolLM2 test here, the fault tests last: supervised as ``pdserve
    up`` does, a transfer timeout short enough for a fault test to wait out, and the
    transfer of request "drop-me" dropped midway (no other request is touched)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_FAULT_DROP_TRANSFER", "drop-me")  # the workers inherit it
        c = start(smollm2_path, tmp_path_factory.mktemp("disagg-logs"), prefill=2, decode=2,
                  local_prefill_threshold=0, max_model_len=CONTEXT, kv_cache_gb=0.1,
                  transfer_timeout_s=10.0)
    c.supervise()
    yield c
    c.stop()


def fresh(tag: str) -> str:
    """TEXT behind a first word of its own: no block of its prompts is cached from
    another test's, so a fault test's prompts are prefilled and moved in full as on a
    fresh cluster."""
    return f"{tag}: {TEXT}"


def test_32_concurrent_requests_from_1_token_to_the_context_limit_equal_hf(
        smol_disagg, smollm2_path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    lengths = [1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 64, 65, 80, 100, 127, 128, 129, 150,
               175, 200, 222, 255, 256, 257, 280, 300, 320, 340, 360, 375, 380, CONTEXT - 1]
    assert len(lengths) == 32
    prompts = [prompt_of(tok, n) for n in lengths]
    served = asyncio.run(run_all(smol_disagg.target, prompts, **GREEDY))
    errors = [s for s in served if isinstance(s, BaseException)]
    assert not errors, errors[:3]
    served_equals_hf(smollm2_path, served, prompts, GREEDY["max_tokens"])
    with Client(smol_disagg.target) as client:
        status = client.status()
    prefill = [w for w in status.workers if w.role == "prefill"]
    decode = [w for w in status.workers if w.role == "decode"]
    assert sum(w.transfers.entered["done"] for w in prefill) >= 31  # 1 token: maybe ends
    assert all(w.transfers.entered["failed"] == 0 for w in prefill + decode)
    assert all(w.transfers.entered["done"] > 0 for w in decode)  # both decode workers used
    assert_cluster_idle(smol_disagg)


def test_shared_prefix_is_reused_and_streamed_text_is_whole(smol_disagg, smollm2_path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    shared = tok(" ".join(reversed(TEXT.split())) * 6).input_ids[:200]  # unseen so far
    prompts = [shared + tok(f" Question {i}: what happened next?").input_ids for i in range(3)]
    with Client(smol_disagg.target) as client:
        served = [client.generate(p, **GREEDY) for p in prompts]  # one at a time
        pieces = [m.text for m in client.stream(prompts[0], **GREEDY)]
    served_equals_hf(smollm2_path, served, prompts, GREEDY["max_tokens"])
    assert served[0].usage["cached_tokens"] == 0
    assert all(s.usage["cached_tokens"] >= 192 for s in served[1:])  # 3 default blocks
    assert "".join(pieces) == served[0].text
    assert_cluster_idle(smol_disagg)


def _role_totals(cluster, role: str) -> tuple[int, int, int, int]:  # noqa: ANN001
    """(transfers done, bytes moved, prompt tokens computed or reused, KV blocks held)
    over every ``role`` worker, as the router's status reports them."""
    with Client(cluster.target) as client:
        ws = [w for w in client.status().workers if w.role == role]
    return (sum(w.transfers.entered["done"] for w in ws),
            sum(w.transfers.bytes_moved for w in ws), sum(w.prompt_tokens for w in ws),
            sum(w.total_blocks - w.free_blocks for w in ws))


def test_choices_prefill_once_move_kv_once_and_share_the_prompt_blocks(
        smol_disagg, smollm2_path) -> None:
    """n = 3 through the split: greedy choices equal HF's; seeded ones at temperature 1
    are reproducible and differ; the prefill pool computed the prompt once and the
    channel moved one prompt's KV once per request; while all three choices decode,
    the decode pool holds the prompt's blocks once (plus a block or two per choice)."""
    c = smol_disagg
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompt = prompt_of(tok, 200, fresh("Choices"))  # 12 full blocks of 16 and 8 tokens
    before = {r: _role_totals(c, r) for r in ("prefill", "decode")}
    with Client(c.target) as client:
        greedy = client.choices(prompt, 3, **GREEDY)
        served_equals_hf(smollm2_path, greedy, [prompt] * 3, GREEDY["max_tokens"])
        after = {r: _role_totals(c, r) for r in ("prefill", "decode")}
        assert after["prefill"][0] - before["prefill"][0] == 1  # one transfer
        assert after["decode"][0] - before["decode"][0] == 1
        assert after["prefill"][2] - before["prefill"][2] == len(prompt)  # computed once
        one_prompt = after["prefill"][1] - before["prefill"][1]
        seeded = {"max_tokens": 48, "temperature": 1.0, "seed": 3, "ignore_eos": True}
        held, counts = 0, [0, 0, 0]
        first: list[list[int]] = [[], [], []]
        for msg in client.stream(prompt, n=3, **seeded):
            first[msg.index].extend(msg.token_ids)
            counts[msg.index] += len(msg.token_ids)
            if not held and min(counts) >= 4:  # every choice is decoding now
                held = _role_totals(c, "decode")[3]
        mid = _role_totals(c, "prefill")
        again = client.choices(prompt, 3, **seeded)
        final = _role_totals(c, "prefill")
        scored = client.generate(prompt[:40], prompt_logprobs=2, **GREEDY)
    assert held and held <= 13 + 2 * 3, f"{held} blocks held for 3 choices of 13 blocks"
    # Prompt log-probabilities come from the prefill worker, once, one per token after
    # the first (their values are checked against HF's in test_disagg_engines).
    assert [e.token_id for e in scored.prompt_logprobs] == prompt[1:40]
    assert all(e.logprob <= 0 and len(e.top) == 2 for e in scored.prompt_logprobs)
    assert [a.token_ids for a in again] == first and len({tuple(f) for f in first}) == 3
    # Later requests move at most one prompt's KV each (less where the decode worker
    # they land on caches some of it), in one transfer each.
    assert 0 < final[1] - mid[1] <= one_prompt and 0 < mid[1] - after["prefill"][1] <= one_prompt
    assert final[0] - after["prefill"][0] == 2
    assert_cluster_idle(c)


def test_openai_fields_through_the_split(smol_disagg) -> None:
    """The openai SDK against the disaggregated cluster: n choices of a required tool
    call are each a valid call of a declared function, n choices under a JSON schema
    each validate, greedy n=3 gives one text three times, echo and prompt_logprobs
    come from the prefill worker; one transfer per request."""
    import jsonschema
    import openai
    from test_openai_tools import SCHEMAS, TOOLS

    c = smol_disagg
    client = openai.OpenAI(base_url=c.http_url + "/v1", api_key="unused", max_retries=0)
    model = "SmolLM2-135M-Instruct"
    before = _transfers(c, "prefill", "done")
    calls = client.chat.completions.create(
        model=model, n=2, temperature=0, max_tokens=60, tools=TOOLS, parallel_tool_calls=False,
        tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Oslo right now?"}])
    assert [ch.index for ch in calls.choices] == [0, 1]
    for ch in calls.choices:
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    people = client.chat.completions.create(
        model=model, n=2, temperature=1.0, seed=2, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
        messages=[{"role": "user", "content": "Invent a person."}])
    for ch in people.choices:
        jsonschema.validate(json.loads(ch.message.content), schema)
    greedy = client.completions.create(model=model, prompt=fresh("HTTP"), max_tokens=8,
                                       temperature=0, n=3, echo=True, logprobs=0,
                                       extra_body={"prompt_logprobs": 0})
    texts = {ch.text for ch in greedy.choices}
    assert len(texts) == 1 and texts.pop().startswith(fresh("HTTP"))
    first = greedy.choices[0]
    assert first.logprobs.token_logprobs[0] is None
    assert len(first.model_extra["prompt_logprobs"]) == greedy.usage.prompt_tokens
    assert _transfers(c, "prefill", "done") - before == 3  # one per request
    assert_cluster_idle(c)


def test_tiny_model_through_prefill_and_decode_equals_hf_and_short_prompts_stay_local(
        tiny_checkpoints, tmp_path) -> None:
    """Real processes on the tiny llama: prompts from 1 token up go concurrently through
    router -> decode reserve -> prefill -> KV -> decode and equal HF; a prompt whose
    uncached part is under the threshold is prefilled on the decode worker (no KV moves).
    Each architecture's prefill -> real gloo transfer -> decode is checked against HF in
    test_disagg_engines.py (test_prefill_transfer_decode_equals_hf); the process path
    here does not depend on the architecture."""
    path = tiny_checkpoints["llama"]
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(t).input_ids for t in ("Hi", "The quick brown fox jumps over the lazy dog",
                                          "def main():\n    return 42\n", "A " * 40)]
    prompts += [[5, 6, 7], list(range(5, 45))]
    remote = [len(p) >= 16 for p in prompts]  # no prompt shares a full block with another
    assert any(remote) and not all(remote)
    c = start(path, tmp_path, prefill=1, decode=1, local_prefill_threshold=16, block_size=4)
    try:
        served = asyncio.run(run_all(c.target, prompts, max_tokens=12, temperature=0.0,
                                     ignore_eos=True))
        errors = [s for s in served if isinstance(s, BaseException)]
        assert not errors, errors[:3]
        assert [s.token_ids for s in served] == hf_greedy(path, prompts, 12)
        with Client(c.target) as client:
            status = client.status()
        [prefill] = [w for w in status.workers if w.role == "prefill"]
        [decode] = [w for w in status.workers if w.role == "decode"]
        assert decode.transfers.entered["done"] == sum(remote)  # only long prompts moved KV
        assert prefill.transfers.entered["done"] == sum(remote)
        assert_cluster_idle(c)
    finally:
        c.stop(drain=True)
    # SIGTERM drains, then shuts down cleanly: channel threads and process groups end first.
    assert [p.returncode for p in c.procs] == [0] * len(c.procs), c.names


# --- faults ---------------------------------------------------------------------------

def _kill_when(cluster, name: str, watch: list[str], busy) -> None:  # noqa: ANN001
    """SIGKILL worker ``name`` as soon as ``busy(loads of the workers in watch)`` holds."""
    names = [n for n, _ in cluster.workers]
    watched = [cluster.worker_addresses[names.index(w)] for w in watch]
    proc = cluster.procs[cluster.names.index(name)]  # procs also hold redis and the router
    deadline = time.monotonic() + 60
    while not busy([worker_load(a) for a in watched]):
        assert time.monotonic() < deadline, f"{watch} never got busy"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _wait_back(cluster, name: str, restarts: int) -> str:  # noqa: ANN001
    """Supervision restarted ``name`` (``restarts`` times in all) on its address and it
    answers again; its address."""
    address = cluster.worker_addresses[[n for n, _ in cluster.workers].index(name)]
    deadline = time.monotonic() + 120
    while not (cluster.restarts(name) >= restarts and _answers(address)):
        assert time.monotonic() < deadline and cluster.gave_up is None, f"{name} is not back"
        time.sleep(0.5)
    return address


def _transfers(cluster, role: str, state: str) -> int:  # noqa: ANN001
    """Transfers of every ``role`` worker that entered ``state`` (counted since each
    worker process started)."""
    with Client(cluster.target) as client:
        workers = client.status().workers
    return sum(w.transfers.entered[state] for w in workers if w.role == role)


def _migrations(cluster, model: str) -> float:  # noqa: ANN001
    metrics = urllib.request.urlopen(cluster.metrics_urls["router"], timeout=5).read().decode()
    prefix = f'pdserve:request_migrations_total{{model="{model}"}} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines()
               if line.startswith(prefix))


def test_transfer_dropped_midway_is_recomputed_and_counted(smol_disagg, smollm2_path) -> None:
    c = smol_disagg
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [prompt_of(tok, n, fresh("Dropped")) for n in (250, 260)]
    before = {(r, s): _transfers(c, r, s) for r in ("prefill", "decode")
              for s in ("done", "failed", "timed_out")}
    with Client(c.target) as client:
        dropped = client.generate(prompts[0], request_id="drop-me", **GREEDY)
        fine = client.generate(prompts[1], request_id="fine", **GREEDY)
    served_equals_hf(smollm2_path, [dropped, fine], prompts, GREEDY["max_tokens"])
    after = {k: _transfers(c, *k) for k in before}
    moved = {k: after[k] - before[k] for k in before}
    assert moved["prefill", "failed"] == 1
    assert moved["prefill", "done"] == 1
    assert moved["decode", "failed"] + moved["decode", "timed_out"] == 1
    assert moved["decode", "done"] == 1
    assert_cluster_idle(c, timeout=30)


def test_decode_killed_mid_request_migrates_its_requests(smol_disagg, smollm2_path) -> None:
    """SIGKILL a decode worker while it holds reservations and decodes: its requests move
    to the other decode worker (prompt + tokens so far) and every one completes, equal
    to HF; the client sees one stream per request. The launcher supervises (as ``pdserve
    up`` does): the worker comes back on its address, serves again, and status lists
    each worker once, serving (no ghost row)."""
    c = smol_disagg
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [prompt_of(tok, 300 + i, fresh("Migrated")) for i in range(16)]
    restarts = {n: c.restarts(n) for n, _ in c.workers}
    migrations = _migrations(c, smollm2_path.name)

    async def scenario() -> list[object]:
        task = asyncio.ensure_future(run_all(c.target, prompts, max_tokens=24,
                                             temperature=0.0))
        await asyncio.to_thread(_kill_when, c, "decode-0", ["decode-0"],
                                lambda loads: loads[0].reserved_requests > 0
                                and loads[0].running_requests > 0)
        return await task

    served = asyncio.run(scenario())
    errors = [s for s in served if isinstance(s, BaseException)]
    assert not errors, errors[:3]
    served_equals_hf(smollm2_path, served, prompts, 24)
    moved = [s for s in served if s.routing["migrations"]]
    assert moved, "the kill hit no request"
    killed = c.worker_addresses[[n for n, _ in c.workers].index("decode-0")]
    assert all(s.routing["decode_worker"] != killed for s in moved)
    for s, p in zip(served, prompts, strict=True):  # usage covers the whole request
        assert s.usage["prompt_tokens"] == len(p)
        assert s.usage["completion_tokens"] == len(s.token_ids)
    assert _migrations(c, smollm2_path.name) == migrations + len(moved)
    # Restarted on its address; the router sends it requests again.
    _wait_back(c, "decode-0", restarts["decode-0"] + 1)
    again = asyncio.run(run_all(c.target, prompts[:6], max_tokens=8, temperature=0.0))
    served_equals_hf(smollm2_path, again, prompts[:6], 8)
    assert killed in {s.routing["decode_worker"] for s in again}
    with Client(c.target) as client:
        workers = client.status().workers
    assert sorted((w.address, w.serving) for w in workers) == sorted(
        (a, True) for a in c.worker_addresses)
    assert {n: c.restarts(n) for n in restarts} == {
        **restarts, "decode-0": restarts["decode-0"] + 1}  # only the one killed here
    assert_cluster_idle(c, timeout=30)


def test_prefill_killed_during_prefill_is_recomputed_on_decode(smol_disagg,
                                                               smollm2_path) -> None:
    """SIGKILL a prefill worker while requests wait on it: decode recomputes them, every
    one completes equal to HF; supervision brings the prefill worker back."""
    c = smol_disagg
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    prompts = [prompt_of(tok, 320 + i, fresh("Recomputed")) for i in range(8)]
    restarts = c.restarts("prefill-0")

    async def scenario() -> list[object]:
        task = asyncio.ensure_future(run_all(c.target, prompts, **GREEDY))
        # Every request holds a reservation while it is being prefilled.
        await asyncio.to_thread(_kill_when, c, "prefill-0", ["decode-0", "decode-1"],
                                lambda loads: sum(x.reserved_requests for x in loads) >= 6)
        return await task

    served = asyncio.run(scenario())
    errors = [s for s in served if isinstance(s, BaseException)]
    assert not errors, errors[:3]
    served_equals_hf(smollm2_path, served, prompts, GREEDY["max_tokens"])
    _wait_back(c, "prefill-0", restarts + 1)
    assert c.restarts("prefill-0") == restarts + 1
    assert_cluster_idle(c, timeout=30)
