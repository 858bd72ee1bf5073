"""Cluster TLS: every gRPC link of a cluster is mutual TLS that the cluster secret authenticates.

The secret never leaves a process.  Each process derives the same cluster CA
from it and certifies a fresh key of its own; peers then prove they hold the
secret inside the TLS 1.3 handshake, a challenge-response over fresh nonces
(each side signs the handshake transcript, which includes both sides' random
values, with a key whose certificate only a secret holder can issue).

Derivation (one per process, ~0.2 s and 64 MiB on a 2-core EPYC):

* ``seed = scrypt(secret, salt=b"mlxcluster-ca-v1:" + cluster, n=2**16, r=8, p=1, 32 bytes)``
  (RFC 7914; ``cryptography``'s ``Scrypt``).
* CA key: the NIST P-256 private key whose scalar is ``seed mod (n - 1) + 1``
  (``ec.derive_private_key``), self-signed CA certificate ``CN=mlxcluster cluster CA``
  valid 2020-01-01 .. 2100-01-01 (a fixed window: clocks of LAN machines disagree).
* Leaf: a fresh P-256 key per process, certificate signed by the CA key, DNS
  SANs ``mlxcluster`` (:data:`ANY_MEMBER`) plus the process's identities (a node
  daemon adds :func:`node_name` of its node id), extended key usage server and
  client authentication.

Every server requires a client certificate chained to the CA
(``require_client_auth``); every client checks the server's chain and the SAN it
expects (``grpc.ssl_target_name_override``): :data:`ANY_MEMBER` for rank 0's
``Generation`` and the ranks' ``RankControl``, :func:`node_name` of a node id
for a node's ``Node`` service, so an advertisement that points a node id at
another endpoint is refused unless that endpoint proves that node id.

Offline guessing: anyone who completes a TCP connection sees a leaf certificate
signed by the CA key, so a guess can be tested, at the price of one scrypt: ~5
guesses per second per core here, where the old static HMAC tag in the mDNS
record allowed ~280,000.  Use a secret with real entropy
(:func:`new_secret`, ``mlxcluster secret``); local clusters get a random one.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import os
import secrets as _secrets
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["ANY_MEMBER", "CLIENT", "Credentials", "SecretError", "credentials", "new_secret", "node_name",
           "read_secret", "ca_seed", "rank_environment", "describe_rpc_error", "handshake_failed", "SCRYPT_N", "self_signed", "fingerprint"]

#: DNS SAN every member certificate carries; the name a client expects from rank 0 and ranks N.
ANY_MEMBER = "mlxcluster"
#: Extra SAN of a client-only certificate (``generate --cluster``, ``serve``, ``status``).
CLIENT = "client.mlxcluster"
#: gRPC reconnect back-off of cluster channels (ms): first retry, and the cap (gRPC's defaults: 1000, 120000).
RECONNECT_BACKOFF_INITIAL_MS = 250
RECONNECT_BACKOFF_MAX_MS = 1000
#: scrypt cost parameter N (RFC 7914 section 2); r = 8, p = 1.
SCRYPT_N = 2 ** 16
_SALT = b"mlxcluster-ca-v1:"
_NOT_BEFORE = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
_NOT_AFTER = datetime.datetime(2100, 1, 1, tzinfo=datetime.timezone.utc)
# NIST P-256 group order (SEC 2, section 2.4.2).
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
#: Smallest secret accepted, in bytes of UTF-8.
MIN_SECRET_BYTES = 8


class SecretError(ValueError):
    """A cluster secret that is missing, too short or unreadable (one-line message)."""


def new_secret() -> str:
    """A fresh random cluster secret: 128 bits from :mod:`secrets`, as 32 hex digits."""
    return _secrets.token_hex(16)


def read_secret(value: Optional[str] = None, path: Optional[str] = None, *, required: bool = True) -> str:
    """The cluster secret from ``--secret-file`` (``path``) or the environment (``value``,
    i.e. ``MLXCLUSTER_SECRET``), never from argv.

    The file's first line is the secret (surrounding whitespace stripped); it must
    not be readable by other users (mode ``0o600`` or stricter, like ssh keys).

    Raises:
        SecretError: both given, the file is missing, unreadable or readable by others,
            the secret is shorter than :data:`MIN_SECRET_BYTES`, or none is given and
            ``required``.
    """
    if value and path:
        raise SecretError("give the cluster secret once: --secret-file or MLXCLUSTER_SECRET, not both")
    if path:
        try:
            st = os.stat(path)
            if st.st_mode & 0o077:
                raise SecretError(f"secret file {path} is readable by other users (chmod 600 {path})")
            with open(path, encoding="utf-8") as f:
                value = f.readline().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SecretError(f"cannot read secret file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not value:
        if required:
            raise SecretError("a cluster secret is required: set MLXCLUSTER_SECRET or pass --secret-file "
                              "(`mlxcluster secret` prints a new one)")
        return ""
    if len(value.encode("utf-8", "surrogatepass")) < MIN_SECRET_BYTES:
        raise SecretError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
    return value


def node_name(node_id: str) -> str:
    """The DNS SAN that proves ``node_id``: ``n<32 hex of SHA-256(node id)>.node.mlxcluster``
    (node ids may hold characters that DNS names may not)."""
    return f"n{hashlib.sha256(node_id.encode('utf-8', 'surrogatepass')).hexdigest()[:32]}.node.{ANY_MEMBER}"


@functools.lru_cache(maxsize=4)
def ca_seed(secret: str, cluster: str) -> str:
    """The cluster CA's seed as 64 hex digits: ``scrypt(secret, salt=b"mlxcluster-ca-v1:" + cluster,
    N=2**16, r=8, p=1)`` (RFC 7914; the module docstring).  As secret as the secret for this cluster
    (it derives the CA key): handed only to the cluster's own rank processes, in their environment
    (:func:`rank_environment`)."""
    return Scrypt(salt=_SALT + cluster.encode("utf-8", "surrogatepass"), length=32, n=SCRYPT_N, r=8,
                  p=1).derive(secret.encode("utf-8", "surrogatepass")).hex()


def rank_environment(secret: str, cluster: str) -> dict:
    """Environment variables of a rank process (or of the MPI daemons its rank inherits them from)
    of ``cluster``: the secret, the cluster name and the CA seed (``MLXCLUSTER_CA_SEED``), so that
    the rank's :func:`credentials` skip the scrypt derivation (its memory-hard cost, ~0.2 s, is paid
    once by the process that starts ranks, not on every rank start's critical path).  Never on a
    command line."""
    return {"MLXCLUSTER_SECRET": secret, "MLXCLUSTER_CLUSTER": cluster,
            "MLXCLUSTER_CA_SEED": ca_seed(secret, cluster) if secret else ""}


@functools.lru_cache(maxsize=4)
def _cluster_ca(seed_hex: str) -> Tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    seed = bytes.fromhex(seed_hex)
    key = ec.derive_private_key(int.from_bytes(seed, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mlxcluster cluster CA")])
    public = key.public_key()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(1).not_valid_before(_NOT_BEFORE).not_valid_after(_NOT_AFTER)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


@dataclass(frozen=True)
class Credentials:
    """This process's TLS material for one cluster (PEM bytes).

    Attributes:
        ca_pem: the cluster CA certificate (the only trusted root).
        key_pem: this process's private key (PKCS#8, unencrypted; never leaves memory).
        cert_pem: its certificate, signed by the cluster CA.
        names: the DNS SANs in ``cert_pem``.
    """

    ca_pem: bytes
    key_pem: bytes
    cert_pem: bytes
    names: Tuple[str, ...]

    def server(self) -> grpc.ServerCredentials:
        """Server credentials that present this certificate and require a client
        certificate chained to the cluster CA."""
        return grpc.ssl_server_credentials([(self.key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials: trust only the cluster CA, present this certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self.key_pem,
                                            certificate_chain=self.cert_pem)

    def channel_options(self, peer: str = ANY_MEMBER, options: Sequence[Tuple[str, object]] = ()) -> List[tuple]:
        """gRPC channel options that make the client insist on ``peer`` among the server
        certificate's SANs (no HTTP proxy: cluster links are LAN links), and reconnect within
        ``RECONNECT_BACKOFF_MAX_MS`` of a peer coming (back) up: gRPC's default reconnect back-off
        grows to 120 s (1 s x 1.6 per failed attempt), so a node down for 20 s was seen back, or a
        starting rank seen ready, up to ~10 s late -- on a cluster's LAN a retry per second is cheap."""
        return [("grpc.ssl_target_name_override", peer), ("grpc.default_authority", peer),
                ("grpc.enable_http_proxy", 0), ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_INITIAL_MS),
                ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS), *options]

    def channel(self, address: str, peer: str = ANY_MEMBER, options: Sequence[Tuple[str, object]] = ()) -> grpc.Channel:
        """A blocking-API secure channel to ``address`` (``host:port``) that talks only to ``peer``."""
        return grpc.secure_channel(address, self.channel_credentials(), options=self.channel_options(peer, options))

    def aio_channel(self, address: str, peer: str = ANY_MEMBER,
                    options: Sequence[Tuple[str, object]] = ()) -> "grpc.aio.Channel":
        """:meth:`channel` for ``grpc.aio``."""
        return grpc.aio.secure_channel(address, self.channel_credentials(),
                                       options=self.channel_options(peer, options))


