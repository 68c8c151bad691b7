"""The OpenAI HTTP client of the load generator: a streamed completion or chat completion over one HTTP/1.1
connection per request (asyncio streams: no HTTP library, nothing between the clock and the socket).

Text pieces are the SSE chunks' ``choices[0].text`` (completions) or ``delta`` content / reasoning / tool calls
(chat); the token counts are the usage chunk's (``stream_options.include_usage``). ``ignore_eos`` (vLLM's extension)
makes every output as long as asked.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from deepinfer.loadgen.outcome import Outcome
from deepinfer.loadgen.workload import Turn


class OpenAIClient:
    def __init__(self, base_url: str, model: str, chat: bool, api_key: str | None = None, timeout_s: float = 600.0):
        url = urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url: expected http(s)://host[:port][/path], got {base_url!r}")
        self.host, self.tls = url.hostname, url.scheme == "https"
        self.port = url.port or (443 if self.tls else 80)
        base = url.path if url.path.endswith("/v1") else url.path + "/v1"
        self.path = base + ("/chat/completions" if chat else "/completions")
        self.model, self.chat, self.api_key, self.timeout_s = model, chat, api_key, timeout_s

    def body(self, turn: Turn, history: list[dict[str, str]], params: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        out |= {"max_tokens": turn.output_len, "ignore_eos": True, **params}
        if self.chat:
            out["messages"] = [*history, {"role": "user", "content": turn.text}]
        else:
            out["prompt"] = turn.prompt_ids
        return out

    async def send(self, out: Outcome, turn: Turn, history: list[dict[str, str]], params: dict[str, Any]) -> None:
        payload = json.dumps(self.body(turn, history, params)).encode()
        head = [f"POST {self.path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Content-Type: application/json"]
        head += ["Accept: text/event-stream", f"Content-Length: {len(payload)}", "Connection: close"]
        if self.api_key:
            head.append(f"Authorization: Bearer {self.api_key}")
        out.begin()
        try:
            await asyncio.wait_for(
                self._exchange(out, "\r\n".join(head).encode() + b"\r\n\r\n" + payload), self.timeout_s
            )
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            out.end(f"{type(e).__name__}: {e}")
            return
        except TimeoutError:
            out.end(f"no answer within {self.timeout_s} s")
            return
        out.end(out.error)

    async def _exchange(self, out: Outcome, request: bytes) -> None:
        ctx = ssl.create_default_context() if self.tls else None
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=ctx)
        try:
            writer.write(request)
            await writer.drain()
            status, headers = await _head(reader)
            chunks = _chunked(reader) if headers.get("transfer-encoding", "").lower() == "chunked" else _plain(reader)
            if status != 200:
                body = b"".join([c async for c in chunks])
                out.error = f"HTTP {status}: {body.decode(errors='replace')[:300]}"
                return
            buf = b""
            async for chunk in chunks:
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if self._event(out, event):
                        return
        finally:
            writer.close()

    def _event(self, out: Outcome, event: bytes) -> bool:
        """Apply one SSE event; True at ``[DONE]``."""
        for line in event.decode().splitlines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return True
            msg = json.loads(data)
            if "error" in msg:
                out.error = json.dumps(msg["error"])[:300]
            if msg.get("usage"):
                out.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                out.output_tokens = msg["usage"].get("completion_tokens", 0)
                details = msg["usage"].get("prompt_tokens_details") or {}
                out.cached_tokens = details.get("cached_tokens", 0)
                out.cached_by_tier = dict(details.get("cached_tokens_by_tier") or {})
            for choice in msg.get("choices") or []:
                text = _text(choice, self.chat)
                if text:
                    out.piece(text)
        return False


def _text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    d = choice.get("delta") or {}
    calls = d.get("tool_calls") or []
    return (d.get("reasoning_content") or "") + (d.get("content") or "") + "".join(json.dumps(c) for c in calls)


async def _head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = (await reader.readline()).decode()
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
    headers = {}
    while (line := (await reader.readline()).decode().strip()) != "":
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(parts[1]), headers


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF


async def _plain(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read(65536):
        yield chunk


__all__ = ["OpenAIClient"]
