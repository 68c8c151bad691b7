"""The invoke and parameter headers of the streaming DSML parser (``chat.streaming``): how the text after
`<｜DSML｜invoke` (up to its `name="…">`) or `<｜DSML｜parameter` (up to its `string="…">`) reads.

Spec: docs/chat_format.md, "Streaming parser". A header is read at the start of the parser's buffer, strictly as the
reference parser (dsml.py) does, else leniently (recorded as an issue); `None` means the buffer does not decide it yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.chat.stream_states import (
    HEADER_LIMIT,
    INVOKE_HEADER_ENDS,
    INVOKE_HEADER_RE,
    LENIENT_NAME_RE,
    LENIENT_PARAM_RE,
    PARAM_ATTR_RE,
    PARAM_HEADER_ENDS,
    PARAM_NAME_PREFIX,
)
from deepinfer.chat.tokens import INVOKE_CLOSE, PARAMETER_OPEN

__all__ = ["TRUNCATED", "Header", "read_invoke_header", "read_param_header"]


@dataclass(frozen=True)
class Header:
    """A header read at the start of the buffer: it takes ``buf[:end]``."""

    end: int
    name: str | None = None  # None: no usable name, the invoke / parameter is dropped
    is_string: bool = False  # a parameter's `string="true"`
    issue: str | None = None  # how it deviates from the reference format, if it does
    truncated: bool = False  # the generation ended inside the header: the rest of the text is dropped


TRUNCATED = Header(0, truncated=True)


def read_invoke_header(buf: str, final: bool) -> Header | None:
    """The header of an invoke (``buf`` follows `<｜DSML｜invoke`); ``final``: no more text will come."""
    hits = [(i, t) for t in INVOKE_HEADER_ENDS if (i := buf.find(t)) != -1]
    if not hits and not final and len(buf) <= HEADER_LIMIT:
        return None
    at, tag = min(hits) if hits else (len(buf), "")
    header = buf[:at]
    match = INVOKE_HEADER_RE.fullmatch(header) if tag in (PARAMETER_OPEN, INVOKE_CLOSE) else None
    if match is not None:
        return Header(at, match.group(1))
    if not tag and final:
        return TRUNCATED  # the call never started
    match = LENIENT_NAME_RE.search(header)
    return Header(at, None if match is None else match.group(1), issue=f"malformed invoke header {header[:60]!r}")


def read_param_header(buf: str, final: bool) -> Header | None:
    """The header of a parameter (``buf`` follows `<｜DSML｜parameter`); ``final``: no more text will come. A
    malformed header that is dropped takes nothing (``end`` 0): the parser skips the parameter from there."""
    stop = min((i for t in PARAM_HEADER_ENDS if (i := buf.find(t)) != -1), default=-1)
    prefixed = buf.startswith(PARAM_NAME_PREFIX)
    attr = PARAM_ATTR_RE.search(buf, len(PARAM_NAME_PREFIX)) if prefixed else None
    undecided = stop == -1 and not final and len(buf) <= HEADER_LIMIT
    if attr is not None and (stop == -1 or stop >= attr.end()):
        # As the reference: the name runs up to the first `" string="true|false">`.
        return Header(attr.end(), buf[len(PARAM_NAME_PREFIX) : attr.start()], attr.group(1) == "true")
    if undecided and (prefixed or PARAM_NAME_PREFIX.startswith(buf)):
        return None
    lenient = LENIENT_PARAM_RE.match(buf)
    if lenient is None or (stop != -1 and lenient.end() > stop):
        if undecided and ">" not in buf:
            return None
        if stop == -1 and final:
            return TRUNCATED
        return Header(0, issue=f"malformed parameter header {buf[:60]!r} dropped")
    issue = f"malformed parameter header {buf[: lenient.end()]!r}"
    return Header(lenient.end(), lenient.group(1), lenient.group(2) == "true", issue)
