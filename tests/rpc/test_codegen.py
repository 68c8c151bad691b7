"""The committed generated code equals what the proto files generate (regenerate: python -m deepinfer.rpc.codegen)."""

from __future__ import annotations

from pathlib import Path

from deepinfer.rpc.codegen import DEFAULT_OUT, generate, proto_files


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert len(fresh) == 3 * len(proto_files()) >= 15
    for f in fresh:
        committed = DEFAULT_OUT / f.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run python -m deepinfer.rpc.codegen"
        assert committed.read_bytes() == f.read_bytes(), f"{committed} is stale: run python -m deepinfer.rpc.codegen"
    committed_all = {p.name for p in (DEFAULT_OUT / "deepinfer" / "v1").glob("*_pb2*.py*")}
    assert committed_all == {f.name for f in fresh}, "generated files without a proto source"


def test_enums_start_with_unspecified() -> None:
    for proto in proto_files():
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith("enum "):
                first = next(x for x in lines[i + 1 :] if x.strip() and not x.strip().startswith("//"))
                assert "_UNSPECIFIED = 0" in first, f"{proto.name}: {line.strip()}"
