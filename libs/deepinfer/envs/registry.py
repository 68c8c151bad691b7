"""The registry's machinery: a declared variable (:class:`EnvVar`), parsing and validation, reading at access time,
overrides for tests, and the reference in Markdown. The declarations themselves are in :mod:`.engine_settings` and
:mod:`.service_settings`; :mod:`deepinfer.envs` puts them together."""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["bool", "int", "float", "str", "enum", "path"]
PREFIX = "DEEPINFER_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_INT_RE = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")  # no nan/inf


class EnvError(ValueError):
    """One or more ``DEEPINFER_*`` variables hold a value that is not allowed.

    ``problems`` lists one message per bad variable; each names the variable, the value and what is allowed.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class UnknownEnvWarning(UserWarning):
    """A ``DEEPINFER_*`` variable is set that this registry does not know (probably a typo)."""


@dataclass(frozen=True)
class EnvVar:
    """The declaration of one environment variable."""

    name: str
    kind: Kind
    doc: str
    group: str
    default: Any = None  # a value, a zero-argument callable computing it, or None (unset)
    default_doc: str | None = None  # how the reference shows a computed default
    choices: tuple[str, ...] = ()  # for kind "enum" (lower-case; matched case-insensitively)
    minimum: float | None = None
    maximum: float | None = None
    multiple_of: int | None = None
    must_be_dir: bool = False  # for kind "path": must name an existing directory
    fallback: str | None = None  # a non-DEEPINFER variable read when this one is unset

    def allowed(self) -> str:
        """What values are allowed, in words (used in error messages and the reference)."""
        if self.kind == "bool":
            return "a boolean: 1/0, true/false, yes/no, on/off (case-insensitive)"
        if self.kind == "enum":
            return "one of " + ", ".join(self.choices) + " (case-insensitive)"
        if self.kind == "str":
            return "a non-empty string"
        if self.kind == "path":
            return "a path to an existing directory" if self.must_be_dir else "a filesystem path"
        text = "an integer" if self.kind == "int" else "a finite number"
        if self.minimum is not None:
            text += f" >= {self.minimum:g}"
        if self.maximum is not None:
            text += f" and <= {self.maximum:g}" if self.minimum is not None else f" <= {self.maximum:g}"
        if self.multiple_of is not None:
            text += f" that is a multiple of {self.multiple_of}"
        return text


_REGISTRY: dict[str, EnvVar] = {}


def declare(name: str, kind: Kind, group: str, doc: str, **fields: Any) -> None:
    assert name.startswith(PREFIX) and name not in _REGISTRY, name
    assert (kind == "enum") == bool(fields.get("choices")), name
    _REGISTRY[name] = EnvVar(name=name, kind=kind, group=group, doc=" ".join(doc.split()), **fields)


def registry() -> Mapping[str, EnvVar]:
    """All declared variables, in declaration order (read-only view)."""
    return dict(_REGISTRY)


def _close_matches(name: str) -> list[str]:
    """Registered names close to ``name``, compared without the common prefix."""
    tails = {known.removeprefix(PREFIX): known for known in _REGISTRY}
    return [tails[t] for t in difflib.get_close_matches(name.removeprefix(PREFIX), tails, n=3, cutoff=0.6)]


def _lookup(name: str) -> EnvVar:
    try:
        return _REGISTRY[name]
    except KeyError:
        close = _close_matches(name)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"{name} is not a registered environment variable{hint}") from None


def parse(var: EnvVar, raw: str) -> Any:
    """Parse ``raw`` as a value of ``var``; raise :class:`EnvError` if it is not allowed."""
    text, problem = raw.strip(), "is not allowed"
    value: Any
    if text == "":
        problem = "is set but empty; unset it to use the default"
    elif var.kind == "bool" and text.lower() in _TRUE | _FALSE:
        return text.lower() in _TRUE
    elif var.kind == "enum" and text.lower() in var.choices:
        return text.lower()
    elif var.kind == "str":
        return raw
    elif var.kind == "path":
        value = Path(raw).expanduser()
        if not var.must_be_dir or value.is_dir():
            return value
    elif var.kind == "int" and _INT_RE.fullmatch(text) or var.kind == "float" and _FLOAT_RE.fullmatch(text):
        value = int(text) if var.kind == "int" else float(text)
        lo, hi, step = var.minimum, var.maximum, var.multiple_of
        if (lo is None or value >= lo) and (hi is None or value <= hi) and (not step or value % step == 0):
            return value
    raise EnvError([f"{var.name}={raw!r} {problem}: expected {var.allowed()}"])


def _default(var: EnvVar) -> Any:
    value = var.default() if callable(var.default) else var.default
    if var.kind == "path" and value is not None:
        return Path(value).expanduser()
    return value


def get(name: str) -> Any:
    """The current value of variable ``name``: parsed from ``os.environ`` now, or its default if unset.

    Raises :class:`EnvError` if the variable is set to a value that is not allowed, and ``KeyError`` if
    ``name`` is not a registered variable.
    """
    var = _lookup(name)
    raw = os.environ.get(name)
    if raw is None and var.fallback is not None:
        raw = os.environ.get(var.fallback) or None  # OpenTelemetry treats an empty value as unset
    return _default(var) if raw is None else parse(var, raw)


def is_set(name: str) -> bool:
    """Whether ``name`` (a registered variable) is set in the environment, as opposed to defaulted."""
    _lookup(name)
    return name in os.environ


def snapshot() -> dict[str, Any]:
    """Every variable's current value (defaults computed), e.g. for a start-up log line."""
    return {name: get(name) for name in _REGISTRY}


