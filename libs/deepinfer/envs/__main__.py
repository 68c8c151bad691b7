"""``python -m deepinfer.envs [--markdown]``: validate and print the current values, or print the reference."""

import sys

from deepinfer.envs import main

sys.exit(main())