def credentials(secret: str, cluster: str = "local", names: Iterable[str] = (), seed: str = "") -> Credentials:
    """TLS credentials of one process of ``cluster`` (see the module docstring).

    Args:
        secret: the cluster secret (non-empty).
        cluster: the cluster name, the scrypt salt (``"local"`` for a group started by
            ``generate``/``serve --world-size N``).
        names: extra DNS SANs (e.g. :func:`node_name`); :data:`ANY_MEMBER` is always included.
        seed: :func:`ca_seed` of ``secret`` and ``cluster`` when the caller has it (a rank, from
            ``MLXCLUSTER_CA_SEED``): no scrypt here.  A seed of another secret or cluster makes a
            CA no member trusts (fail closed).

    Raises:
        SecretError: ``secret`` is empty (and no ``seed``), or ``seed`` is not 64 hex digits.
    """
    if seed:
        try:
            if len(bytes.fromhex(seed)) != 32:
                raise ValueError
        except ValueError:
            raise SecretError("MLXCLUSTER_CA_SEED must be 64 hex digits") from None
    elif not secret:
        raise SecretError("a cluster secret is required")
    ca_key, ca_cert = _cluster_ca(seed.lower() or ca_seed(secret, cluster))
    key = ec.generate_private_key(ec.SECP256R1())
    sans = tuple(dict.fromkeys([ANY_MEMBER, *names]))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, sans[-1])]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(max(_NOT_BEFORE, now - datetime.timedelta(days=365 * 5)))
            .not_valid_after(_NOT_AFTER)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in sans]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return Credentials(
        ca_pem=ca_cert.public_bytes(pem), cert_pem=cert.public_bytes(pem), names=sans,
        key_pem=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


def self_signed(names: Iterable[str], days: int = 3650) -> Tuple[bytes, bytes]:
    """A fresh self-signed server certificate for the hosts ``names`` (DNS names or IP
    addresses, each a SAN), for a TLS server that has no certificate of its own (the router's
    provider link): a P-256 key, ``CN`` the first name, extended key usage server authentication,
    valid from an hour ago for ``days`` days.  Clients trust it by taking the certificate itself
    as their CA (``serve --router-ca FILE``).

    Returns:
        ``(key_pem, cert_pem)``: PKCS#8 private key (unencrypted) and the certificate, PEM bytes.

    Raises:
        ValueError: no name given.
    """
    import ipaddress

    names = list(dict.fromkeys(n for n in names if n))
    if not names:
        raise ValueError("a certificate needs at least one host name")
    sans: List[x509.GeneralName] = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0][:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    return (key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
            cert.public_bytes(pem))


def fingerprint(cert_pem: bytes) -> str:
    """The SHA-256 fingerprint of a PEM certificate (of its DER bytes), as colon-separated
    upper-case hex pairs (what ``openssl x509 -fingerprint -sha256`` prints).

    Raises:
        ValueError: ``cert_pem`` is not a PEM certificate.
    """
    digest = x509.load_pem_x509_certificate(cert_pem).fingerprint(hashes.SHA256())
    return ":".join(f"{b:02X}" for b in digest)


def _text(exc: BaseException) -> str:
    return str(exc.details() or exc) if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else str(exc)


def handshake_failed(exc: BaseException) -> bool:
    """True when a gRPC error is a failed TLS handshake (the peer could not prove the
    cluster secret or the name asked for, or refused ours).  Diagnostics only (it reads
    gRPC's message): security never depends on it."""
    return any(s in _text(exc) for s in ("andshake", "CERTIFICATE", "certificate", "TSI_", "SSL_ERROR",
                                         "Verification"))


def describe_rpc_error(exc: BaseException) -> str:
    """One line for a failed RPC to a cluster process: which TLS check failed, else
    ``unreachable`` or gRPC's details."""
    if "Hostname Verification" in _text(exc):
        return "TLS: the endpoint does not prove the node id it advertises"
    if handshake_failed(exc):
        return "TLS handshake failed: not the same cluster secret"
    if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE:
        return "unreachable"
    return (exc.details() if isinstance(exc, grpc.RpcError) else str(exc)) or "error"
