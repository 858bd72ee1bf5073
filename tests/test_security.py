"""Cluster TLS (mlxcluster/security.py): who gets in, what is on the wire, where the secret comes from."""

from __future__ import annotations

import os
import time
from concurrent import futures

import grpc
import pytest

from mlxcluster import security
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Node(pb_grpc.NodeServicer):
    def __init__(self):
        self.calls = 0

    def Status(self, request, context):
        self.calls += 1
        return pb.NodeStatusReply(node_id="n1")


@pytest.fixture
def node_server(tls):
    """A Node service with the test cluster's credentials, certified for node id ``n1``."""
    from conftest import TEST_SECRET

    creds = security.credentials(TEST_SECRET, "local", [security.node_name("n1")])
    servicer = _Node()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_NodeServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", creds.server())
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def _status(channel):
    try:
        return pb_grpc.NodeStub(channel).Status(pb.NodeStatusRequest(), timeout=5)
    finally:
        channel.close()


def test_only_secret_holders_complete_the_handshake(node_server, tls, other_tls):
    servicer, address = node_server
    assert _status(tls.channel(address)).node_id == "n1"
    assert _status(tls.channel(address, security.node_name("n1"))).node_id == "n1"
    assert servicer.calls == 2
    with pytest.raises(grpc.RpcError) as err:  # another secret: the server's chain does not verify
        _status(other_tls.channel(address))
    assert security.handshake_failed(err.value)
    assert "not the same cluster secret" in security.describe_rpc_error(err.value)
    with pytest.raises(grpc.RpcError):  # plaintext
        _status(grpc.insecure_channel(address))
    with pytest.raises(grpc.RpcError) as err:  # a secret holder, but not the node id it is asked to prove
        _status(tls.channel(address, security.node_name("n2")))
    assert servicer.calls == 2


def test_ca_is_a_function_of_secret_and_cluster_only(tls):
    from conftest import TEST_SECRET

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    def ca_key(creds):  # the CA's public key (its certificate's ECDSA signature is randomised)
        return x509.load_pem_x509_certificate(creds.ca_pem).public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)

    security._cluster_ca.cache_clear()  # derive again, as another process would
    security.ca_seed.cache_clear()
    again = security.credentials(TEST_SECRET, "local")
    assert ca_key(again) == ca_key(tls) and again.key_pem != tls.key_pem  # fresh leaf key per process
    assert ca_key(security.credentials(TEST_SECRET, "lab")) != ca_key(tls)  # the cluster name salts it
    assert ca_key(security.credentials(TEST_SECRET + "x", "local")) != ca_key(tls)
    assert TEST_SECRET.encode() not in tls.ca_pem + tls.cert_pem


def test_a_rank_given_the_ca_seed_is_a_member_without_deriving_it(node_server, tls, monkeypatch):
    """A rank's parent hands it the CA seed (MLXCLUSTER_CA_SEED: security.rank_environment) so its
    start skips scrypt: the credentials built from it complete the handshake; a seed of another
    cluster builds a CA no member trusts; a malformed one is one line."""
    from conftest import TEST_SECRET

    servicer, address = node_server
    env = security.rank_environment(TEST_SECRET, "local")
    assert env["MLXCLUSTER_SECRET"] == TEST_SECRET and len(env["MLXCLUSTER_CA_SEED"]) == 64
    calls = []
    monkeypatch.setattr(security, "Scrypt", lambda *a, **k: calls.append(1))  # no derivation below
    rank = security.credentials("", "local", seed=env["MLXCLUSTER_CA_SEED"])
    assert _status(rank.channel(address)).node_id == "n1" and not calls
    stranger = security.credentials("", "local", seed=security.ca_seed(TEST_SECRET, "lab"))
    with pytest.raises(grpc.RpcError) as err:
        _status(stranger.channel(address))
    assert security.handshake_failed(err.value)
    with pytest.raises(security.SecretError, match="64 hex digits"):
        security.credentials("", "local", seed="00ff")


