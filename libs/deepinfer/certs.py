"""``deepinfer certs DIR``: a development certificate authority and one certificate per service, for mutual TLS
between the services (``DEEPINFER_TLS_CA`` / ``DEEPINFER_TLS_CERT`` / ``DEEPINFER_TLS_KEY``, docs/security.md).

DIR receives ``ca.pem`` and ``ca-key.pem`` (kept to issue more certificates later: an existing pair is reused)
and, per name, ``NAME.pem`` and ``NAME-key.pem``. Each certificate is good for both ends of a connection
(extended key usages serverAuth and clientAuth) and names ``localhost``, ``127.0.0.1``, its service's name and
every ``--host`` (``--host NAME=HOST``: in NAME's certificate only). Keys are ECDSA P-256, written readable by
their owner only. For production, issue certificates from your own CA (cert-manager, Vault ...) with the same
usages and names.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

SERVICES = ("balancer", "scheduler", "worker", "kvstore", "grammar")
CA_NAME = "deepinfer development CA"

__all__ = ["SERVICES", "add_parser", "issue", "make_ca", "write_certs"]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "deepinfer"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])  # fmt: skip


def make_ca(days: int = 3650) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new self-signed CA (key and certificate) that may only sign end-entity certificates."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key, now = _key(), _now()
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(CA_NAME))
        .issuer_name(_name(CA_NAME))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _usage(cert_sign: bool) -> x509.KeyUsage:
    from cryptography import x509

    return x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign, crl_sign=cert_sign,
                         encipher_only=False, decipher_only=False)  # fmt: skip


def _alt_names(names: Iterable[str]) -> list[x509.GeneralName]:
    """DNS names and IP addresses, each once, in order."""
    from cryptography import x509

    out: list[x509.GeneralName] = []
    for n in dict.fromkeys(n.strip() for n in names if n.strip()):
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(n.strip("[]"))))
        except ValueError:
            out.append(x509.DNSName(n))
    return out


def issue(
    ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, name: str, hosts: Sequence[str] = (), days: int = 825
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A key and a certificate for service ``name``, signed by the CA: serverAuth and clientAuth, with subject
    alternative names ``localhost``, ``127.0.0.1``, ``name`` and ``hosts``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key, now = _key(), _now()
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key())  # type: ignore[arg-type]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=days), ca.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName(_alt_names(["localhost", "127.0.0.1", name, *hosts])), False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(aki, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _pem(obj: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    if hasattr(obj, "private_bytes"):
        return obj.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    return obj.public_bytes(serialization.Encoding.PEM)


def _write(path: Path, data: bytes, private: bool) -> None:
    """Write ``data`` to ``path`` through a temporary file (owner-only when ``private``), then rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _load_ca(directory: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate] | None:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert_path, key_path = directory / "ca.pem", directory / "ca-key.pem"
    if not (cert_path.exists() and key_path.exists()):
        return None
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    return key, x509.load_pem_x509_certificate(cert_path.read_bytes())  # type: ignore[return-value]


def write_certs(
    directory: Path, names: Sequence[str] = SERVICES, hosts: Sequence[str] = (), days: int = 825
) -> list[Path]:
    """Write the CA (reusing ``ca.pem`` / ``ca-key.pem`` already in ``directory``) and a certificate and key per
    name, each naming ``hosts`` (``NAME=HOST``: only NAME's); returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    ca = _load_ca(directory)
    if ca is None:
        ca = make_ca()
        _write(directory / "ca-key.pem", _pem(ca[0]), private=True)
        _write(directory / "ca.pem", _pem(ca[1]), private=False)
        written += [directory / "ca.pem", directory / "ca-key.pem"]
    for name in dict.fromkeys(names):
        own = [h.partition("=")[2] if "=" in h else h for h in hosts if "=" not in h or h.startswith(name + "=")]
        key, cert = issue(ca[0], ca[1], name, own, days)
        _write(directory / f"{name}-key.pem", _pem(key), private=True)
        _write(directory / f"{name}.pem", _pem(cert), private=False)
        written += [directory / f"{name}.pem", directory / f"{name}-key.pem"]
    return written


def cmd_certs(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    reused = (directory / "ca.pem").exists() and (directory / "ca-key.pem").exists()
    names = args.name or list(SERVICES)
    for path in write_certs(directory, names, args.host, args.days):
        print(f"wrote {path}")
    if reused:
        print(f"signed with the CA already in {directory} (ca.pem, ca-key.pem)")
    first = names[0]
    print(
        f"a service uses its own pair, e.g. {first}:\n"
        f"  DEEPINFER_TLS_CA={directory / 'ca.pem'} DEEPINFER_TLS_CERT={directory / (first + '.pem')} "
        f"DEEPINFER_TLS_KEY={directory / (first + '-key.pem')}\n"
        "keep ca-key.pem away from the services: it signs certificates (docs/security.md)"
    )
    return 0


def add_parser(sub: Any) -> None:
    """Register ``deepinfer certs`` on the CLI's subparsers."""
    s = sub.add_parser("certs", help="make a development CA and the services' TLS certificates in DIR")
    s.add_argument("dir", help="directory for ca.pem, ca-key.pem, NAME.pem and NAME-key.pem")
    s.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="NAME",
        help="another DNS name or IP address in every certificate, or NAME=HOST in NAME's only (repeatable; "
        "e.g. compose or k8s service names)",
    )
    s.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="NAME",
        help=f"issue for these names instead of the services ({', '.join(SERVICES)}); repeatable",
    )
    s.add_argument("--days", type=int, default=825, help="validity of the service certificates (default 825)")
    s.set_defaults(func=cmd_certs)
