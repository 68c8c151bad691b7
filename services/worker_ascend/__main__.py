"""``python -m services.worker_ascend``: the worker on one Ascend NPU (refuses to start where torch_npu is absent)."""

import sys

from deepinfer.serving.worker import main

sys.exit(main("ascend"))
