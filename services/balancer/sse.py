"""Server-sent events of the OpenAI streaming API: the framing (``data: {json}``, ``data: [DONE]``), the streaming
response that releases the request's resources however it ends, and the watch for a client that hangs up."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.balancer.http_errors import api_error


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """SSE that always runs ``cleanup`` (close the upstream stream) when the response ends, disconnects included."""

    def __init__(self, content: AsyncIterator[str], cleanup: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()  # type: ignore[union-attr]
            finally:
                await self.cleanup()


async def hang_up(request: Request, handler: asyncio.Task) -> None:
    """Cancel ``handler`` when its client disconnects (the body has been read: only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    handler.cancel()


async def framed(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """SSE framing: ``data: {json}`` events, an error event if the stream fails, then ``data: [DONE]``."""
    try:
        async for event in events:
            yield sse(event)
    except Exception as e:
        yield sse(api_error(e).body())
    yield "data: [DONE]\n\n"
