"""The host's time per op of one run, without a profiler's distortion: every public method of the model's op set
(``deepinfer.ops``: where the model hands work to a backend) timed with ``perf_counter`` around the call, nothing
synchronised, and the rest of the run (the model's own Python and torch calls between ops) as ``outside ops``.

A method called from inside another (``moe_mxfp4`` from ``moe``, ``parallel``'s branches) counts in both: the
table's ``self ms`` subtracts the time of nested op calls. One wrapper costs about a microsecond a call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

SKIP = {"prepare_weights", "parallel"}  # load-time work; parallel only calls two ops (their times are their own)


def host_op_times(ops: Any, run: Callable[[], object], sync: Callable[[], None]) -> dict[str, Any]:
    """Run ``run`` once with every op of ``ops`` timed on the host; ``sync`` before and after (outside the timing of
    the run's issue). → ``{"issue_ms", "outside_ops_ms", "ops": {name: {"calls", "ms", "self_ms"}}}``, the ops by
    self time."""
    stats: dict[str, list[float]] = {}
    depth: list[float] = []  # the nested ops' time, per open call
    names = [n for n in dir(type(ops)) if not n.startswith("_") and n not in SKIP and callable(getattr(ops, n))]
    saved = {n: ops.__dict__[n] for n in names if n in ops.__dict__}

    def wrap(name: str, fn: Callable) -> Callable:
        def timed(*a: Any, **k: Any) -> Any:
            depth.append(0.0)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                nested = depth.pop()
                if depth:
                    depth[-1] += dt
                s = stats.setdefault(name, [0, 0.0, 0.0])
                s[0] += 1
                s[1] += dt
                s[2] += dt - nested

        return timed

    for n in names:
        setattr(ops, n, wrap(n, getattr(ops, n)))
    try:
        sync()
        t = time.perf_counter()
        run()
        issue = time.perf_counter() - t
        sync()
    finally:
        for n in names:
            if n in saved:
                setattr(ops, n, saved[n])
            else:
                delattr(ops, n)
    top = sum(s[2] for s in stats.values())
    table = {
        n: {"calls": int(c), "ms": round(1e3 * ms, 3), "self_ms": round(1e3 * own, 3)}
        for n, (c, ms, own) in sorted(stats.items(), key=lambda kv: -kv[1][2])
    }
    return {"issue_ms": round(1e3 * issue, 3), "outside_ops_ms": round(1e3 * (issue - top), 3), "ops": table}


__all__ = ["host_op_times"]
