"""``python -m services.worker_ascend``: the worker on one Ascend NPU (refuses to start where torch_npu is absent)."""

import sys

from deepinfer.serving.worker import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main("ascend"))
