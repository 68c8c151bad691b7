"""The worker's grammar view of the tokenizer (xgrammar's ``TokenizerInfo`` over its 129k tokens), built before the
worker serves.

Building it takes about a second of Python (importing xgrammar, reading the vocabulary), holding the interpreter's
lock most of that time. Built in a thread while the worker already served, it took that lock from the step thread
of the first steps; built at the first constrained request, it would delay that request instead. So the worker
builds it in a thread while the model loads (:func:`start_ahead`: the loading mostly waits for files and the
device) and waits for it before it serves (:func:`ready`). The view is cached per tokenizer file
(``grammar.vocab.build_tokenizer_info``), where the worker's ``ConstraintSet`` finds it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from deepinfer.engine.model_dir import local_model_dir
from deepinfer.telemetry import get_logger

log = get_logger(__name__)


def start_ahead(model: str | Path | None) -> threading.Thread | None:
    """Build the grammar view of ``model``'s tokenizer in a thread, when the model is on this host already (the
    directory the loading takes it from); None otherwise (a hub id is resolved, and downloaded, by the loading)."""
    local = local_model_dir(model)
    if local is None:
        return None

    def build() -> None:
        from deepinfer.grammar import build_tokenizer_info

        try:
            build_tokenizer_info(local)
        except Exception as e:  # noqa: BLE001 - ``ready`` builds it again and says why it cannot
            log.debug("grammar_view_ahead_failed", error=repr(e)[:300])

    # not a daemon: the interpreter waits for it at exit, whichever way the process ends (xgrammar's native threads
    # still running when it finalises abort the process: SIGABRT instead of the exit status)
    thread = threading.Thread(target=build, name="grammar-view", daemon=False)
    thread.start()
    return thread


def ready(constraints: Any, ahead: threading.Thread | None) -> None:
    """Wait for the view started ahead, then make sure ``constraints`` holds it (building it here if it was not
    started ahead or was for another tokenizer); a view that cannot be built is logged, and refused at the first
    constrained request (the worker serves the rest)."""
    t0 = time.perf_counter()
    if ahead is not None:
        ahead.join()
    try:
        constraints.warm()
    except Exception as e:  # noqa: BLE001 - structured outputs only: reported to the requests that ask for them
        log.warning("grammar_view_unavailable", error=repr(e)[:300])
        return
    log.info("grammar_view_ready", waited_s=round(time.perf_counter() - t0, 3))


__all__ = ["ready", "start_ahead"]
