"""The test cluster's keys: a CA, the API server's serving certificate, the service-account signing key."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class ClusterPki:
    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    service_account_key: Path


def _write_key(path: Path, key) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _certificate(subject: str, key, issuer_name, issuer_key, *, ca: bool, sans=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def create_pki(folder: Path, extra_ips: Sequence[str] = ()) -> ClusterPki:
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("capstan-test-ca", ca_key, None, ca_key, ca=True)
    serving_key = ec.generate_private_key(ec.SECP256R1())
    sans = [
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes.default.svc"),
        *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in dict.fromkeys(["127.0.0.1", "10.96.0.1", *extra_ips])),
    ]
    serving = _certificate("kube-apiserver", serving_key, ca.subject, ca_key, ca=False, sans=sans)
    pki = ClusterPki(folder / "ca.crt", folder / "apiserver.crt", folder / "apiserver.key", folder / "sa.key")
    pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    pki.serving_cert.write_bytes(serving.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.serving_key, serving_key)
    _write_key(pki.service_account_key, rsa.generate_private_key(public_exponent=65537, key_size=2048))
    return pki
