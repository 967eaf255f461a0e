"""Generated stubs are committed; regenerating them must change nothing."""

from pathlib import Path

import pytest

from protos.generate import PROTO_DIR, ROOT, generate

pytest.importorskip("grpc_tools", reason="grpcio-tools is installed by `make test`")


def test_generated_stubs_match_the_protos(tmp_path: Path) -> None:
    generate(tmp_path)
    fresh = sorted((tmp_path / PROTO_DIR).glob("*_pb2*.py*"))
    committed = sorted((ROOT / PROTO_DIR).glob("*_pb2*.py*"))
    assert [p.name for p in fresh] == [p.name for p in committed]
    stale = [p.name for p, q in zip(fresh, committed, strict=True)
             if p.read_bytes() != q.read_bytes()]
    assert not stale, f"stubs out of date: {stale}; run `python -m protos.generate`"
