"""The ``pdserve`` command line, as users and scripts call it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_offline_json(tiny_checkpoints) -> None:
    r = pdserve("generate", "--offline", "--model", str(tiny_checkpoints["llama"]),
                "--max-tokens", "5", "--ignore-eos", "--threads", "1", "--kv-cache-gb", "0.01",
                "--json", "Hello there")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "prompt_token_ids", "finish_reason", "usage",
                        "ttft_s", "e2e_s"}
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": len(out["prompt_token_ids"]),
                            "completion_tokens": 5, "cached_tokens": 0}
    assert 0 < out["ttft_s"] <= out["e2e_s"]


@pytest.mark.parametrize(("flag", "value", "field"), [("--max-tokens", "0", "max_tokens"),
                                                     ("--temperature", "-1", "temperature"),
                                                     ("--top-p", "2", "top_p")])
def test_generate_rejects_bad_parameters_clearly(tiny_checkpoints, flag, value, field) -> None:
    r = pdserve("generate", "--offline", "--model", str(tiny_checkpoints["llama"]), flag, value,
                "hi")
    assert r.returncode == 2 and f"invalid request: {field}:" in r.stderr


def test_missing_model_directory_is_explained(tmp_path) -> None:
    r = pdserve("generate", "--offline", "--model", str(tmp_path / "nope"), "hi")
    assert r.returncode != 0 and "nope" in r.stderr and "Traceback" not in r.stderr
