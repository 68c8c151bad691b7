"""In-process grammar compilation with xgrammar (the offline ``LLM``, and each compile process of the pool).

:meth:`Compiler.compile` checks the limits (:mod:`deepinfer.grammar.limits`), looks in its cache, then compiles:

=================  =====================================================================================
kind               xgrammar call
=================  =====================================================================================
``regex``          ``compile_regex(text)``
``ebnf``           ``compile_grammar(text)`` (root rule ``root``)
``json_schema``    ``compile_json_schema(rewritten, strict_mode=True, <whitespace>)``
``json_object``    ``compile_json_schema('{"type":"object"}', strict_mode=False, <whitespace>)``: any object
``structural_tag`` ``compile_structural_tag(text)``, each ``json_schema`` format's ``max_whitespace_cnt`` capped
=================  =====================================================================================

A JSON schema (and each ``json_schema`` format of a structural tag) is compiled as the schema pass rewrote it
(:mod:`deepinfer.grammar.schema_pass`, run by the limits check): every keyword enforced, rewritten, or refused.

JSON never has unbounded whitespace (``DEEPINFER_GRAMMAR_JSON_WHITESPACE``): 0, the default, is compact JSON
(``any_whitespace=False, separators=(",", ":")`` — without ``separators`` xgrammar still emits ``", "`` and
``": "``); N > 0 allows at most N whitespace characters in a row. The whitespace setting and xgrammar's version
are part of the cache key, so a key never names two different grammars. xgrammar's errors become
:class:`GrammarError` with the C++ source locations removed.

The backend (``DEEPINFER_GRAMMAR_BACKEND``, part of the cache key): ``xgrammar`` as above; ``llguidance``
compiles ``json_schema`` (as written, no pass), ``json_object`` and ``regex`` with llguidance
(:mod:`deepinfer.grammar.llg`); ``auto`` compiles with xgrammar unless the schema pass refuses the schema or
xgrammar refuses it, then with llguidance on the original text — a refusal of both is the pass's (or
xgrammar's) message, naming the keyword, with llguidance's reason appended. ``ebnf`` and ``structural_tag``
are always xgrammar's. :meth:`Compiler.compile` takes a ``backend`` for one compile (the pool's fallback
after an xgrammar compile timed out).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import re
import threading
from pathlib import Path
from typing import Any

from deepinfer import envs
from deepinfer.grammar.bounded_strings import compile_bounded, has_length_bounds
from deepinfer.grammar.cache import GrammarCache
from deepinfer.grammar.limits import Inspection, Limits, inspect_spec
from deepinfer.grammar.llg import (
    LLG_KINDS,
    build_llg_tokenizer,
    llg_compile,
    llg_json_options,
    llg_reason,
    llg_version,
)
from deepinfer.grammar.spec import BACKENDS, KINDS, CompiledGrammar, GrammarError, GrammarSpec, cache_key
from deepinfer.grammar.vocab import build_tokenizer_info, control_token_ids, tokenizer_fingerprint

__all__ = ["Compiler", "backend_for", "check_backend", "clean_message", "compile_options", "named_control_tokens"]

_CPP_LOCATION = re.compile(r"(?:\[\d\d:\d\d:\d\d\] )?(?:/[^\s:]+/)?[\w.+-]+\.(?:cc|cpp|cxx|h|hpp)(?::\d+)?: ?")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false: ?")
_MAX_MESSAGE = 600
SCHEMA_PASS_VERSION = 3  # bump when the schema pass rewrites differently: cached grammars must not be reused


@functools.cache
def _xgrammar_version() -> str:
    return importlib.metadata.version("xgrammar")


def compile_options(json_whitespace: int, json_indent: int = 0, backend: str = "xgrammar") -> str:
    """The compile settings that change a grammar for the same text (part of the cache key)."""
    layout = f"json_whitespace={json_whitespace}" + (f";json_indent={json_indent}" if json_indent else "")
    text = f"xgrammar={_xgrammar_version()};{layout};schema_pass={SCHEMA_PASS_VERSION}"
    return text if backend == "xgrammar" else f"{text};backend={backend};llguidance={llg_version()}"


def check_backend(backend: str, json_indent: int = 0) -> str:
    """``backend`` if it is a valid setting with ``json_indent`` (ValueError otherwise)."""
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"grammar backend {backend!r}: expected auto, {', '.join(BACKENDS)}")
    if backend == "llguidance" and json_indent:
        raise ValueError("DEEPINFER_GRAMMAR_BACKEND=llguidance cannot lay JSON out indented "
                         "(DEEPINFER_GRAMMAR_JSON_INDENT): use xgrammar or auto")  # fmt: skip
    return backend


def backend_for(kind: str, backend: str, json_indent: int = 0) -> str:
    """The backend that compiles ``kind`` under the setting ``backend``: ``xgrammar``, ``llguidance`` or
    ``auto`` (xgrammar first, llguidance after a refusal)."""
    if kind not in LLG_KINDS or backend == "xgrammar" or (backend == "auto" and json_indent):
        return "xgrammar"
    return backend


def _both_refused(first: GrammarError, second: GrammarError) -> GrammarError:
    return GrammarError(f"{first} (llguidance refuses it too: {llg_reason(second)})", first.outcome)


def json_layout(json_whitespace: int, json_indent: int) -> dict[str, Any]:
    """xgrammar's JSON options: indented as ``json.dumps(indent=N)``, else compact, else at most N whitespace
    characters in a row."""
    if json_indent:
        return {"any_whitespace": False, "indent": json_indent, "separators": (",", ": ")}
    if json_whitespace == 0:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"any_whitespace": True, "max_whitespace_cnt": json_whitespace}


def clean_message(message: str) -> str:
    """xgrammar's error text without C++ source paths, ``Check failed`` preambles or an echo of the input."""
    text = _CHECK_FAILED.sub("", _CPP_LOCATION.sub("", message))
    text = " ".join(text.split(" The JSON string is:")[0].split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 3] + "..."


