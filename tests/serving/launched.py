"""``deepinfer up``'s own mesh (the launcher: NATS, kvstore, grammar, replicas, the balancer) for a test module, with
the settings it reads from the environment set for its lifetime, as `deepinfer up` reads them."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deepinfer.launcher import Mesh
from deepinfer.serving.healthcheck import free_port
from service_env import GRAMMAR_WORKERS

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def launched_mesh(tmp: Path, model: Path, replicas: int = 2, supervise: bool = False, http: bool = False,
                  roles: list[str] | None = None, grammar: bool = False, **env: str) -> Iterator[Mesh]:  # fmt: skip
    """The started mesh (supervised like `deepinfer up`'s when ``supervise``; the balancer's OpenAI HTTP API with
    ``http``: ``endpoints["http"]``; ``roles``: each replica's, as ``deepinfer up --prefill-replicas``; a grammar
    service only with ``grammar``: the tests that launch meshes send no structured output, and one costs each mesh
    about 3 s of CPU at its start); ``env``: DEEPINFER_* settings."""
    saved = dict(os.environ)
    for k in [k for k in os.environ if k.startswith("DEEPINFER_")]:
        del os.environ[k]
    os.environ.update(
        {
            "PYTHONPATH": os.pathsep.join([str(ROOT / "libs"), str(ROOT)]),
            "DEEPINFER_CACHE_DIR": str(tmp / "cache"),
            "DEEPINFER_LOG_LEVEL": "warning",
            "DEEPINFER_GRAMMAR_WORKERS": GRAMMAR_WORKERS,
        }
        | env
    )
    m = Mesh(model, grpc_port=0, http_port=free_port() if http else 0, replicas=len(roles) if roles else replicas,
             roles=list(roles or []), log_dir=tmp, grammar=grammar)  # fmt: skip
    try:
        m.start()
        if supervise:
            m.start_supervisor()
        yield m
    finally:
        m.stop()
        os.environ.clear()
        os.environ.update(saved)


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples at ``url`` whose labels include ``labels``."""
    text = urllib.request.urlopen(url).read().decode()
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith(name) and all(w in ln for w in want))  # fmt: skip
