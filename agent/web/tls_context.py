"""The HTTP listener's TLS: an ``ssl.SSLContext`` built from a web configuration file's
``tls_server_config`` (the schema of Prometheus's exporter-toolkit, Go names and all).

Where Python's ``ssl`` module and Go's crypto/tls differ, the difference is refused with a message
rather than approximated:

* ``RequestClientCert`` and ``RequireAnyClientCert`` accept client certificates without verifying them;
  OpenSSL through Python verifies every certificate it asks for, so only ``NoClientCert``,
  ``VerifyClientCertIfGiven`` and ``RequireAndVerifyClientCert`` are offered.
* ``cipher_suites`` (Go's names) map to OpenSSL's names and apply to TLS 1.2 and older, as in Go; the
  TLS 1.3 suites are not configurable in either, and listing one is accepted.
* ``curve_preferences`` can name one curve (Python sets a single ECDH curve); a list is refused.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import ssl
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
CLIENT_AUTH_TYPES = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                     "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
UNVERIFIED_CLIENT_AUTH_TYPES = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
# Go's names (crypto/tls CipherSuites(), the secure ones) -> OpenSSL's. None: a TLS 1.3 suite, always on.
CIPHER_SUITES: dict[str, str | None] = {
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",  # Go's older names
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
}
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}


class TlsConfigError(ValueError):
    """A tls_server_config that cannot be served; the message names the key."""


def build_server_context(*, cert_file: Path | None, key_file: Path | None, cert: str | None = None,
                         key: str | None = None, client_ca_file: Path | None = None,
                         client_ca: str | None = None, client_auth_type: str = "NoClientCert",
                         min_version: str = "TLS12", max_version: str = "TLS13",
                         cipher_suites: Sequence[str] = (), curve_preferences: Sequence[str] = (),
                         prefer_server_cipher_suites: bool = True) -> ssl.SSLContext:
    """A server-side SSLContext; TlsConfigError names what cannot be used (a file it cannot read
    included). A certificate and key are given as files or inline PEM, not both."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _version("min_version", min_version)
    context.maximum_version = _version("max_version", max_version)
    if context.minimum_version > context.maximum_version:
        raise TlsConfigError(f"min_version {min_version} is newer than max_version {max_version}")
    if prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    _load_key_pair(context, cert_file, key_file, cert, key)
    _set_client_auth(context, client_auth_type, client_ca_file, client_ca)
    _set_ciphers(context, cipher_suites)
    _set_curve(context, curve_preferences)
    return context


def _version(key: str, name: str) -> ssl.TLSVersion:
    try:
        return TLS_VERSIONS[name]
    except KeyError:
        raise TlsConfigError(f"{key}: unknown TLS version {name!r}; one of {', '.join(TLS_VERSIONS)}"
                             ) from None


def _load_key_pair(context: ssl.SSLContext, cert_file: Path | None, key_file: Path | None,
                   cert: str | None, key: str | None) -> None:
    if (cert_file is None) == (cert is None):
        raise TlsConfigError("set one of cert_file and cert (inline PEM)")
    if (key_file is None) == (key is None):
        raise TlsConfigError("set one of key_file and key (inline PEM)")
    for path in (cert_file, key_file):
        _check_readable(path)
    with _pem_path(cert_file, cert) as cert_path, _pem_path(key_file, key) as key_path:
        try:
            context.load_cert_chain(cert_path, key_path)
        except ssl.SSLError as err:
            raise TlsConfigError(f"the certificate and key cannot be loaded as a pair "
                                 f"({_files(cert_file, key_file)}): {err.reason or err}") from None
        except OSError as err:
            raise TlsConfigError(f"cannot load the certificate and key ({_files(cert_file, key_file)}): "
                                 f"{err.strerror or err}") from None


def _check_readable(path: Path | None) -> None:
    """OpenSSL's errors do not name the file; this does."""
    if path is None:
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise TlsConfigError(f"cannot read {path}: {err.strerror or err}") from None


def _files(*paths: Path | None) -> str:
    return ", ".join(str(p) if p is not None else "inline" for p in paths)


