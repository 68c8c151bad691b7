"""Mutual TLS between the services: ``deepinfer certs``, a real kvstore process with TLS on (who gets in, who does
not), the settings' rules, and one request through a whole mesh with TLS on."""

from __future__ import annotations

import asyncio
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import ExtendedKeyUsageOID

from deepinfer import cli
from deepinfer.certs import SERVICES, write_certs
from deepinfer.checkpoint.tiny import make_tiny_model
from deepinfer.kvstore.client import KVStoreClient
from deepinfer.rpc import tls
from deepinfer.rpc.channel import client_channel
from deepinfer.serving.healthcheck import SERVING, status
from deepinfer.serving.server import check_exposure
from deepinfer.v1 import generation_pb2_grpc
from serving.mesh import Mesh, health_status
from serving.test_mesh import collect, gen_request

pytestmark = pytest.mark.timeout(300)
VARS = ("DEEPINFER_TLS_CA", "DEEPINFER_TLS_CERT", "DEEPINFER_TLS_KEY")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mesh/``: the CA and the services' certificates; ``other/``: another CA and its ``intruder``."""
    root = tmp_path_factory.mktemp("certs")
    write_certs(root / "mesh", [*SERVICES, "operator"])
    write_certs(root / "other", ["intruder"])
    return root


def tls_env(directory: Path, name: str | None = None, ca: Path | None = None) -> dict[str, str]:
    """The TLS settings of ``name`` (None: the CA alone, as a public client)."""
    env = {"DEEPINFER_TLS_CA": str(ca or directory / "ca.pem")}
    if name is not None:
        env.update(
            DEEPINFER_TLS_CERT=str(directory / f"{name}.pem"), DEEPINFER_TLS_KEY=str(directory / f"{name}-key.pem")
        )
    return env


def use(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Make ``env`` this process's TLS settings (the unnamed ones unset)."""
    for var in VARS:
        if var in env:
            monkeypatch.setenv(var, env[var])
        else:
            monkeypatch.delenv(var, raising=False)


def refused(address: str) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        status(address, timeout=10)
    return e.value.code()


def test_certs_command_makes_a_ca_and_service_certificates(tmp_path: Path, capsys) -> None:
    d = tmp_path / "certs"
    assert (
        cli.main(["certs", str(d), "--host", "kv.example", "--host", "scheduler=sched.ns.svc", "--host", "10.0.0.7"])
        == 0
    )
    assert "DEEPINFER_TLS_CERT" in capsys.readouterr().out
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name in SERVICES:
        cert = x509.load_pem_x509_certificate((d / f"{name}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = san.get_values_for_type(x509.DNSName)
        assert {"localhost", name, "kv.example"} <= set(dns) and ("sched.ns.svc" in dns) == (name == "scheduler")
        assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "10.0.0.7"}
        assert stat.S_IMODE(os.stat(d / f"{name}-key.pem").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(d / "ca-key.pem").st_mode) == 0o600
    # run again: the CA is kept (certificates issued before stay valid), the named certificate is new
    assert cli.main(["certs", str(d), "--name", "operator"]) == 0
    assert (d / "ca.pem").read_bytes() == ca.public_bytes(Encoding.PEM)
    x509.load_pem_x509_certificate((d / "operator.pem").read_bytes()).verify_directly_issued_by(ca)


def test_settings_rules_and_exposure(certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = certs / "mesh"
    use(monkeypatch, {})
    assert tls.channel_credentials() is None and tls.server_credentials(True) is None
    with pytest.raises(RuntimeError, match="refusing to listen"):
        check_exposure("10.1.2.3", public=False, internal=True)
    use(monkeypatch, tls_env(d, "kvstore"))
    check_exposure("10.1.2.3", public=False, internal=True)  # mutual TLS is the internal credential
    with pytest.raises(RuntimeError, match="DEEPINFER_API_KEYS"):  # but no public client's: API keys are
        check_exposure("10.1.2.3", public=True, internal=False)
    use(monkeypatch, tls_env(d))  # the CA alone: a client, never a server
    assert tls.channel_credentials() is not None
    with pytest.raises(RuntimeError, match="DEEPINFER_TLS_CERT"):
        tls.server_credentials(False)
    use(monkeypatch, {"DEEPINFER_TLS_CA": str(d / "ca.pem"), "DEEPINFER_TLS_CERT": str(d / "worker.pem")})
    with pytest.raises(RuntimeError, match="set together"):
        tls.channel_credentials()
    use(monkeypatch, {**tls_env(d, "worker"), "DEEPINFER_TLS_KEY": str(d / "missing.pem")})
    with pytest.raises(RuntimeError, match="cannot read"):
        tls.channel_credentials()


def test_an_internal_service_takes_only_clients_with_a_certificate_of_the_mesh_ca(
    certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d, other = certs / "mesh", certs / "other"
    use(monkeypatch, tls_env(d, "scheduler"))  # this process: a client of the mesh with its own certificate
    m = Mesh(tmp_path, tmp_path, extra_env=tls_env(d, "kvstore"))
    try:
        m._serve("kvstore", ("kvstore",), lambda: ["services.kvstore", "--port", str(m.ports["kvstore"])])
        address = m.address("kvstore")
        assert health_status(address) == SERVING

        async def round_trip():
            async with KVStoreClient(address, timeout_s=30) as kv:  # the mesh's own channel (open_channel)
                await kv.put("fp", b"k" * 32, b"payload", {"position": 3}, "layout", resume_point=False)
                return await kv.get("fp", b"k" * 32, resume_point=False)

        data, meta = asyncio.run(round_trip())
        assert data == b"payload" and meta["position"] == "3"
        for why, env in {
            "no client certificate": tls_env(d),
            "a certificate of another CA": tls_env(other, "intruder", ca=d / "ca.pem"),
            "a client that trusts another CA": tls_env(other, "intruder"),
            "plaintext": {},
        }.items():
            use(monkeypatch, env)
            assert refused(address) == grpc.StatusCode.UNAVAILABLE, why
        use(monkeypatch, tls_env(d, "operator"))  # any certificate the CA signed gets in
        assert status(address) == SERVING
    finally:
        m.down()
    assert m.procs["kvstore"].returncode == 0, m.log("kvstore")


@dataclass
class TlsMesh(Mesh):
    """A mesh whose every service has its own certificate (``certs/NAME.pem``)."""

    certs: Path | None = None

    def start(self, name: str, args: list[str]) -> None:
        assert self.certs is not None
        self.extra_env.update(tls_env(self.certs, name))
        super().start(name, args)


def test_a_request_through_the_mesh_with_mutual_tls(certs: Path, tmp_path: Path, monkeypatch) -> None:
    d = certs / "mesh"
    model = make_tiny_model(tmp_path / "model", seed=3)
    use(monkeypatch, tls_env(d, "operator"))  # the test's probes (wait_serving, health_status) present a certificate
    m = TlsMesh(model, tmp_path, certs=d)
    try:
        m.up(http=False)
        assert all(health_status(m.address(n)) == SERVING for n in ("worker", "scheduler", "balancer"))
        # a public client: the CA to verify the balancer, no certificate of its own
        use(monkeypatch, tls_env(d))

        async def generate():
            async with client_channel(m.address("balancer")) as ch:
                return await collect(generation_pb2_grpc.GenerationStub(ch), gen_request([0, 4, 5], max_tokens=5))

        msgs, tokens, _ = asyncio.run(generate())
        assert len(tokens) == 5 and msgs[-1].HasField("finished")
        assert status(m.address("balancer")) == SERVING
        use(monkeypatch, tls_env(certs / "other", "intruder", ca=d / "ca.pem"))
        assert status(m.address("balancer")) == SERVING  # the public port asks for no client certificate at all
        use(monkeypatch, tls_env(d))
        assert refused(m.address("scheduler")) == grpc.StatusCode.UNAVAILABLE  # internal: a certificate or nothing
        assert refused(m.address("worker")) == grpc.StatusCode.UNAVAILABLE
        use(monkeypatch, {})
        assert refused(m.address("balancer")) == grpc.StatusCode.UNAVAILABLE  # plaintext: no
    finally:
        m.down()
    assert all(p.returncode == 0 for p in m.procs.values()), {n: m.log(n)[-2000:] for n in m.procs}
