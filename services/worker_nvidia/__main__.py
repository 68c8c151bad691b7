"""``python -m services.worker_nvidia``: the worker on one NVIDIA GPU (DEEPINFER_ACCELERATOR=cpu: reference ops)."""

import sys

from deepinfer.serving.worker import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main("nvidia"))
