"""One compile process of the pool, seen from the parent: start it, ask it to compile, kill it.

The process is ``python -m services.grammar.child --config JSON`` (:mod:`services.grammar.child` documents
the line-delimited JSON protocol); a reply carries a whole serialized grammar on one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from deepinfer.grammar.spec import GrammarUnavailable

__all__ = ["CompileProcess", "ProcessDied"]

LINE_LIMIT = 1 << 30  # a reply carries a serialized grammar: allow long lines


class ProcessDied(Exception):
    """The compile process exited (or answered garbage) while compiling; ``str(e)`` says how."""


@dataclass(eq=False)
class CompileProcess:
    proc: asyncio.subprocess.Process

    @classmethod
    async def spawn(cls, config: dict) -> CompileProcess:
        """Start one process with ``config`` (it is not ready yet: :meth:`wait_ready`)."""
        import deepinfer

        env = dict(os.environ)
        libs = str(Path(deepinfer.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([libs, *filter(None, [env.get("PYTHONPATH")])])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.grammar.child", "--config", json.dumps(config),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env, limit=LINE_LIMIT,
        )  # fmt: skip
        return cls(proc)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.returncode is None

    async def wait_ready(self, timeout_s: float, memory_bytes: int) -> None:
        """Wait for its ready line; :class:`GrammarUnavailable` (and the process killed) if it never comes."""
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
            hello = json.loads(line) if line else {}
        except (TimeoutError, ValueError):
            hello = {}
        except BaseException:
            await self.kill()
            raise
        if hello.get("ready"):
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), 5.0)  # its own exit code, when it is exiting anyway
        await self.kill()
        code = self.proc.returncode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        raise GrammarUnavailable(
            f"compile process {self.pid} did not start ({how}; its error is in the log; its memory cap is "
            f"{memory_bytes} bytes, DEEPINFER_GRAMMAR_MEMORY_BYTES)"
        )

    async def request(self, message: dict, timeout_s: float) -> dict:
        """Send one request and read its reply within ``timeout_s`` (``TimeoutError``; :class:`ProcessDied`)."""

        async def round_trip() -> dict:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            try:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                await self.proc.stdin.drain()
                line = await self.proc.stdout.readline()
            except (BrokenPipeError, ConnectionResetError, ValueError) as e:
                raise ProcessDied(repr(e)) from None
            if not line:
                code = await self.proc.wait()
                raise ProcessDied(f"signal {-code}" if code < 0 else f"exit code {code}")
            try:
                return json.loads(line)
            except ValueError:
                raise ProcessDied(f"an unreadable reply {line[:80]!r}") from None

        return await asyncio.wait_for(round_trip(), timeout_s)

    async def kill(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        await self.proc.wait()