def validate_all(environ: Mapping[str, str] | None = None) -> None:
    """Check every set ``DEEPINFER_*`` variable; call once at program start-up.

    Raises :class:`EnvError` listing every bad value. Unknown ``DEEPINFER_*`` variables are not an error:
    each produces an :class:`UnknownEnvWarning` naming the closest known variables. Defaults are not
    computed (so this never imports torch).
    """
    env = os.environ if environ is None else environ
    problems: list[str] = []
    for var in _REGISTRY.values():
        raw = env.get(var.name)
        if raw is not None:
            try:
                parse(var, raw)
            except EnvError as exc:
                problems.extend(exc.problems)
    for name in sorted(k for k in env if k.startswith(PREFIX) and k not in _REGISTRY):
        close = _close_matches(name)
        hint = f"did you mean {', '.join(close)}?" if close else "see docs/environment.md for the known ones"
        warnings.warn(f"unknown environment variable {name} is ignored; {hint}", UnknownEnvWarning, stacklevel=2)
    if problems:
        raise EnvError(problems)


def to_env_text(value: object) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


@contextlib.contextmanager
def override(**values: object) -> Iterator[None]:
    """Temporarily set (or, with ``None``, unset) variables in ``os.environ``; restores them on exit.

    Booleans become ``1``/``0``, everything else ``str(value)``. Values are not validated here (so tests
    can set bad ones on purpose); reading them through :func:`get` validates them.
    """
    for name in values:
        _lookup(name)
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = to_env_text(value)
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def _default_text(var: EnvVar) -> str:
    if var.default_doc is not None:
        return var.default_doc
    if var.default is None:
        return "unset"
    return f"`{to_env_text(var.default)}`"


def render_markdown() -> str:
    """The environment-variable reference (the contents of ``docs/environment.md``)."""
    lines = [
        "# Environment variables",
        "",
        "<!-- Generated by `python -m deepinfer.envs --markdown` from libs/deepinfer/envs/; do not edit by hand. -->",
        "",
        "Every `DEEPINFER_*` variable is declared once, in `libs/deepinfer/envs/` (`engine_settings.py`, "
        "`service_settings.py`), and read when used.",
        "`deepinfer.envs.validate_all()` runs at start-up and reports every value that is not allowed;",
        "a bad value is always an error, never silently replaced by the default. Booleans accept",
        "`1`/`0`, `true`/`false`, `yes`/`no` and `on`/`off` (case-insensitive). A set but empty",
        "variable is an error. An unknown `DEEPINFER_*` variable produces a warning naming the closest",
        "known ones.",
        "",
        "| Variable | Type | Default |",
        "| --- | --- | --- |",
    ]
    for var in _REGISTRY.values():
        lines.append(f"| [`{var.name}`](#{var.name.lower()}) | {var.kind} | {_default_text(var)} |")
    group = None
    for var in _REGISTRY.values():
        if var.group != group:
            group = var.group
            lines += ["", f"## {group}"]
        lines += [
            "",
            f"### `{var.name}`",
            "",
            f"- Type: {var.kind}",
            f"- Default: {_default_text(var)}",
            f"- Allowed: {var.allowed()}",
            "",
            var.doc,
        ]
    return "\n".join(lines) + "\n"
