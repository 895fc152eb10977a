"""`capstan gateway --ssl-keyfile/--ssl-certfile` through the openai client: a client trusting the test CA connects,
one trusting another CA is refused, a broken certificate file keeps the one in force, and a renewed certificate
(signed by a new CA, written over the same files) is served without a restart. Also: bad TLS flags are a clear
message, not a stack trace."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

sys.path.insert(0, str(Path(__file__).parent))

from processes import start_gateway  # noqa: E402

from capstan.runtime.server.tls import RELOAD_SECONDS  # noqa: E402


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(folder: Path, name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert, folder / f"{name}.pem"


def issue(ca, keyfile: Path, certfile: Path) -> None:
    """A serving certificate for 127.0.0.1 signed by `ca`, written over the two files."""
    ca_key, ca_cert, _ = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("capstan-gateway"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    keyfile.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def client_trusting(url: str, ca_file: Path) -> openai.OpenAI:
    verify = ssl.create_default_context(cafile=str(ca_file))
    return openai.OpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=10,
        http_client=openai.DefaultHttpxClient(verify=verify),
    )


def models(url: str, ca_file: Path) -> list[str]:
    return [m.id for m in client_trusting(url, ca_file).models.list().data]


def test_tls_with_a_test_ca_refuses_other_cas_and_reloads_a_renewed_certificate(tmp_path):
    first, second = make_ca(tmp_path, "ca-one"), make_ca(tmp_path, "ca-two")
    keyfile, certfile = tmp_path / "tls.key", tmp_path / "tls.crt"
    issue(first, keyfile, certfile)
    gateway = start_gateway(["tiny=http://127.0.0.1:9"], "--ssl-keyfile", str(keyfile), "--ssl-certfile", str(certfile))
    gateway.url = gateway.url.replace("http://", "https://")
    try:
        deadline = time.monotonic() + 30
        while True:  # processes.wait_ready speaks plain HTTP: wait through the openai client instead
            try:
                assert models(gateway.url, first[2]) == ["tiny"]
                break
            except openai.APIConnectionError:
                assert gateway.process.poll() is None and time.monotonic() < deadline, gateway.output()
                time.sleep(0.2)
        with pytest.raises(openai.APIConnectionError) as refused:
            models(gateway.url, second[2])
        assert (
            "CERTIFICATE_VERIFY_FAILED" in repr(refused.value.__cause__)
            or "certificate" in repr(refused.value.__cause__).lower()
        )
        with pytest.raises(openai.APIConnectionError):  # plain HTTP to a TLS port gets nowhere
            openai.OpenAI(
                base_url=gateway.url.replace("https://", "http://") + "/v1", api_key="x", max_retries=0, timeout=5
            ).models.list()

        certfile.write_text("-----BEGIN CERTIFICATE-----\nhalf written")
        time.sleep(RELOAD_SECONDS + 1.5)
        assert models(gateway.url, first[2]) == ["tiny"]  # the broken file changed nothing

        issue(second, keyfile, certfile)  # renewed in place, as a Secret mounted from cert-manager is
        deadline = time.monotonic() + RELOAD_SECONDS * 3
        while True:
            try:
                assert models(gateway.url, second[2]) == ["tiny"]
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the renewed certificate was not served"
                time.sleep(0.5)
        with pytest.raises(openai.APIConnectionError):
            models(gateway.url, first[2])
        assert gateway.process.poll() is None  # the same process throughout
    finally:
        gateway.stop()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--ssl-keyfile", "/nonexistent.key"], "--ssl-certfile is required with --ssl-keyfile"),
        (["--ssl-keyfile", "/nonexistent.key", "--ssl-certfile", "/nonexistent.crt"], "no such file"),
    ],
)
def test_bad_tls_flags_are_a_message_not_a_stack_trace(flags, words):
    result = subprocess.run(
        [sys.executable, "-m", "capstan.runtime.cli", "gateway", "--replica", "http://127.0.0.1:9", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and words in result.stderr and "Traceback" not in result.stderr, result.stderr
