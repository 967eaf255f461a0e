"""TLS material for the cluster's two trust boundaries, loaded once at the edge.

- **Inside** (router <-> workers): mutual TLS under one cluster CA. Every component
  presents the same cluster certificate (SAN :data:`CLUSTER_SERVER_NAME`, serverAuth and
  clientAuth) and accepts only peers whose certificate that CA signed. Workers bind IPs
  and ports that change (Ray, pods), so clients check the fixed name instead of the
  address (``grpc.ssl_target_name_override``). :class:`ClusterTLS` reads a directory
  holding :data:`CA_FILE`, :data:`CERT_FILE` and :data:`KEY_FILE` (``pdserve certs``
  writes one; on Kubernetes a Secret mounted there).
- **Outside** (clients -> router): :class:`ServerTLS`, a server certificate and key for
  the router's public gRPC and HTTP ports; clients are not asked for a certificate.
  Clients trust it through :func:`client_credentials`.

The KV channel between workers does not run over TLS (gloo has none): its joins and
offers carry an HMAC under the cluster secret (:func:`load_cluster_secret`; without a
secret file, :meth:`ClusterTLS.kv_secret` derives one from the cluster key, which every
component holds). Nothing here reads the environment; the CLI does, once.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc

CLUSTER_SERVER_NAME = "pdserve.cluster"
"""The DNS SAN of the cluster certificate, and the name every cluster client checks."""
CA_FILE, CERT_FILE, KEY_FILE = "ca.pem", "cluster.pem", "cluster-key.pem"
MIN_SECRET_BYTES = 16


class TLSError(ValueError):
    """TLS material that cannot be used; the message names the file and the fix."""


def _read(path: str | Path, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TLSError(f"cannot read the {what} {path}: {e.strerror or e}; make a development "
                       "set with `pdserve certs --out DIR`") from e
    if not data.strip():
        raise TLSError(f"the {what} {path} is empty")
    return data


def _kdf(secret: bytes, label: bytes) -> bytes:
    """A 32-byte key for one purpose (HKDF-extract with the label as salt)."""
    return hmac.new(label, secret, hashlib.sha256).digest()


@dataclass(frozen=True)
class ClusterTLS:
    """The cluster CA and this component's certificate and key (PEM bytes). Immutable;
    safe to share between threads."""

    ca: bytes = field(repr=False)
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    source: str = ""
    """Where it was read from, for messages."""

    @classmethod
    def from_dir(cls, directory: str | Path) -> ClusterTLS:
        d = Path(directory)
        if not d.is_dir():
            raise TLSError(f"cluster TLS directory {d} does not exist; it must hold {CA_FILE}, "
                           f"{CERT_FILE} and {KEY_FILE} (`pdserve certs --out {d}` makes them)")
        return cls(_read(d / CA_FILE, "cluster CA certificate"),
                   _read(d / CERT_FILE, "cluster certificate"),
                   _read(d / KEY_FILE, "cluster key"), str(d))

    def server_credentials(self) -> grpc.ServerCredentials:
        """For a worker's gRPC port: present the cluster certificate, and refuse every
        client that does not present one the cluster CA signed."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For the router's channels to workers: the client certificate, and the CA."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    @staticmethod
    def channel_options() -> list[tuple[str, str]]:
        """Check the peer's certificate for the fixed cluster name, whatever address it
        was dialled at."""
        return [("grpc.ssl_target_name_override", CLUSTER_SERVER_NAME)]

    def kv_secret(self) -> bytes:
        """The KV channel's key when no secret file is given, derived from the cluster
        key: every component holds the same key file, and no certificate reveals it."""
        return _kdf(self.key, b"pdserve kv-channel key from the cluster TLS key v1")


@dataclass(frozen=True)
class ServerTLS:
    """The router's public certificate and key. ``ssl_context`` reads the files again
    (``ssl`` takes paths only), once, when the HTTP site starts."""

    cert_path: str
    key_path: str
    cert: bytes = field(repr=False, default=b"")
    key: bytes = field(repr=False, default=b"")

    @classmethod
    def from_files(cls, cert_path: str | Path, key_path: str | Path) -> ServerTLS:
        return cls(str(cert_path), str(key_path), _read(cert_path, "TLS certificate"),
                   _read(key_path, "TLS key"))

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], require_client_auth=False)

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_path, self.key_path)
        except (OSError, ssl.SSLError) as e:
            raise TLSError(f"cannot load the TLS certificate {self.cert_path} with key "
                           f"{self.key_path}: {e}") from e
        return ctx


def load_ca(path: str | Path) -> bytes:
    return _read(path, "CA certificate")


def client_credentials(ca: bytes | None) -> grpc.ChannelCredentials:
    """A client's view of a TLS router: trust ``ca`` (None: the system's roots)."""
    return grpc.ssl_channel_credentials(root_certificates=ca)


def client_ssl_context(ca_path: str | Path) -> ssl.SSLContext:
    """An HTTPS client context trusting ``ca_path`` (for aiohttp and tests)."""
    return ssl.create_default_context(cafile=str(ca_path))


def load_cluster_secret(path: str | Path) -> bytes:
    """The KV channel's key from a secret file (surrounding whitespace ignored; at least
    :data:`MIN_SECRET_BYTES` bytes)."""
    raw = _read(path, "cluster secret file").strip()
    if len(raw) < MIN_SECRET_BYTES:
        raise TLSError(f"the cluster secret in {path} has {len(raw)} bytes; use at least "
                       f"{MIN_SECRET_BYTES} random bytes (`pdserve certs` writes 32, hex)")
    return _kdf(raw, b"pdserve kv-channel key from the cluster secret v1")