def _set_client_auth(context: ssl.SSLContext, auth_type: str, ca_file: Path | None, ca: str | None) -> None:
    if auth_type in UNVERIFIED_CLIENT_AUTH_TYPES:
        raise TlsConfigError(f"client_auth_type {auth_type} accepts client certificates without verifying "
                             "them, which this server does not offer; use RequireAndVerifyClientCert (or "
                             "VerifyClientCertIfGiven) with client_ca_file")
    if auth_type not in CLIENT_AUTH_TYPES:
        raise TlsConfigError(f"client_auth_type: unknown value {auth_type!r}; one of "
                             f"{', '.join(CLIENT_AUTH_TYPES)}")
    if ca_file is not None and ca is not None:
        raise TlsConfigError("set one of client_ca_file and client_ca (inline PEM), not both")
    has_ca = ca_file is not None or ca is not None
    if auth_type == "NoClientCert":
        if has_ca:
            raise TlsConfigError("client CAs are configured without a client_auth_type: set "
                                 "client_auth_type: RequireAndVerifyClientCert to verify client certificates")
        return
    if not has_ca:
        raise TlsConfigError(f"client_auth_type {auth_type} needs client_ca_file (the CA that client "
                             "certificates must chain to)")
    if ca_file is not None:
        _check_readable(ca_file)
        try:
            context.load_verify_locations(cafile=str(ca_file))
        except OSError as err:
            raise TlsConfigError(f"cannot read client_ca_file {ca_file}: {err.strerror or err}") from None
        except ssl.SSLError as err:
            raise TlsConfigError(f"client_ca_file {ca_file} holds no usable certificate: {err.reason or err}"
                                 ) from None
    else:
        try:
            context.load_verify_locations(cadata=ca)
        except ssl.SSLError as err:
            raise TlsConfigError(f"client_ca holds no usable certificate: {err.reason or err}") from None
    context.verify_mode = CLIENT_AUTH_TYPES[auth_type]


def _known(key: str, what: str, names: Sequence[str], known: Collection[str]) -> None:
    unknown = [name for name in names if name not in known]
    if unknown:
        raise TlsConfigError(f"{key}: unknown {what} {', '.join(map(repr, unknown))}; the known ones are "
                             f"{', '.join(known)}")


def _set_ciphers(context: ssl.SSLContext, names: Sequence[str]) -> None:
    if not names:
        return
    _known("cipher_suites", "or insecure suite", names, CIPHER_SUITES)
    openssl = [CIPHER_SUITES[name] for name in names if CIPHER_SUITES[name] is not None]
    if not openssl:  # TLS 1.3 suites only: TLS 1.2 keeps OpenSSL's defaults, as Go's does
        return
    try:
        context.set_ciphers(":".join(name for name in openssl if name))
    except ssl.SSLError as err:
        raise TlsConfigError(f"cipher_suites: none of them can be used: {err.reason or err}") from None


def _set_curve(context: ssl.SSLContext, names: Sequence[str]) -> None:
    if not names:
        return
    _known("curve_preferences", "curve", names, CURVES)
    if len(names) > 1:
        raise TlsConfigError("curve_preferences: name one curve; this server can restrict ECDH to a single "
                             "curve, not to a preference list")
    try:
        context.set_ecdh_curve(CURVES[names[0]])
    except (ValueError, ssl.SSLError) as err:
        raise TlsConfigError(f"curve_preferences: {names[0]} cannot be used: {err}") from None


@contextlib.contextmanager
def _pem_path(path: Path | None, inline: str | None) -> Iterator[str]:
    """The file to load: ``path``, or inline PEM through an anonymous in-memory file (never on disk)."""
    if path is not None:
        yield str(path)
        return
    assert inline is not None
    fd = os.memfd_create("gpuscope-pem", os.MFD_CLOEXEC)
    try:
        os.write(fd, inline.encode("utf-8"))
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def peer_sans(certificate: dict[str, Any] | None) -> list[str]:
    """A verified peer certificate's subject alternative names as Go writes them: DNS names, e-mail
    addresses, IP addresses in canonical form, URIs."""
    names = []
    for kind, value in (certificate or {}).get("subjectAltName", ()):
        if kind == "IP Address":
            try:
                names.append(str(ipaddress.ip_address(value.strip())))
            except ValueError:
                names.append(value)
        elif kind in ("DNS", "email", "URI"):
            names.append(value)
    return names
