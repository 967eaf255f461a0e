"""``pdserve profile``: real engine steps and real KV transfers on a tiny model, fitted
and saved as a profile the planner can load; bad input is refused before any work.

The 5% held-out target of the default model is not asserted here (a shared, noisy CI
box times steps of a few milliseconds): only a loose sanity bound on the fit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.profile import ProfileOptions, cores, report, run_profile
from benchmarks.profile_steps import StepGrid
from cluster.cli import EXIT_INVALID, main
from common.cost_model import load_profile
from workers.engine.params import default_block_size

GRID = StepGrid(prefill_new=(16, 64, 128, 256, 384), prefill_cached=(0, 128),
                decode_batches=(1, 4, 16, 32), decode_contexts=(32, 256),
                mixed=((4, 64, 64), (8, 128, 256)), reps=3, decode_steps=2)
"""20 shapes within the tiny models' 512-token context: 4 of them are held out."""


def test_profile_measures_fits_and_saves_a_loadable_profile(
        tiny_checkpoints, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    opts = ProfileOptions(model=str(tiny_checkpoints["llama"]), dtype="float32", threads=(1,),
                          kv_cache_gb=0.01, grid=GRID, transfer_max_bytes=8 * 2**20,
                          transfer_reps=2, out=str(out))

    profile, results = run_profile(opts)

    loaded = load_profile(out)
    assert loaded == profile
    assert loaded.model == "llama" and loaded.dtype == "float32"
    assert loaded.machine["cpu"] and loaded.machine["cores"] >= 1 and loaded.machine["torch"]
    assert loaded.kv_bytes_per_token > 0 and loaded.block_size == default_block_size("cpu")
    assert loaded.num_blocks == int(0.01 * 2**30) // (loaded.block_size
                                                     * loaded.kv_bytes_per_token)
    assert 0 < loaded.max_model_len <= 512
    assert (loaded.max_num_batched_tokens, loaded.max_num_seqs) == (2048, 256)

    step = loaded.step(1)
    assert len(loaded.points["steps"]["1"]) == len(results[0].points) == 20
    assert {s.split()[0] for s in loaded.points["shapes"]["1"]} == {"prefill", "decode",
                                                                  "mixed"}
    for prefill in ([(16, 0)], [(384, 0)], [(256, 128)]):
        assert step.seconds(prefill) > 0
    assert step.prefill_seconds(16) < step.prefill_seconds(384)
    assert step.decode_seconds(1, 32) < step.decode_seconds(32, 256)
    e = step.error
    assert e is not None and e.held_out == 4
    assert all(math.isfinite(x) for x in (e.mean_pct, e.p90_pct, e.max_pct))
    # Its size is not held to here: 4 held-out shapes of a tiny model on a shared box
    # measured 76% off once (a CI run); `pdserve profile` prints it on the real model.

    tr = loaded.transfer
    sizes = [b for b, _ in loaded.points["transfer"]]
    assert len(sizes) >= 10 and sizes == sorted(sizes) and sizes[-1] <= 8 * 2**20
    assert tr.latency_s >= 0 and tr.bytes_per_s > 0
    assert 0 < tr.seconds(sizes[0]) < tr.seconds(sizes[-1])
    assert tr.error is not None and tr.error.held_out >= 2

    table = report(profile, results, 1.0)
    assert "held out" in table and "KV transfer" in table and "decode 8@512" in table


def test_profile_refuses_bad_input_before_measuring(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", "--threads", f"1,{cores() + 1}", "--out", str(out)]) == EXIT_INVALID
    assert f"outside 1..{cores()}" in capsys.readouterr().err
    assert main(["profile", "--threads", "one", "--out", str(out)]) == EXIT_INVALID
    assert "--threads wants counts" in capsys.readouterr().err
    assert main(["profile", "--model", str(tmp_path / "nope"), "--threads", "1",
                 "--out", str(out)]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not out.exists()


def test_step_grid_is_capped_to_the_engine_limits() -> None:
    grid = StepGrid().capped(budget=512, max_num_seqs=8, max_model_len=600, block_size=16)
    room = grid.room(600)
    assert max(grid.prefill_new) == 512 and max(grid.decode_batches) == 8
    assert 1024 not in grid.prefill_cached and max(grid.decode_contexts) <= room
    assert all(n + c <= room for n, c in grid.prefill_shapes(600))
    assert all(b + n <= 512 for b, _, n in grid.mixed)
