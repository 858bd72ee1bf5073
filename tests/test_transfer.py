"""Model sharing: a node fetches the model from a peer's ``Node`` service (mutual TLS, chunked,
resumable, sha256-verified).  On loopback with a random-weight model directory and a GGUF file."""

import os
import threading
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

from mlxcluster.cluster import transfer
from mlxcluster.model.loader import model_digest
from mlxcluster.cluster.service import NodeService
from mlxcluster.cluster.transfer import ModelShare, ModelTransferError, fetch_model
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mlxcluster.model.synthetic import write_model

    return write_model("llama", str(tmp_path_factory.mktemp("m") / "tiny-llama"), scale=4)


class Holder:
    """A peer's ``Node`` service holding ``path`` (served as :class:`NodeService` serves it)."""

    def __init__(self, path, tls, share_cls=ModelShare):
        self.share = share_cls(path)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_NodeServicer_to_server(NodeService(SimpleNamespace(share=self.share)), self.server)
        self.port = self.server.add_secure_port("127.0.0.1:0", tls.server())
        self.server.start()
        self.address = f"127.0.0.1:{self.port}"

    def stop(self):
        self.server.stop(None)


def _fetch(holder, tls, dest, **kw):
    channel = tls.channel(holder.address)
    try:
        return fetch_model(channel, str(dest), **kw)
    finally:
        channel.close()


def test_fetch_copies_and_verifies_a_model_directory(model_dir, tls, tmp_path):
    holder = Holder(model_dir, tls)
    try:
        seen = []
        got = _fetch(holder, tls, tmp_path, progress=lambda done, total: seen.append((done, total)))
    finally:
        holder.stop()
    assert model_digest(got) == model_digest(model_dir)
    for rel in transfer.model_files(model_dir):
        with open(os.path.join(model_dir, rel), "rb") as a, open(os.path.join(got, rel), "rb") as b:
            assert a.read() == b.read()
    total = sum(os.path.getsize(os.path.join(model_dir, r)) for r in transfer.model_files(model_dir))
    assert seen[-1] == (total, total) and len(seen) >= 2
    assert not os.path.exists(got + ".partial")


def test_fetch_of_a_single_gguf_file(tls, tmp_path):
    from tinymodel import write_gguf

    src = tmp_path / "src" / "tiny.gguf"
    src.parent.mkdir()
    write_gguf(str(src))
    holder = Holder(str(src), tls)
    try:
        got = _fetch(holder, tls, tmp_path / "dest")
    finally:
        holder.stop()
    assert os.path.basename(got) == "tiny.gguf" and open(got, "rb").read() == src.read_bytes()


def test_interrupted_fetch_resumes_where_it_stopped(model_dir, tls, tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "CHUNK_BYTES", 64 << 10)  # many chunks per file
    holder = Holder(model_dir, tls)
    calls = []  # per Fetch call, the bytes it sent (a call of the first fetch may still run after it stopped)
    real_fetch = ModelShare.Fetch

    def counting(self, request, context):
        mine = []
        calls.append(mine)
        for chunk in real_fetch(self, request, context):
            mine.append(len(chunk.data))
            yield chunk

    monkeypatch.setattr(ModelShare, "Fetch", counting)
    total = sum(os.path.getsize(os.path.join(model_dir, r)) for r in transfer.model_files(model_dir))

    class Stop(Exception):
        pass

    def stop_halfway(done, _total):
        if done > total // 2:
            raise Stop()

    partial = tmp_path / f"{model_digest(model_dir)}.partial"
    try:
        with pytest.raises(Stop):
            _fetch(holder, tls, tmp_path, progress=stop_halfway)
        kept = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
        assert total // 2 < kept < total
        first = len(calls)
        got = _fetch(holder, tls, tmp_path)
    finally:
        holder.stop()
    assert sum(sum(c) for c in calls[first:]) == total - kept, "the second fetch sent only what was missing"
    assert model_digest(got) == model_digest(model_dir)


def test_corrupted_bytes_are_detected_and_never_kept(model_dir, tls, tmp_path, monkeypatch):
    real_fetch = ModelShare.Fetch

    def corrupting(self, request, context):
        for chunk in real_fetch(self, request, context):
            if request.path == "model.safetensors" and chunk.offset == 0:
                chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
            yield chunk

    monkeypatch.setattr(ModelShare, "Fetch", corrupting)
    holder = Holder(model_dir, tls)
    try:
        with pytest.raises(ModelTransferError, match="sha256"):
            _fetch(holder, tls, tmp_path)
    finally:
        holder.stop()
    digest = model_digest(model_dir)
    assert not os.path.exists(tmp_path / digest)  # nothing was put in place
    assert not os.path.exists(tmp_path / f"{digest}.partial" / "model.safetensors")  # the bad file is gone


def test_a_node_without_the_secret_cannot_download(model_dir, tls, other_tls, tmp_path):
    holder = Holder(model_dir, tls)
    try:
        with pytest.raises(ModelTransferError, match="no manifest"):
            _fetch(holder, other_tls, tmp_path, chunk_timeout_s=5)
    finally:
        holder.stop()
    assert os.listdir(tmp_path) == []


def test_holder_serves_only_its_own_models_files(model_dir, tls):
    from mlxcluster.protocol import mlxcluster_pb2 as pb

    holder = Holder(model_dir, tls)
    channel = tls.channel(holder.address)
    try:
        stub = pb_grpc.NodeStub(channel)
        digest = stub.Manifest(pb.ManifestRequest(), timeout=30).model_digest
        for path, d in (("../../etc/passwd", digest), ("/etc/passwd", digest), ("config.json", "0" * 16)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Fetch(pb.FetchRequest(model_digest=d, path=path), timeout=30))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert b"".join(c.data for c in stub.Fetch(pb.FetchRequest(model_digest=digest, path="config.json"),
                                                   timeout=30)) == open(f"{model_dir}/config.json", "rb").read()
    finally:
        channel.close()
        holder.stop()


def test_a_node_without_a_model_says_so(tls, tmp_path):
    holder = Holder("", tls)
    try:
        with pytest.raises(ModelTransferError, match="holds no model"):
            _fetch(holder, tls, tmp_path)
    finally:
        holder.stop()
    assert threading.active_count() < 50
