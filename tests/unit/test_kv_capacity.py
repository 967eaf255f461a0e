"""``pdserve bench-kv``'s pure parts (``benchmarks/kv_capacity.py``): the capacity
arithmetic against the engine's own sizing, the measured-concurrency rule, ratios,
transfer deltas and the report's table. No model, no processes."""

from __future__ import annotations

import pytest

from benchmarks.kv_capacity import (
    BenchKVOptions,
    BenchKVReport,
    KVResult,
    block_bytes,
    blocks_for_budget,
    blocks_per_sequence,
    compute_ratios,
    concurrent_without_preemption,
    expected_concurrent,
    fmt_ratio,
    isolated,
    markdown,
    netns_argv,
    ratio,
    transfer_per_request,
)
from workers.models.kv_format import KVFormat

# SmolLM2-135M: 30 layers, 3 KV heads of 64 dims.
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def _block(name: str, dtype: str = "bfloat16") -> int:
    import torch

    row = KVFormat(name, HEAD_DIM, getattr(torch, dtype)).row_bytes
    return block_bytes(LAYERS, 16, KV_HEADS, row)


def test_block_bytes_follow_the_row_formats() -> None:
    assert _block("auto") == 30 * 2 * 16 * 3 * 128 == 368_640
    assert _block("auto", "float32") == 2 * _block("auto")
    assert _block("fp8_e4m3") == _block("fp8_e5m2") == 30 * 2 * 16 * 3 * 65  # + scale byte
    assert _block("nvfp4") == 30 * 2 * 16 * 3 * (32 + 4)  # packed E2M1 + E4M3 per 16


def test_capacity_at_a_quarter_gib() -> None:
    blocks = {n: blocks_for_budget(0.25, _block(n)) for n in ("auto", "fp8_e4m3", "nvfp4")}
    assert blocks == {"auto": 728, "fp8_e4m3": 1433, "nvfp4": 2589}
    seqs = {n: expected_concurrent(b, 16, 512) for n, b in blocks.items()}
    assert seqs == {"auto": 22, "fp8_e4m3": 44, "nvfp4": 80}
    assert seqs["nvfp4"] / seqs["auto"] == pytest.approx(3.64, abs=0.01)


def test_blocks_per_sequence_leaves_out_the_last_sampled_token() -> None:
    assert blocks_per_sequence(512, 16) == 32
    assert blocks_per_sequence(513, 16) == 32  # the 513th token's K/V is never written
    assert blocks_per_sequence(514, 16) == 33
    assert blocks_per_sequence(2, 16) == 1
    assert expected_concurrent(63, 16, 512) == 1
    assert expected_concurrent(64, 16, 512) == 2


def test_concurrency_counts_only_never_preempted_sequences_that_finished() -> None:
    steps = [["a", "b", "c", "d"], ["a", "b", "c"], ["a", "b", "c", "x"], ["b", "c"]]
    # d was preempted (the newest), x never finished: 3 ran together to their end
    assert concurrent_without_preemption(steps, {"d"}, {"a", "b", "c", "d"}) == 3
    assert concurrent_without_preemption(steps, {"d", "a"}, {"a", "b", "c", "d"}) == 2
    assert concurrent_without_preemption(steps, set(), {"a", "b", "c", "d", "x"}) == 4
    assert concurrent_without_preemption([], set(), set()) == 0


def test_ratios_are_against_auto() -> None:
    rows = [KVResult("auto", concurrent=22, token_slots=11648, decode_tokens_per_s=400.0,
                     transfer_bytes_per_request=11_796_480.0, transfer_ms_per_request=8.0),
            KVResult("nvfp4", concurrent=80, token_slots=41424, decode_tokens_per_s=300.0,
                     transfer_bytes_per_request=3_317_760.0, transfer_ms_per_request=4.0),
            KVResult("fp8_e4m3")]
    compute_ratios(rows)
    assert rows[0].ratios["concurrent"] == 1.0
    assert rows[1].ratios["concurrent"] == pytest.approx(80 / 22)
    assert rows[1].ratios["decode_tokens_per_s"] == pytest.approx(0.75)
    assert rows[1].ratios["transfer_bytes"] == pytest.approx(36 / 128)
    assert rows[1].ratios["transfer_time"] == pytest.approx(0.5)
    assert rows[2].ratios["concurrent"] == 0.0
    assert ratio(3.0, 0.0) is None
    assert fmt_ratio(None) == "-" and fmt_ratio(80 / 22) == "3.64x"


def test_transfer_per_request_uses_deltas_of_done_transfers() -> None:
    # prefill (bytes, busy_s, done); decode (bytes_moved, done); one warm-up before
    per_bytes, per_ms, done = transfer_per_request((100, 0.5, 1), (900, 0.9, 5),
                                                   (100, 1), (900, 5))
    assert (per_bytes, done) == (200.0, 4)
    assert per_ms == pytest.approx(100.0)
    assert transfer_per_request((0, 0.0, 0), (0, 0.0, 0), (0, 0), (0, 0)) == (0.0, 0.0, 0)


def test_markdown_table_has_a_row_per_dtype_and_the_ratios() -> None:
    o = BenchKVOptions(model="/m/SmolLM2", kv_dtypes=("auto", "nvfp4"))
    from dataclasses import asdict

    report = BenchKVReport("/m/SmolLM2", "bfloat16", "cpu", asdict(o), "private")
    report.results = [
        KVResult("auto", row_bytes=128, block_bytes=368_640, num_blocks=728, concurrent=22,
                 concurrent_expected=22, decode_ms_per_step=80.0, decode_tokens_per_s=400.0,
                 transfer_bytes_per_request=11_796_480.0, transfer_ms_per_request=8.0),
        KVResult("nvfp4", row_bytes=36, block_bytes=103_680, num_blocks=2589, concurrent=80,
                 concurrent_expected=80, decode_ms_per_step=64.0, decode_tokens_per_s=500.0,
                 decode_cpu_ms_per_step=120.0,
                 transfer_bytes_per_request=3_317_760.0, transfer_ms_per_request=4.0)]
    compute_ratios(report.results)
    md = markdown(report, "hdr")
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 4
    assert table[2].startswith("| auto (bfloat16) | 128 | 368,640 | 728 | 22 (22) | 1.00x |")
    assert "| nvfp4 | 36 | 103,680 | 2,589 | 80 (80) | 3.64x | 64.0 | 120.0 | 500.0 | 1.25x | " \
           "3.32 MB | 0.28x | 4.0 | 0.50x |" == table[3]
    partial = BenchKVReport("/m", "float32", "cpu", asdict(BenchKVOptions(
        model="/m", parts=("capacity",))), "none", report.results)
    assert "decode" not in markdown(partial, "h").split("\n\n")[3]


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="start with auto"):
        BenchKVOptions(model="m", kv_dtypes=("nvfp4",))
    with pytest.raises(ValueError, match="unknown KV cache dtypes"):
        BenchKVOptions(model="m", kv_dtypes=("auto", "int4"))
    with pytest.raises(ValueError, match="output_tokens"):
        BenchKVOptions(model="m", seq_tokens=64, output_tokens=64)
    with pytest.raises(ValueError, match="parts"):
        BenchKVOptions(model="m", parts=("speed",))
    assert BenchKVOptions(model="m").prompt_tokens == 448


def test_network_namespace_decision() -> None:
    assert isolated(["lo"])
    assert not isolated(["eth0", "lo"])
    assert netns_argv("/py", ["bench-kv", "--requests", "2"]) == [
        "unshare", "-n", "/py", "-m", "cluster.cli", "bench-kv", "--requests", "2"]
