"""Two engines, one KV channel: prefill engine -> real gloo transfer -> decode engine.

In one process (the channel's threads are real; its cross-process behaviour has its own
tests), so these check the engine hooks exactly: reserve, prefill-only export, commit,
recompute after a failed transfer, prefix hits on either side, and no leaked block.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from conftest import assert_no_leaks, hf_greedy, kv_test_config
from tiny_models import ARCHS

from common.sampling import StructuredOutput
from workers.engine.llm_engine import LLMEngine, RequestOutput
from workers.engine.params import EngineConfig, SamplingParams
from workers.transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    PagedCacheDestination,
    TransferState,
)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
CFG = kv_test_config()


def engine(path, **kw) -> LLMEngine:  # noqa: ANN001
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", num_blocks=96,
                                  block_size=4, max_num_batched_tokens=23, **kw))


def run_until_done(eng: LLMEngine, rid: str) -> RequestOutput:
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out


def disaggregated(p: LLMEngine, d: LLMEngine, channel, rid: str, ids: list[int],  # noqa: ANN001
                  params: SamplingParams = GREEDY, drop: bool = False,
                  prompt_logprobs: int | None = None, early: list | None = None,
                  ) -> tuple[RequestOutput, RequestOutput, TransferState]:
    """One request across the split; with ``early`` (a list the offers go to) the KV is
    offered while the step that computes it runs, as a prefill worker does."""
    sender, receiver = channel
    kv = d.reserve_request(rid, ids, params, prompt_logprobs=prompt_logprobs)
    assert kv is not None
    bs, skip, dst = kv.block_size, kv.skip_blocks, list(kv.target_block_ids)
    cache = d.kv_view().cache
    handle = receiver.expect(rid, KVLayout.of_cache(cache, bs), dst,
                             PagedCacheDestination(cache, dst, bs))
    sent = []
    releases = []

    def announce(table: list[int]):  # noqa: ANN202
        assert early is not None
        offer = sender.offer_paged(receiver.address, rid, p.kv_view().cache, table[skip:],
                                   dst, bs)
        told: list[int] = []
        early.append((p.num_steps, table, offer, told))

        def layers_done(k: int) -> None:
            told.append(k)
            offer.layers_done(k)

        return layers_done

    def export(table: list[int], release) -> None:  # noqa: ANN001
        releases.append(release)
        if drop:  # the KV never leaves: the reservation must not be decoded
            handle.cancel("test drops the transfer")
            return
        if early:
            step, offered, offer, _ = early[-1]
            assert (step, offered) == (p.num_steps, table)  # the same step, the same blocks
            assert offer.go()
            sent.append(offer.handle)
            return
        sent.append(sender.send_paged(receiver.address, rid, p.kv_view().cache, table[skip:],
                                      dst, bs))

    p.add_request(rid, ids, params, on_prefilled=export, prompt_logprobs=prompt_logprobs,
                  on_prefilling=announce if early is not None else None)
    first = run_until_done(p, rid)
    assert first.finish_reason == "remote" and len(first.token_ids) == 1
    result = handle.wait(30)
    if result.ok:
        d.commit_request(rid, first.token_ids[0])
    else:
        d.recompute_request(rid, first.token_ids[0])
    for s in sent:
        assert s.wait(30).ok
    assert p.scheduler.held or drop  # the prefill side holds the blocks until released
    for release in releases:
        release()
        release()  # idempotent
    return first, run_until_done(d, rid), result.state


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_transfer_decode_equals_hf(arch: str, tiny_checkpoints, channel) -> None:
    path = tiny_checkpoints[arch]
    p, d = engine(path), engine(path)
    tok = p.tokenizer
    texts = ["Hi", "The quick brown fox jumps over the lazy dog because", "A " * 30 + "story"]
    prompts = [tok(t).input_ids for t in texts] + [[5]]
    outs = [disaggregated(p, d, channel, f"{arch}-{i}", ids) for i, ids in enumerate(prompts)]
    assert [o.token_ids for _, o, _ in outs] == hf_greedy(path, prompts, 12)
    assert all(state is TransferState.DONE for *_, state in outs)
    # Text streamed as the prefill's first delta plus the decode's deltas is the whole text.
    assert all(o.finish_reason == "length" for _, o, _ in outs)
    assert_no_leaks(p)
    assert_no_leaks(d)


@pytest.mark.parametrize("drop", [False, True])
def test_penalties_and_min_tokens_agree_across_the_split(tiny_checkpoints, channel,
                                                         drop: bool) -> None:
    """The first token (prefill side) and the rest (decode side, after a transfer or a
    recompute) are penalized from the same history: the tokens of one local run."""
    path = tiny_checkpoints["llama"]
    p, d, local = engine(path), engine(path), engine(path)
    eos = min(local.eos_token_ids)
    params = SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.5,
                            frequency_penalty=1.0, presence_penalty=0.5,
                            logit_bias={eos: 100.0}, min_tokens=6)
    ids = p.tokenizer("The quick brown fox jumps over the lazy dog").input_ids
    local.add_request("local", ids, params)
    want = run_until_done(local, "local")
    assert len(want.token_ids) == 7 and want.token_ids[-1] == eos
    first, out, _ = disaggregated(p, d, channel, f"pen-{drop}", ids, params, drop=drop)
    assert first.token_ids + out.token_ids[1:] == out.token_ids == want.token_ids
    assert out.finish_reason == want.finish_reason == "stop"
    for eng in (p, d, local):
        assert_no_leaks(eng)


def test_prefix_hits_on_either_side_and_failed_transfer_recomputes(tiny_checkpoints,
                                                                    channel) -> None:
    path = tiny_checkpoints["qwen3"]
    p, d = engine(path), engine(path)
    shared = p.tokenizer("A long shared system prompt that many requests start with.").input_ids
    a, b, c = shared + [11, 12, 13], shared + [21, 22], shared + [31, 32, 33, 34]
    _, out_a, _ = disaggregated(p, d, channel, "a", a)  # both cold
    kv = d.reserve_request("probe", b, GREEDY)  # the decode side now holds the prefix
    assert kv is not None and kv.cached_tokens == (len(shared) // 4) * 4
    d.abort_request("probe")
    first_b, out_b, _ = disaggregated(p, d, channel, "b", b)  # hits on both sides
    assert first_b.num_cached_tokens == (len(shared) // 4) * 4
    p2 = engine(path)  # a fresh prefill worker: hit on the decode side only
    _, out_c, _ = disaggregated(p2, d, channel, "c", c)
    _, out_x, state = disaggregated(p, d, channel, "x", shared + [41], drop=True)
    assert state is TransferState.CANCELLED
    assert [out_a.token_ids, out_b.token_ids, out_c.token_ids, out_x.token_ids] == hf_greedy(
        path, [a, b, c, shared + [41]], 12)
    for e in (p, p2, d):
        assert_no_leaks(e)
    assert receiver_idle(channel)


def receiver_idle(channel) -> bool:  # noqa: ANN001
    return channel[1].live_transfers() == 0


def test_early_offer_is_made_in_the_last_chunks_step_and_lands(tiny_checkpoints,
                                                              channel) -> None:
    """``on_prefilling`` runs once per request, before the forward of the step whose
    chunk ends the prompt (chunked prompts: not before), with the blocks ``on_prefilled``
    then gets; the forward tells what it returned of each layer done; the KV offered
    then lands (layer by layer), and greedy output equals HF's. A request whose
    first token ends it offered too: voided, it fails the reservation and leaks nothing."""
    path = tiny_checkpoints["llama"]
    p, d = engine(path), engine(path)
    counted = p.step
    p.num_steps = 0

    def step() -> list[RequestOutput]:
        p.num_steps += 1
        return counted()

    p.step = step
    tok = p.tokenizer
    prompts = [tok("A " * 30 + "story").input_ids, tok("Hi").input_ids]
    assert len(prompts[0]) > 2 * 23  # three chunks at max_num_batched_tokens=23
    outs, offers = [], []
    for i, ids in enumerate(prompts):
        early: list = []
        outs.append(disaggregated(p, d, channel, f"early-{i}", ids, early=early))
        assert len(early) == 1 and early[0][2].handle.result().ok
        layers = p.kv_view().cache.shape[0]  # told after each layer, in its one step
        assert early[0][3] == list(range(1, layers + 1))
        offers += early
    assert [o.token_ids for _, o, _ in outs] == hf_greedy(path, prompts, 12)
    sender, receiver = channel
    ids = prompts[1]
    kv = d.reserve_request("ends", ids, GREEDY)
    cache = d.kv_view().cache
    dst = list(kv.target_block_ids)
    handle = receiver.expect("ends", KVLayout.of_cache(cache, kv.block_size), dst,
                             PagedCacheDestination(cache, dst, kv.block_size))
    made = []
    p.add_request("ends", ids, SamplingParams(max_tokens=1, temperature=0.0),
                  on_prefilled=lambda table, release: pytest.fail("nothing to export"),
                  on_prefilling=lambda table: made.append(sender.offer_paged(
                      receiver.address, "ends", p.kv_view().cache, table[kv.skip_blocks:],
                      dst, kv.block_size)))
    assert run_until_done(p, "ends").finish_reason == "length" and len(made) == 1
    deadline = time.monotonic() + 30
    while handle.state is not TransferState.RECEIVING:  # accepted (a void before the
        assert time.monotonic() < deadline  # offer went out would offer nothing at all)
        time.sleep(0.01)
    assert made[0].void()  # what the server does once the request ended undecided
    assert handle.wait(30).state is TransferState.CANCELLED
    assert "withdrew" in handle.result().reason
    assert made[0].handle.wait(30).state is TransferState.CANCELLED
    d.abort_request("ends")
    for e in (p, d):
        assert_no_leaks(e)
    assert receiver_idle(channel)


def test_first_token_that_ends_the_request_sends_nothing(tiny_checkpoints, channel) -> None:
    path = tiny_checkpoints["llama"]
    p = engine(path)
    called = []
    p.add_request("one", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0.0),
                  on_prefilled=lambda table, release: called.append(table))
    out = run_until_done(p, "one")
    assert out.finish_reason == "length" and not called
    assert_no_leaks(p)


def test_seeded_sampling_continues_the_same_random_stream(tiny_checkpoints, channel) -> None:
    path = tiny_checkpoints["mistral"]
    p, d, local = engine(path), engine(path), engine(path)
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=1234, ignore_eos=True)
    ids = local.tokenizer("Once upon a time in a small town").input_ids
    local.add_request("s", ids, params)
    want = run_until_done(local, "s").token_ids
    _, got, _ = disaggregated(p, d, channel, "s", ids, params)
    assert got.token_ids == want
    for e in (p, d, local):
        assert_no_leaks(e)


@pytest.mark.parametrize("drop", [False, True])
def test_structured_output_agrees_across_the_split(tiny_checkpoints, channel,
                                                   drop: bool) -> None:
    """The prefill side samples the first token under the grammar; the decode side
    re-derives the grammar's state from it (after a transfer or a recompute): the output
    is a local run's, and it follows the schema."""
    path = tiny_checkpoints["llama"]
    p, d, local = engine(path), engine(path), engine(path)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "tag": {"enum": ["red", "green"]}},
              "required": ["ok", "tag"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutput(
        "json_schema", json.dumps(schema)))
    ids = p.tokenizer("The quick brown fox jumps over the lazy dog").input_ids
    local.add_request("local", ids, params)
    want = run_until_done(local, "local")
    assert want.finish_reason == "stop" and want.error is None
    assert json.loads(want.text)["tag"] in ("red", "green")
    first, out, _ = disaggregated(p, d, channel, f"json-{drop}", ids, params, drop=drop)
    assert first.token_ids + out.token_ids[1:] == out.token_ids == want.token_ids
    assert out.finish_reason == "stop" and out.text == want.text
    for eng in (p, d, local):
        assert_no_leaks(eng)


