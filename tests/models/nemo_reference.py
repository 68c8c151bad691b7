"""NeMo AutoModel 0.7.0 (``deepseek_v41``) as a CPU test reference, installed on first use.

NeMo's full dependency set is huge (megatron, TE, DeepEP, datasets ...); the V4.1 model code needs none of it (its
eager CPU backends run without them). pyproject cannot express ``--no-deps``, so this module installs the wheel
alone, once, into ``<repo>/.deepinfer/nemo`` (git-ignored) under a file lock, and puts that directory on
``sys.path``. The few
small packages NeMo imports (transformers, pillow, typer, regex, pyyaml, ...) come from the ``dev`` extra.

Tests use it through the session fixture ``nemo`` (tests/models/conftest.py); when the install fails (no
network) they fail with the pip output, they do not skip.
"""

from __future__ import annotations

import fcntl
import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

NEMO_VERSION = "0.7.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
TARGET = REPO_ROOT / ".deepinfer" / "nemo"


class NemoUnavailable(RuntimeError):
    """NeMo AutoModel could not be installed or imported."""


def _add_target() -> None:
    if TARGET.is_dir() and str(TARGET) not in sys.path:
        sys.path.append(str(TARGET))  # appended: never shadows the venv's own packages


def _try_import() -> ModuleType | None:
    _add_target()
    importlib.invalidate_caches()
    try:
        return importlib.import_module("nemo_automodel")
    except ImportError:
        return None


def ensure_nemo() -> ModuleType:
    """Import ``nemo_automodel`` (installing ``nemo-automodel==0.7.0 --no-deps`` once) and return it."""
    mod = _try_import()
    if mod is not None:
        return _checked(mod)
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    with open(TARGET.parent / "nemo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test processes: one installs, the others wait
        mod = _try_import()
        if mod is None:
            cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet"]
            cmd += ["--target", str(TARGET), f"nemo-automodel=={NEMO_VERSION}"]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise NemoUnavailable(
                    f"installing the NeMo AutoModel test reference failed ({' '.join(cmd)}), exit {res.returncode}. "
                    f"It needs network access once; afterwards it lives in {TARGET}.\n{res.stdout}\n{res.stderr}"
                )
            mod = _try_import()
            if mod is None:
                raise NemoUnavailable(f"nemo_automodel was installed into {TARGET} but does not import")
    return _checked(mod)


def _checked(mod: ModuleType) -> ModuleType:
    version = getattr(mod, "__version__", None)
    if version is not None and not str(version).startswith(NEMO_VERSION):
        raise NemoUnavailable(f"nemo_automodel {version} is importable, the tests need {NEMO_VERSION}")
    return mod


def v41_modules() -> tuple[ModuleType, ModuleType]:
    """NeMo's ``deepseek_v41.config`` and ``deepseek_v41.engram`` modules."""
    ensure_nemo()
    try:
        config = importlib.import_module("nemo_automodel.components.models.deepseek_v41.config")
        engram = importlib.import_module("nemo_automodel.components.models.deepseek_v41.engram")
    except ImportError as e:  # a runtime dependency missing from the dev extra
        raise NemoUnavailable(f"NeMo's deepseek_v41 does not import: {type(e).__name__}: {e}") from e
    return config, engram
