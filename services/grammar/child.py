"""``python -m services.grammar.child --config JSON``: one compile process of the grammar ``CompilerPool``.

It caps its own private memory (``RLIMIT_DATA`` = ``memory_bytes``) before loading anything, builds a
:class:`~deepinfer.grammar.compiler.Compiler` (no cache: the pool caches), then talks line-delimited JSON on
stdin/stdout — never pickle:

* ``--config``: ``{"model_dir": str | null, "memory_bytes": int, "json_whitespace": int, "json_indent": int,
  "backend": str, "limits": {...}, "parent_pid": int}``;
* first line out, once ready: ``{"ready": true, "pid": int, "tokenizer_fingerprint": str}``;
* per line in ``{"id": int, "kind": str, "text": str, "backend"?: str}`` (``backend``: this compile's, in
  place of the configured one), one line out: ``{"id", "ok": true, "compiled_json", "cache_key",
  "allowed_control_token_ids", "backend", "compile_ms"}`` or ``{"id", "ok": false, "error", "outcome",
  "fatal"}`` (``fatal``: this process exits after answering, e.g. after running out of memory).

Anything else the libraries print goes to stderr (fd 1 is re-pointed there), so stdout carries only replies.
The process dies with its parent (``PR_SET_PDEATHSIG``) and exits at end of input.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from typing import Any, TextIO


def _cap_memory(limit: int) -> None:
    if limit <= 0:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard if hard != resource.RLIM_INFINITY else limit))


def _die_with_parent(parent_pid: int) -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent_pid and os.getppid() != parent_pid:  # the parent died before the prctl
        sys.exit(0)


def _protocol_stream() -> TextIO:
    """A private duplicate of stdout for replies; fd 1 then points at stderr for anything printed."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _answer(compiler: Any, request: dict) -> dict:
    from deepinfer.grammar.spec import GrammarError, GrammarSpec

    rid = request.get("id")
    t0 = time.perf_counter()
    try:
        compiled = compiler.compile(GrammarSpec(request["kind"], request["text"]), request.get("backend"))
    except GrammarError as e:
        return {"id": rid, "ok": False, "error": str(e), "outcome": e.outcome, "fatal": e.outcome == "crash"}
    except MemoryError:
        return {"id": rid, "ok": False, "error": f"{request.get('kind')}: the compile ran out of memory",
                "outcome": "crash", "fatal": True}  # fmt: skip
    return {
        "id": rid, "ok": True, "compiled_json": compiled.compiled_json, "cache_key": compiled.cache_key,
        "allowed_control_token_ids": list(compiled.allowed_control_token_ids), "backend": compiled.backend,
        "compile_ms": (time.perf_counter() - t0) * 1e3,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.grammar.child")
    parser.add_argument("--config", required=True, help="JSON: model_dir, memory_bytes, json_whitespace, limits")
    config = json.loads(parser.parse_args(argv).config)
    _cap_memory(int(config.get("memory_bytes") or 0))
    _die_with_parent(int(config.get("parent_pid") or 0))
    out = _protocol_stream()

    from deepinfer.grammar.compiler import Compiler
    from deepinfer.grammar.limits import Limits

    compiler = Compiler(
        config.get("model_dir"), cache_bytes=0, limits=Limits(**config.get("limits", {})),
        json_whitespace=int(config.get("json_whitespace", 0)), json_indent=int(config.get("json_indent", 0)),
        backend=str(config.get("backend") or "xgrammar"),
    )  # fmt: skip
    compiler.warm()  # load xgrammar, llguidance and the tokenizer now, before saying ready
    out.write(json.dumps({"ready": True, "pid": os.getpid(), "tokenizer_fingerprint": compiler.tokenizer_fingerprint})
              + "\n")  # fmt: skip
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except ValueError as e:
            out.write(json.dumps({"id": None, "ok": False, "error": f"bad request line: {e}", "outcome": "crash",
                                  "fatal": True}) + "\n")  # fmt: skip
            return 1
        reply = _answer(compiler, request)
        out.write(json.dumps(reply) + "\n")
        if reply.get("fatal"):
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
