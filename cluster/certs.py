"""``pdserve certs``: a development PKI for one cluster, made with ``cryptography``.

What it writes into ``--out DIR`` (keys and the secret 0600, the directory 0700)::

    ca.pem, ca-key.pem            the cluster CA (EC P-256, self-signed, path length 0)
    cluster.pem, cluster-key.pem  the certificate every component presents inside the
                                  cluster: SAN pdserve.cluster, serverAuth + clientAuth
    router.pem, router-key.pem    the router's public certificate: SANs localhost,
                                  127.0.0.1, ::1 and every --hosts name or address
    cluster-secret                32 random bytes, hex: the KV channel's key

``--cluster-tls-dir DIR`` (workers, router, ``pdserve up``) reads ca.pem, cluster.pem and
cluster-key.pem from it; ``--tls-cert DIR/router.pem --tls-key DIR/router-key.pem`` and
clients' ``--tls-ca DIR/ca.pem`` the rest. The CA key never has to leave the machine
that made the set: deploy only the files above it. P-256 because every TLS stack
(gRPC's BoringSSL, OpenSSL, browsers) takes it. Refuses to overwrite an existing set
unless ``force``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.tls import CA_FILE, CERT_FILE, CLUSTER_SERVER_NAME, KEY_FILE

CA_KEY_FILE = "ca-key.pem"
ROUTER_CERT_FILE, ROUTER_KEY_FILE = "router.pem", "router-key.pem"
SECRET_FILE = "cluster-secret"
FILES = (CA_FILE, CA_KEY_FILE, CERT_FILE, KEY_FILE, ROUTER_CERT_FILE, ROUTER_KEY_FILE,
         SECRET_FILE)
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")


class CertsError(ValueError):
    """The set cannot be written; the message says why and what to do."""


@dataclass(frozen=True)
class DevPKI:
    """Where ``make_dev_pki`` wrote each file."""

    directory: Path
    ca: Path
    ca_key: Path
    cluster_cert: Path
    cluster_key: Path
    router_cert: Path
    router_key: Path
    secret: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: Sequence[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):  # keep order, drop repeats
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _leaf(subject: str, key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
          ca_key: ec.EllipticCurvePrivateKey, hosts: Sequence[str],
          usages: Sequence[x509.ObjectIdentifier], start: datetime.datetime,
          days: int) -> x509.Certificate:
    return (x509.CertificateBuilder()
            .subject_name(_name(subject)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False,
                                         content_commitment=False, data_encipherment=False,
                                         key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))


def _write(path: Path, data: bytes, private: bool) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    fd = os.open(path, flags, 0o600 if private else 0o644)
    try:
        os.fchmod(fd, 0o600 if private else 0o644)  # an existing file keeps no wider mode
        os.write(fd, data)
    finally:
        os.close(fd)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_dev_pki(out: str | Path, hosts: Sequence[str] = (), *, days: int = 365,
                 force: bool = False, now: datetime.datetime | None = None) -> DevPKI:
    """Write a development CA, the cluster and router certificates and a cluster secret
    into ``out`` (created 0700). Raises CertsError if any of the files exists and
    ``force`` is not set (nothing is written then)."""
    if days < 1:
        raise CertsError(f"--days must be >= 1, got {days}")
    d = Path(out)
    existing = [f for f in FILES if (d / f).exists()]
    if existing and not force:
        raise CertsError(f"{d} already holds {', '.join(existing)}; pass --force to replace "
                         "the whole set (every component must then get the new files)")
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    start = (now or datetime.datetime.now(datetime.timezone.utc)) - datetime.timedelta(minutes=5)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder()
               .subject_name(_name("pdserve development CA"))
               .issuer_name(_name("pdserve development CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start)
               .not_valid_after(start + datetime.timedelta(days=days + 1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, key_encipherment=False,
                                            content_commitment=False, data_encipherment=False,
                                            key_agreement=False, key_cert_sign=True,
                                            crl_sign=True, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()),
                              critical=False)
               .sign(ca_key, hashes.SHA256()))
    cluster_key = ec.generate_private_key(ec.SECP256R1())
    cluster_cert = _leaf("pdserve cluster component", cluster_key, ca_cert, ca_key,
                         [CLUSTER_SERVER_NAME],
                         [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                         start, days)
    router_key = ec.generate_private_key(ec.SECP256R1())
    router_cert = _leaf("pdserve router", router_key, ca_cert, ca_key,
                        [*DEFAULT_HOSTS, *hosts], [ExtendedKeyUsageOID.SERVER_AUTH], start, days)
    pki = DevPKI(d, d / CA_FILE, d / CA_KEY_FILE, d / CERT_FILE, d / KEY_FILE,
                 d / ROUTER_CERT_FILE, d / ROUTER_KEY_FILE, d / SECRET_FILE)
    pem = serialization.Encoding.PEM
    _write(pki.ca_key, _pem_key(ca_key), private=True)
    _write(pki.ca, ca_cert.public_bytes(pem), private=False)
    _write(pki.cluster_key, _pem_key(cluster_key), private=True)
    _write(pki.cluster_cert, cluster_cert.public_bytes(pem), private=False)
    _write(pki.router_key, _pem_key(router_key), private=True)
    _write(pki.router_cert, router_cert.public_bytes(pem), private=False)
    _write(pki.secret, secrets.token_hex(32).encode() + b"\n", private=True)
    return pki
