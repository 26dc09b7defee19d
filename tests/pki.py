"""A throwaway PKI for the TLS tests: a CA, a server certificate for localhost/127.0.0.1 and client
certificates, as PEM files (made with ``cryptography``, which the test extra installs)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(folder: Path, *, client_dns_names: tuple[str, ...] = ()) -> Pki:
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate (with
    ``client_dns_names`` as its subject alternative names), as PEM files."""
    if not os.environ.get("CI"):  # in CI the test extra installs it: a skip there would hide the TLS tests
        pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    usage = x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False)
    ca = (x509.CertificateBuilder().subject_name(name("gpuscope test CA"))
          .issuer_name(name("gpuscope test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(usage, critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage: Any, sans: list[x509.GeneralName]) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), key_pem(key)

    server_cert, server_key = leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH,
                                   [x509.DNSName("localhost"),
                                    x509.IPAddress(ipaddress.IPv4Address("127.0.0.1"))])
    client_cert, client_key = leaf("fleet-controller", ExtendedKeyUsageOID.CLIENT_AUTH,
                                   [x509.DNSName(name) for name in client_dns_names])
    folder.mkdir(parents=True, exist_ok=True)
    files = {"ca.crt": ca.public_bytes(serialization.Encoding.PEM), "server.crt": server_cert,
             "server.key": server_key, "client.crt": client_cert, "client.key": client_key}
    for file_name, data in files.items():
        (folder / file_name).write_bytes(data)
        (folder / file_name).chmod(0o600)
    return Pki(folder / "ca.crt", folder / "server.crt", folder / "server.key", folder / "client.crt",
               folder / "client.key")
