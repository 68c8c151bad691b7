"""Tracing on without the ``otlp`` extra: every service says which package is missing and how to install it, and
exits with status 2 (no traceback); ``wait_serving`` (``deepinfer up``) shows that line from the service's log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.serving.healthcheck import free_port, wait_serving

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)

# imported first by every interpreter started with it on PYTHONPATH: the OTLP exporter cannot be imported
SHIM = """
import sys


class NoExporter:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry.exporter" or name.startswith("opentelemetry.exporter."):
            raise ImportError(f"No module named {name!r} (hidden by the test)")
        return None


sys.meta_path.insert(0, NoExporter())
"""

SERVICES = {
    "kvstore": ["services.kvstore"],
    "grammar": ["services.grammar"],
    "worker": ["services.worker_nvidia"],
    "scheduler": ["services.scheduler", "--worker", "127.0.0.1:1"],
    "balancer": ["services.balancer", "--scheduler", "127.0.0.1:1"],
}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    shim = tmp_path_factory.mktemp("shim")
    (shim / "sitecustomize.py").write_text(SHIM)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "OTEL_"))}
    env.update(DEEPINFER_ACCELERATOR="cpu", DEEPINFER_OTEL_ENDPOINT="http://127.0.0.1:4317", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(ROOT / "libs"), str(ROOT)])
    return env


def assert_names_the_extra(text: str) -> None:
    assert "opentelemetry-exporter-otlp-proto-grpc" in text and "pip install 'deepinfer[otlp]'" in text, text
    assert "Traceback" not in text, text


@pytest.mark.parametrize("name", list(SERVICES))
def test_a_service_without_the_otlp_extra_names_it_and_exits_2(name: str, env: dict[str, str]) -> None:
    port = ["--grpc-port" if name == "balancer" else "--port", str(free_port())]
    p = subprocess.run(
        [sys.executable, "-m", *SERVICES[name], *port], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"deepinfer {name}: cannot start" in p.stdout + p.stderr
    assert_names_the_extra(p.stdout + p.stderr)


def test_wait_serving_shows_the_end_of_the_log_of_a_service_that_exited(tmp_path: Path, env: dict[str, str]) -> None:
    port = free_port()
    log = tmp_path / "kvstore.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.kvstore", "--port", str(port)], cwd=ROOT, env=env, stdout=out, stderr=out
        )
        with pytest.raises(RuntimeError) as e:
            wait_serving(f"127.0.0.1:{port}", timeout=240, proc=proc, log=log)
    message = str(e.value)
    assert "services.kvstore exited with code 2 before serving" in message and str(log) in message
    assert_names_the_extra(message)
