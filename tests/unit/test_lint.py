import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("ruff") is None and not (ROOT / ".venv/bin/ruff").exists(),
                    reason="ruff is installed by `make test`")
def test_ruff_is_clean() -> None:
    ruff = shutil.which("ruff") or str(ROOT / ".venv/bin/ruff")
    r = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _tool(name: str) -> str | None:
    venv = ROOT / ".venv/bin" / name
    return str(venv) if venv.exists() else shutil.which(name)


@pytest.mark.skipif(_tool("lint-imports") is None,
                    reason="import-linter is installed by `make test` (the test extra)")
def test_import_layers_hold() -> None:
    """The contracts in pyproject.toml: layers one-way, router and workers apart, the
    engine core free of torch/grpc/protos/redis, nothing below importing the launchers."""
    r = subprocess.run([_tool("lint-imports"), "--no-cache"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout
