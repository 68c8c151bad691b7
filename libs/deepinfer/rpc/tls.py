"""TLS of the mesh's gRPC traffic, from ``DEEPINFER_TLS_CA`` / ``DEEPINFER_TLS_CERT`` / ``DEEPINFER_TLS_KEY``.

* None set: plaintext (every function here answers None).
* All three: mutual TLS. A service's certificate is both its server certificate and its client certificate;
  internal servers require a client certificate signed by the CA, channels verify the server against the CA.
  A server whose services are all public (the balancer's ``deepinfer.v1.Generation``) asks for no client
  certificate: API keys authenticate public clients.
* The CA alone: a client that verifies servers but presents no certificate (``deepinfer generate``, probes of
  the balancer's public port). A server cannot start that way.

The files are read each time credentials are made (a server's start, a channel's opening), so replaced
certificates take effect on restart (servers) or on the next channel.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from deepinfer import envs

__all__ = ["TlsFiles", "channel_credentials", "enabled", "server_credentials", "tls_files"]


@dataclass(frozen=True)
class TlsFiles:
    """The PEM bytes of the configured CA and, when set, of this service's certificate and key."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None


def _read(name: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RuntimeError(f"{name}={path}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN" not in data:
        raise RuntimeError(f"{name}={path}: not a PEM file")
    return data


def enabled() -> bool:
    """Whether TLS is configured (``DEEPINFER_TLS_CA`` set)."""
    return envs.DEEPINFER_TLS_CA is not None


def tls_files() -> TlsFiles | None:
    """The configured files' contents; None when TLS is off; RuntimeError when the settings are incomplete or a
    file cannot be read."""
    ca, cert, key = envs.DEEPINFER_TLS_CA, envs.DEEPINFER_TLS_CERT, envs.DEEPINFER_TLS_KEY
    if ca is None:
        if cert is not None or key is not None:
            raise RuntimeError("DEEPINFER_TLS_CERT / DEEPINFER_TLS_KEY are set without DEEPINFER_TLS_CA")
        return None
    if (cert is None) != (key is None):
        raise RuntimeError("DEEPINFER_TLS_CERT and DEEPINFER_TLS_KEY must be set together")
    return TlsFiles(
        _read("DEEPINFER_TLS_CA", ca),
        None if cert is None else _read("DEEPINFER_TLS_CERT", cert),
        None if key is None else _read("DEEPINFER_TLS_KEY", key),
    )


def channel_credentials() -> grpc.ChannelCredentials | None:
    """Credentials of a channel: verify the server against the CA, present this service's certificate when one
    is configured; None when TLS is off."""
    files = tls_files()
    if files is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=files.ca, private_key=files.key, certificate_chain=files.cert)


def server_credentials(require_client_auth: bool) -> grpc.ServerCredentials | None:
    """Credentials of a server (its certificate; clients' certificates verified against the CA, and required
    with ``require_client_auth``); None when TLS is off."""
    files = tls_files()
    if files is None:
        return None
    if files.cert is None or files.key is None:
        raise RuntimeError(
            "DEEPINFER_TLS_CA is set but a service also needs its own certificate: set DEEPINFER_TLS_CERT and "
            "DEEPINFER_TLS_KEY (deepinfer certs DIR makes them)"
        )
    return grpc.ssl_server_credentials(
        [(files.key, files.cert)], root_certificates=files.ca, require_client_auth=require_client_auth
    )
