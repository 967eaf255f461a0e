"""Regenerate the Python stubs from the ``.proto`` files: ``python -m protos.generate``.

Stubs are committed so a plain install needs no code generator; a test regenerates them
into a temporary folder and fails when they differ (never hand-edit ``*_pb2*.py``).
Paths are relative to the repository root, so generated imports read
``from protos.pdserve.v1 import common_pb2``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos/pdserve/v1")


def proto_files() -> list[Path]:
    return sorted((ROOT / PROTO_DIR).glob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc

    files = [str(p.relative_to(ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *files]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {files}")
    finally:
        os.chdir(cwd)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