def test_flipped_kv_byte_would_change_the_tokens_and_is_recomputed_instead(
        tiny_checkpoints, channel, monkeypatch) -> None:
    """The byte the fault hook flips (after the sender's checksum) matters: committed
    anyway, it changes the decoded tokens; checked, the transfer fails, the decode side
    recomputes, and the output is HF's."""
    path = tiny_checkpoints["llama"]
    _, receiver = channel
    flipping = KVSender("prefill-flip", replace(CFG, fault_flip_kv_byte="flip"))
    try:
        ids = engine(path).tokenizer("A " * 30 + "story about a flipped byte").input_ids
        [want] = hf_greedy(path, [ids], GREEDY.max_tokens)
        before = receiver.stats().checksum_failures
        p, d = engine(path), engine(path)
        _, out, state = disaggregated(p, d, (flipping, receiver), "flip-checked", ids)
        assert state is TransferState.FAILED and out.token_ids == want
        assert receiver.stats().checksum_failures == before + 1
        for e in (p, d):
            assert_no_leaks(e)
        # the control: without the check the same fault reaches the tokens
        monkeypatch.setattr(KVReceiver, "_checksum_failed",
                            lambda self, pair, header, handle, landed, expected:
                            handle.advance(TransferState.DONE))
        p, d = engine(path), engine(path)
        _, out, state = disaggregated(p, d, (flipping, receiver), "flip-unchecked", ids)
        assert state is TransferState.DONE and out.token_ids != want
        for e in (p, d):
            assert_no_leaks(e)
    finally:
        flipping.close()
    assert receiver_idle(channel)


def run_choices(eng: LLMEngine, rid: str) -> dict[int, RequestOutput]:
    """Step until every choice of ``rid`` has ended: choice index -> its last output."""
    final: dict[int, RequestOutput] = {}
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final[out.index] = out
                if out.done:
                    return final


@pytest.mark.parametrize("drop", [False, True])
def test_choices_prefill_once_transfer_once_and_share_the_prompt(tiny_checkpoints, channel,
                                                                 drop: bool) -> None:
    """n = 3, seeded at temperature 1: the prefill engine computes the prompt once and
    samples three first tokens, the channel moves its KV once, the decode engine's three
    choices share the full prompt blocks (a copy of the partial one each) and end
    exactly as the same request run in one engine; a dropped transfer recomputes."""
    path = tiny_checkpoints["llama"]
    p, d, local = engine(path), engine(path), engine(path)
    sender, receiver = channel
    ids = list(range(5, 19))  # 14 tokens: 3 full blocks of 4 and a partial one
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    local.add_request("l", ids, params, n=3)
    expected = run_choices(local, "l")
    rid = f"choices-{drop}"
    kv = d.reserve_request(rid, ids, params, n=3)
    assert kv is not None and len(kv.target_block_ids) == 4
    cache = d.kv_view().cache
    handle = receiver.expect(rid, KVLayout.of_cache(cache, 4), list(kv.target_block_ids),
                             PagedCacheDestination(cache, list(kv.target_block_ids), 4))
    sent, releases, prefilled = [], [], []

    def export(table: list[int], release) -> None:  # noqa: ANN001
        releases.append(release)
        if drop:
            handle.cancel("test drops the transfer")
            return
        sent.append(sender.send_paged(receiver.address, rid, p.kv_view().cache, table,
                                      list(kv.target_block_ids), 4))

    p.add_request(rid, ids, params, on_prefilled=export, n=3)
    p_steps = 0
    while len(prefilled) < 3:
        outs = p.step()
        p_steps += 1
        prefilled += [o for o in outs if o.finished]
    assert p_steps == 1  # 14 tokens within one step's budget of 23: one forward
    assert sorted(o.index for o in prefilled) == [0, 1, 2]
    assert all(o.finish_reason == "remote" and len(o.token_ids) == 1 for o in prefilled)
    firsts = [o.token_ids[0] for o in sorted(prefilled, key=lambda o: o.index)]
    assert firsts == [expected[i].token_ids[0] for i in range(3)]
    assert len(sent) == (0 if drop else 1) and len(releases) == 1  # one export, one send
    result = handle.wait(30)
    if result.ok:
        d.commit_request(rid, firsts[0], firsts[1:])
        tables = [d.scheduler.get(f"{rid}/{i}" if i else rid).block_table for i in range(3)]
        assert tables[0][:3] == tables[1][:3] == tables[2][:3]  # the full blocks: shared
        assert all(d.scheduler.block_manager.blocks[b].ref_count == 3 for b in tables[0][:3])
        assert len({t[3] for t in tables}) == 3  # the partial block: one copy per choice
    else:
        d.recompute_request(rid, firsts[0], firsts[1:])
    for s in sent:
        assert s.wait(30).ok
    for release in releases:
        release()
    got = run_choices(d, rid)
    assert {i: o.token_ids for i, o in got.items()} == {
        i: o.token_ids for i, o in expected.items()}
    assert len({tuple(o.token_ids) for o in got.values()}) > 1  # the seeds differ
    assert result.ok is not drop
    for eng in (p, d, local):
        assert_no_leaks(eng)


