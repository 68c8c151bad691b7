"""Suite-wide settings: one torch thread (the tiny models' ops are too small to gain from more, and CI has 2
cores shared with subprocess tests)."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
