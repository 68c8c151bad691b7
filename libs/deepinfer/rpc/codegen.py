"""Regenerate the committed Python code of ``proto/deepinfer/v1/*.proto``.

python -m deepinfer.rpc.codegen            # writes libs/deepinfer/v1/*_pb2{,_grpc}.py{,i}
python -m deepinfer.rpc.codegen --out DIR  # elsewhere (the staleness test compares the two)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PROTO_DIR = ROOT / "proto"
DEFAULT_OUT = ROOT / "libs"


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "deepinfer" / "v1").glob("*.proto"))


def generate(out: Path = DEFAULT_OUT) -> list[Path]:
    """Run protoc (grpcio-tools) on every proto file; returns the files written."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *files]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")
    return sorted((out / "deepinfer" / "v1").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    for f in generate(args.out):
        print(f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