def test_key_derivation_is_slow():
    """scrypt's cost: one guess per derivation (the old HMAC tag allowed ~280,000/s)."""
    import hashlib

    t0 = time.perf_counter()
    hashlib.scrypt(b"guess", salt=b"mlxcluster-ca-v1:lab", n=security.SCRYPT_N, r=8, p=1, maxmem=2**28, dklen=32)
    assert security.SCRYPT_N >= 2 ** 16  # >= 64 MiB of memory per guess (128 * r * N bytes)
    assert time.perf_counter() - t0 > 0.01  # not a fast hash (loose: machines differ)


def test_read_secret(tmp_path):
    path = tmp_path / "secret"
    path.write_text("  correct horse battery staple \nsecond line\n")
    path.chmod(0o600)
    assert security.read_secret(None, str(path)) == "correct horse battery staple"
    assert security.read_secret("from-the-environment", None) == "from-the-environment"
    assert security.read_secret(None, None, required=False) == ""
    for value, file, match in [(None, None, "required"), ("short", None, "at least"),
                               ("x" * 20, str(path), "not both"), (None, str(tmp_path / "nope"), "cannot read")]:
        with pytest.raises(security.SecretError, match=match):
            security.read_secret(value, file)
    path.chmod(0o644)
    with pytest.raises(security.SecretError, match="readable by other users"):
        security.read_secret(None, str(path))


def _cli(*args, env=None):
    from harness import cli

    return cli(*args, env=env)  # in process: every check here ends before anything starts


def test_cli_takes_no_secret_on_argv_and_needs_one_for_a_cluster(tmp_path):
    proc = _cli("generate", "--cluster", "nowhere", "--secret", "s3cret-s3cret", "hi")
    assert proc.returncode != 0 and "No such option" in proc.stderr
    env = {"MLXCLUSTER_SECRET": ""}
    for args in (["generate", "--cluster", "nowhere", "hi"], ["join", "--cluster", "nowhere"]):
        proc = _cli(*args, env=env)
        assert proc.returncode == 2, proc.stderr
        assert "a cluster secret is required" in proc.stderr and "Traceback" not in proc.stderr
    loose = tmp_path / "loose"
    loose.write_text("a-long-enough-secret\n")
    loose.chmod(0o644)
    proc = _cli("join", "--cluster", "nowhere", "--secret-file", str(loose), env=env)
    assert proc.returncode == 2 and "readable by other users" in proc.stderr
    proc = _cli("secret")
    assert proc.returncode == 0 and len(proc.stdout.strip()) == 32
    proc = _cli("router", "--provider-token", "t0k3n-t0k3n", "--port", "0", "--grpc-port", "0")
    assert proc.returncode == 2 and "users need API keys" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # three rank processes (of a tiny model) and a packet capture while they run
def test_neither_secret_nor_prompt_on_the_wire(tmp_path):
    """A capture of loopback while a TP=3 group starts and generates finds neither the
    cluster secret, nor the CA seed its ranks get, nor the prompt text, though it finds a plaintext
    canary sent the same way.  The group and the capture run in a network namespace of their own
    (tests/wire_capture.py): on the shared ``lo`` CI's other test worker's traffic made the capture drop
    frames, and a capture that dropped frames cannot vouch for the rest."""
    import json
    import subprocess
    import sys

    from benchmarks.netns import NetnsError, private_loopback
    from tinymodel import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(str(path))
    secret = "wire-secret-" + os.urandom(8).hex()
    prompt = "zebra quokka " + os.urandom(6).hex()
    out = tmp_path / "capture.bin"
    env = dict(os.environ, WIRE_SECRET=secret,
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]))
    try:
        with private_loopback() as ns:
            proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, os.path.join(ROOT, "tests", "wire_capture.py"),
                                   str(path), prompt, str(out)], env=env, capture_output=True, text=True, timeout=400)
    except NetnsError as exc:
        pytest.skip(str(exc))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    data = out.read_bytes()
    assert report["tokens"] >= 1 and report["canary"]  # the group answered; the capture works
    assert report["dropped"] == 0, f"the capture dropped {report['dropped']} frames: it cannot vouch for the rest"
    assert len(data) > 20_000
    assert secret.encode() not in data
    assert security.ca_seed(secret, "local").encode() not in data  # the ranks' CA seed (their environment)
    assert prompt.encode() not in data and b"quokka" not in data