def named_control_tokens(found: Inspection, controls: dict[int, str]) -> tuple[int, ...]:
    """The control tokens a grammar names: their text occurs in it (in a decoded string of a JSON document),
    or a structural tag names their id."""
    blob = "\x00".join(found.strings)
    ids = {i for i, text in controls.items() if text and text in blob}
    ids.update(i for i in found.token_ids if i in controls)
    return tuple(sorted(ids))


def _cap_tag_whitespace(document: dict, cap: int) -> dict:
    """Give every ``json_schema`` format of a structural tag ``max_whitespace_cnt <= cap`` (in place)."""
    stack: list[Any] = [document]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, dict | list))
            continue
        if node.get("type") == "json_schema" and "json_schema" in node:
            n = node.get("max_whitespace_cnt")
            node["max_whitespace_cnt"] = min(n, cap) if isinstance(n, int) and n > 0 else cap
            continue  # the schema inside has no formats
        stack.extend(v for v in node.values() if isinstance(v, dict | list))
    return document


class Compiler:
    """Compiles :class:`GrammarSpec` s against one tokenizer, with a byte-capped cache (thread-safe).

    ``model_dir`` gives the tokenizer (None: the packaged DeepSeek tokenizer); the other arguments default to
    the ``DEEPINFER_GRAMMAR_*`` variables. xgrammar and the tokenizer info load on the first compile.
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        cache_bytes: int | None = None,
        limits: Limits | None = None,
        json_whitespace: int | None = None,
        max_threads: int = 1,
        json_indent: int | None = None,
        backend: str | None = None,
    ) -> None:
        self.model_dir = model_dir
        self.limits = limits if limits is not None else Limits.from_env()
        ws = envs.DEEPINFER_GRAMMAR_JSON_WHITESPACE if json_whitespace is None else int(json_whitespace)
        self.json_whitespace = ws
        self.json_indent = envs.DEEPINFER_GRAMMAR_JSON_INDENT if json_indent is None else int(json_indent)
        chosen = envs.DEEPINFER_GRAMMAR_BACKEND if backend is None else backend
        self.backend = check_backend(chosen, self.json_indent)
        self.options = compile_options(ws, self.json_indent, self.backend)
        self.cache = GrammarCache(envs.DEEPINFER_GRAMMAR_CACHE_BYTES if cache_bytes is None else cache_bytes)
        self.tokenizer_fingerprint = tokenizer_fingerprint(model_dir)
        self.max_threads = max_threads
        self._controls: dict[int, str] | None = None
        self._xgr: Any = None
        self._lock = threading.Lock()

    @property
    def controls(self) -> dict[int, str]:
        if self._controls is None:
            self._controls = control_token_ids(self.model_dir)
        return self._controls

    def key(self, spec: GrammarSpec) -> str:
        """The cache key of ``spec`` here (tokenizer fingerprint, kind, text, compile options)."""
        return cache_key(self.tokenizer_fingerprint, spec.kind, spec.text, self.options)

    def compile(self, spec: GrammarSpec, backend: str | None = None) -> CompiledGrammar:
        """Check, then compile ``spec`` (or take it from the cache); raises :class:`GrammarError`.
        ``backend`` overrides the setting for this compile (the cache key stays the setting's)."""
        return self.compile_cached(spec, backend)[0]

    def compile_cached(self, spec: GrammarSpec, backend: str | None = None) -> tuple[CompiledGrammar, bool]:
        """:meth:`compile`, also saying whether the result came from the cache."""
        if spec.kind in KINDS and isinstance(spec.text, str):  # a hit passed the checks when it was compiled
            hit = self.cache.get(self.key(spec))
            if hit is not None:
                return hit, True
        route = backend_for(spec.kind, check_backend(backend or self.backend, self.json_indent), self.json_indent)
        mode = {"xgrammar": "raise", "auto": "keep", "llguidance": "skip"}[route]
        found = inspect_spec(spec, self.limits, mode)
        key = self.key(spec)
        text, used = self._compile_routed(spec, found, route)
        compiled = CompiledGrammar(text, key, self.tokenizer_fingerprint, named_control_tokens(found, self.controls),
                                   used)  # fmt: skip
        self.cache.put(compiled)
        return compiled, False

    def warm(self) -> None:
        """Load what compiling needs now (xgrammar and its tokenizer info; llguidance's tokenizer if used)."""
        self._compiler()
        if self.backend != "xgrammar":
            build_llg_tokenizer(self.model_dir)

    def _compile_routed(self, spec: GrammarSpec, found: Inspection, route: str) -> tuple[str, str]:
        """(grammar text, backend) of ``spec`` compiled on ``route``."""
        if route == "xgrammar":
            return self._xgrammar_compile(spec, found), "xgrammar"
        if route == "llguidance":
            return self._llg_compile(spec), "llguidance"
        first = found.pass_error
        if first is None:
            try:
                return self._xgrammar_compile(spec, found), "xgrammar"
            except GrammarError as e:
                if e.outcome != "invalid":
                    raise
                first = e
        try:
            return self._llg_compile(spec), "llguidance"
        except GrammarError as e:
            raise _both_refused(first, e) from None

    def _llg_compile(self, spec: GrammarSpec) -> str:
        options = llg_json_options(self.json_whitespace, self.json_indent)
        return llg_compile(spec.kind, spec.text, options, build_llg_tokenizer(self.model_dir))

    def _compiler(self) -> Any:
        with self._lock:
            if self._xgr is None:
                import xgrammar

                info = build_tokenizer_info(self.model_dir)
                self._xgr = xgrammar.GrammarCompiler(info, max_threads=self.max_threads, cache_enabled=False)
            return self._xgr

    def _xgrammar_compile(self, spec: GrammarSpec, found: Inspection) -> str:
        import xgrammar

        compiler, kind, ws = self._compiler(), spec.kind, self.json_whitespace
        json_options = json_layout(ws, self.json_indent)
        try:
            if kind == "regex":
                grammar = compiler.compile_regex(spec.text)
            elif kind == "ebnf":
                grammar = compiler.compile_grammar(spec.text)
            elif kind == "json_schema":
                text = found.compile_text if found.compile_text is not None else spec.text
                if has_length_bounds(text):  # (bounded_strings.py: xgrammar's own bounded strings, made valid JSON)
                    schema_grammar = xgrammar.Grammar.from_json_schema(text, strict_mode=True, **json_options)
                    grammar = compile_bounded(compiler, schema_grammar)
                else:
                    grammar = compiler.compile_json_schema(text, strict_mode=True, **json_options)
            elif kind == "json_object":
                grammar = compiler.compile_json_schema('{"type":"object"}', strict_mode=False, **json_options)
            else:
                tag = json.dumps(_cap_tag_whitespace(found.document, max(ws, 1)), ensure_ascii=False)
                if has_length_bounds(tag):
                    grammar = compile_bounded(compiler, xgrammar.Grammar.from_structural_tag(tag))
                else:
                    grammar = compiler.compile_structural_tag(tag)
            return grammar.serialize_json()
        except MemoryError:
            raise GrammarError(f"{kind}: the compile ran out of memory", "crash") from None
        except Exception as e:  # xgrammar raises RuntimeError, its own errors, pydantic's, TypeError
            message = clean_message(str(e)) or type(e).__name__
            if "bad_alloc" in message:
                raise GrammarError(f"{kind}: the compile ran out of memory", "crash") from None
            raise GrammarError(f"{kind}: {message}") from None
