"""``python -m services.worker_nvidia``: the worker on one NVIDIA GPU (DEEPINFER_ACCELERATOR=cpu: reference ops)."""

import sys

from deepinfer.serving.worker import main

sys.exit(main("nvidia"))
