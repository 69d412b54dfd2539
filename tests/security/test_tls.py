"""TCP only with TLS (or an explicit --insecure-tcp), and mutual TLS when a
client CA is given."""

import datetime
import ipaddress
import socket
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tierd.client import Client, KVSpec, Unavailable
from tierd.testing import ROOT, Daemon


def _cert(name, issuer=None, issuer_key=None, ca=False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()), cert, key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca_pem, _, ca, ca_key = _cert("tierd test CA", ca=True)
    server_pem, server_key, _, _ = _cert("localhost", ca.subject, ca_key)
    client_pem, client_key, _, _ = _cert("engine", ca.subject, ca_key)
    files = {"ca": ca_pem, "server.crt": server_pem, "server.key": server_key, "client.crt": client_pem,
             "client.key": client_key}
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tls_on_tcp(tmp_path, pki):
    port = free_port()
    d = Daemon(tmp_path, "--listen", f"127.0.0.1:{port}", "--tls-cert", str(pki / "server.crt"),
               "--tls-key", str(pki / "server.key")).start()
    try:
        with Client(f"127.0.0.1:{port}", tls_ca=str(pki / "ca")) as c:
            c.put("s", b"over tls", KVSpec.opaque("m"), num_tokens=1)
            assert c.get("s") == b"over tls"
        with Client(f"127.0.0.1:{port}", timeout=5) as plain:  # no TLS: the handshake fails
            with pytest.raises(Unavailable):
                plain.stat("s")
        assert "(TLS)" in d.log()
    finally:
        d.close()


def test_mutual_tls_requires_a_client_certificate(tmp_path, pki):
    port = free_port()
    d = Daemon(tmp_path, "--listen", f"127.0.0.1:{port}", "--tls-cert", str(pki / "server.crt"),
               "--tls-key", str(pki / "server.key"), "--tls-client-ca", str(pki / "ca")).start()
    try:
        with Client(f"127.0.0.1:{port}", tls_ca=str(pki / "ca"), timeout=5) as anonymous:
            with pytest.raises(Unavailable):
                anonymous.stats()
        with Client(f"127.0.0.1:{port}", tls_ca=str(pki / "ca"), tls_cert=str(pki / "client.crt"),
                    tls_key=str(pki / "client.key")) as c:
            assert c.stats()["version"]
    finally:
        d.close()


def test_tcp_without_tls_is_refused_unless_asked_for(tmp_path):
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "tierd", "serve", "--listen", f"127.0.0.1:{port}", "--data-dir",
                          str(tmp_path / "data"), "--socket", str(tmp_path / "s.sock"), "--metrics", "off"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "needs TLS" in out.stderr
    d = Daemon(tmp_path, "--listen", f"127.0.0.1:{port}", "--insecure-tcp").start()
    try:
        assert "without TLS (--insecure-tcp)" in d.log()
        with Client(f"127.0.0.1:{port}") as c:
            assert c.stats()["version"]
    finally:
        d.close()