def _hf_prompt_logprobs(path, ids: list[int], top: int) -> list[tuple[float, list[int]]]:  # noqa: ANN001
    """HF's log-probability of each prompt token after the first, and its top ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [(float(lp[i, ids[i + 1]]), lp[i].topk(top).indices.tolist())
            for i in range(len(ids) - 1)]


def test_prompt_logprobs_equal_hf_chunked_cached_and_across_the_split(tiny_checkpoints,
                                                                     channel) -> None:
    """Prompt log-probabilities (with 3 alternatives) equal HF's for a prompt computed in
    two chunks, again when its blocks are cached (no cached prefix is reused for them),
    and from the prefill engine of a split, with the first token; no block leaks."""
    path = tiny_checkpoints["llama"]
    ids = list(range(7, 47))  # 40 tokens: two chunks of the 23-token step budget
    ref = _hf_prompt_logprobs(path, ids, 3)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

    def check(entries) -> None:  # noqa: ANN001
        assert entries is not None and len(entries) == len(ids) - 1
        for i, (e, (lp, top)) in enumerate(zip(entries, ref, strict=True)):
            assert e.token_id == ids[i + 1] and abs(e.logprob - lp) < 1e-3, i
            assert [t for t, _ in e.top] == top

    eng = engine(path)
    for rid in ("plp-1", "plp-2"):  # the second finds the prompt's blocks cached
        eng.add_request(rid, ids, params, prompt_logprobs=3)
        firsts = []
        while True:
            outs = [o for o in eng.step() if o.request_id == rid]
            firsts += [o for o in outs if o.prompt_logprobs is not None]
            if any(o.finished for o in outs):
                break
        assert len(firsts) == 1 and firsts[0].new_token_ids  # with the first token only
        check(firsts[0].prompt_logprobs)
    p, d = engine(path), engine(path)
    first, _, state = disaggregated(p, d, channel, "plp-split", ids, params,
                                    prompt_logprobs=3)
    assert state is TransferState.DONE
    check(first.prompt_logprobs)
    for e in (eng, p, d):
        assert_no_leaks(e)
