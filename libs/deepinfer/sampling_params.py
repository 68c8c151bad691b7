"""Per-request sampling parameters (vLLM-compatible field names and defaults).

Contract:

* ``SamplingParams`` is a plain dataclass; ``__post_init__`` checks every field-local rule and
  raises ``ValueError`` whose message starts with the offending field name, e.g.
  ``"temperature must be >= 0, got -1"``.
* ``n`` must be 1 (parallel sampling is not supported yet).
* ``temperature == 0`` means greedy (``greedy`` property); any positive finite value samples.
* ``top_k`` 0 or -1 disables top-k; ``top_p`` is in (0, 1]; ``min_p`` is in [0, 1].
* ``max_tokens`` is ``None`` (no limit besides the context) or a positive int; ``min_tokens >= 0`` and,
  when ``max_tokens`` is set, ``min_tokens <= max_tokens``.
* ``stop`` is normalised to a list of non-empty strings; ``stop_token_ids`` to a list of ints >= 0.
* ``seed`` (vLLM) and ``seq_seed`` (DeepInfer) are synonyms; giving both with different values is an
  error. ``effective_seed`` is the one that was given (or ``None``).
* ``logprobs`` / ``prompt_logprobs``: ``None`` (off) or an int in [0, 20]; 0 means only the chosen
  token's logprob, k > 0 also returns the k most likely tokens.
* ``so_args`` (structured output): ``None`` or a dict with ``schema_type`` in ``SO_SCHEMA_TYPES`` and a
  ``schema``: a str for regex / ebnf; a dict or a JSON string that parses to an object for
  json_schema / json / structural_tag; json_object needs none.
* ``validate_for_model(vocab_size)`` checks the model-dependent rule: stop_token_ids < vocab_size.

Dependency-free on purpose (the standard library only) so any service can import it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20
SO_SCHEMA_TYPES = ("regex", "json_schema", "json", "ebnf", "json_object", "structural_tag")
_STR_SCHEMA_TYPES = ("regex", "ebnf")
_JSON_SCHEMA_TYPES = ("json_schema", "json", "structural_tag")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    seq_seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    so_args: dict | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n != 1:
            raise ValueError(f"n must be 1 (only n=1 is supported), got {self.n!r}")
        if not _is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disables), got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} max_tokens={self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {v!r}")
        for name in ("seed", "seq_seed"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise ValueError(f"{name} must be an int or None, got {v!r}")
        if self.seed is not None and self.seq_seed is not None and self.seed != self.seq_seed:
            raise ValueError(
                f"seq_seed must equal seed when both are given, got seq_seed={self.seq_seed} seed={self.seed}"
            )
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if self.so_args is not None:
            self._validate_so_args(self.so_args)

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list | tuple):
            raise ValueError(f"stop must be a str, a list of str or None, got {type(stop).__name__}")
        for s in items:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if not s:
                raise ValueError("stop must not contain empty strings")
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple):
            raise ValueError(f"stop_token_ids must be a list of int or None, got {type(ids).__name__}")
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids must contain only ints >= 0, got {t!r}")
        return list(ids)

    @staticmethod
    def _validate_so_args(so: object) -> None:
        if not isinstance(so, dict):
            raise ValueError(f"so_args must be a dict or None, got {type(so).__name__}")
        st = so.get("schema_type")
        if st not in SO_SCHEMA_TYPES:
            raise ValueError(f"so_args.schema_type must be one of {list(SO_SCHEMA_TYPES)}, got {st!r}")
        for key in so:
            if key not in ("schema_type", "schema"):
                raise ValueError(f"so_args.{key} is not taken (so_args has schema_type and schema)")
        if st == "json_object":
            if so.get("schema") not in (None, "", {}):  # (a schema would be dropped: json_schema takes one)
                raise ValueError("so_args.schema is not taken by schema_type 'json_object' (use 'json_schema')")
            return
        if "schema" not in so or so["schema"] is None:
            raise ValueError(f"so_args.schema is required for schema_type {st!r}")
        schema: Any = so["schema"]
        if st in _STR_SCHEMA_TYPES:
            if not isinstance(schema, str) or not schema:
                raise ValueError(f"so_args.schema must be a non-empty str for schema_type {st!r}")
            return
        # json_schema / json / structural_tag: a dict or a JSON string holding an object.
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"so_args.schema is not valid JSON for schema_type {st!r}: {e}") from None
            except RecursionError:
                raise ValueError(f"so_args.schema is nested too deeply for schema_type {st!r}") from None
        if not isinstance(schema, dict):
            raise ValueError(
                f"so_args.schema must be a JSON object (dict or JSON string) for schema_type {st!r}, "
                f"got {type(schema).__name__}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def effective_seed(self) -> int | None:
        return self.seed if self.seed is not None else self.seq_seed

    def validate_for_model(self, vocab_size: int) -> None:
        """Check the rules that depend on the model: every stop token id must be < vocab_size."""
        for t in self.stop_token_ids or ():
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids must be < vocab_size ({vocab_size}), got {t}")
