"""Model sharing inside a cluster: a node that lacks the model fetches it from a peer that holds it.

Served by every node's ``Node`` service (``Manifest``, ``Fetch``), so only a process that proves the
cluster secret in the mutual-TLS handshake can download (:mod:`mlxcluster.security`).

* :class:`ModelShare` (the holder): the model's manifest -- every file's relative path, size and
  sha256, computed once -- and ``Fetch``: a file's bytes from an offset, in chunks of
  :data:`CHUNK_BYTES`; only files of the manifest, only for the holder's own model digest.
* :func:`fetch_model` (the receiver): files are written under ``<dest>/<digest>.partial/``; a file
  already partly there is resumed from its size; each file's sha256 is checked before the directory
  is renamed into place, and the model's advertised identity is checked last -- a corrupt or
  truncated copy is deleted and never loaded (:class:`ModelTransferError`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from typing import Callable, List, Optional

import grpc

from ..protocol import mlxcluster_pb2 as pb
from ..protocol import mlxcluster_pb2_grpc as pb_grpc

log = logging.getLogger("mlxcluster.transfer")

__all__ = ["CHUNK_BYTES", "ModelShare", "ModelTransferError", "fetch_model", "manifest_of", "model_files"]

#: bytes per ``FileChunk`` (gRPC's default message limit is 4 MiB)
CHUNK_BYTES = 1 << 20
#: a transfer that receives nothing for this long fails (it resumes on the next try)
CHUNK_TIMEOUT_S = 60.0

#: ``progress(done_bytes, total_bytes)``
Progress = Callable[[int, int], None]


class ModelTransferError(RuntimeError):
    """A model could not be fetched, or its copy did not verify (the copy was removed); one line."""


def model_files(path: str) -> List[str]:
    """The files that make up a model: a GGUF file itself, or every regular file of an mlx-lm
    directory (relative paths, sorted; hidden files left out)."""
    if not os.path.isdir(path):
        return [os.path.basename(path)]
    out = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in files:
            if not name.startswith("."):
                out.append(os.path.relpath(os.path.join(root, name), path))
    return sorted(out)


def _sha256(path: str) -> str:
    return _hasher(path, os.path.getsize(path)).hexdigest()


def manifest_of(path: str) -> pb.ManifestReply:
    """The manifest of the model at ``path`` (reads every byte once: sha256 per file)."""
    from ..model.loader import model_digest

    base = path if os.path.isdir(path) else os.path.dirname(path)
    files = [pb.ModelFileMsg(path=rel, size=os.path.getsize(os.path.join(base, rel)),
                             sha256=_sha256(os.path.join(base, rel))) for rel in model_files(path)]
    return pb.ManifestReply(model_digest=model_digest(path), name=os.path.basename(os.path.normpath(path)),
                            is_dir=os.path.isdir(path), files=files)


class ModelShare:
    """The holder's side: serves the model at ``model_path`` (``""``: none) to authenticated peers."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self._manifest: Optional[pb.ManifestReply] = None
        self._lock = threading.Lock()

    def manifest(self) -> Optional[pb.ManifestReply]:
        """The manifest (computed on first use), or ``None`` when this node holds no model."""
        if not self.model_path or not os.path.exists(self.model_path):
            return None
        with self._lock:
            if self._manifest is None:
                t = time.monotonic()
                self._manifest = manifest_of(self.model_path)
                log.info("model manifest: %d files, %.1f MB, hashed in %.1f s", len(self._manifest.files),
                         sum(f.size for f in self._manifest.files) / 1e6, time.monotonic() - t)
            return self._manifest

    def Manifest(self, request, context) -> pb.ManifestReply:
        m = self.manifest()
        if m is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "this node holds no model")
        return m

    def Fetch(self, request: pb.FetchRequest, context):
        m = self.manifest()
        if m is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "this node holds no model")
        if request.model_digest != m.model_digest:
            context.abort(grpc.StatusCode.NOT_FOUND, f"this node holds model {m.model_digest}, "
                                                     f"not {request.model_digest}")
        entry = next((f for f in m.files if f.path == request.path), None)
        if entry is None:  # only the manifest's files: no path ever reaches open() from a peer
            context.abort(grpc.StatusCode.NOT_FOUND, f"{request.path!r} is not a file of this model")
        if request.offset > entry.size:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} beyond {entry.size} bytes")
        base = self.model_path if m.is_dir else os.path.dirname(self.model_path)
        with open(os.path.join(base, entry.path), "rb") as f:
            f.seek(request.offset)
            offset = request.offset
            while offset < entry.size and context.is_active():
                data = f.read(min(CHUNK_BYTES, entry.size - offset))
                if not data:
                    break
                yield pb.FileChunk(offset=offset, data=data)
                offset += len(data)


def _safe_rel(rel: str) -> str:
    norm = os.path.normpath(rel)
    if os.path.isabs(norm) or norm.startswith("..") or norm in (".", ""):
        raise ModelTransferError(f"the peer's manifest names an unsafe path {rel!r}")
    return norm


def fetch_model(channel: grpc.Channel, dest: str, *, progress: Optional[Progress] = None,
                expect_digest: str = "", chunk_timeout_s: float = CHUNK_TIMEOUT_S) -> str:
    """Fetch the peer's model over ``channel`` (a mutual-TLS channel to its ``Node`` service) into
    ``dest/<model_digest>/``, resuming what an interrupted fetch left, and verify it.

    Args:
        channel: to the holder's ``Node`` service.
        dest: directory that keeps fetched models (created if missing).
        progress: called as ``progress(done_bytes, total_bytes)`` once before the first chunk
            (``done_bytes``: what an interrupted fetch left, resumed rather than fetched again)
            and after each chunk.
        expect_digest: the model identity wanted (``""``: whatever the peer holds).
        chunk_timeout_s: the longest wait for one chunk.

    Returns:
        The model's path (the GGUF file, or the mlx-lm directory).

    Raises:
        ModelTransferError: the peer holds another model or none, the link failed (what was
            received is kept for the next try), or a file or the whole model did not verify (the
            bad file is deleted).
    """
    from ..model.loader import model_digest

    stub = pb_grpc.NodeStub(channel)
    try:
        m = stub.Manifest(pb.ManifestRequest(), timeout=max(chunk_timeout_s, 600.0))
    except grpc.RpcError as exc:
        raise ModelTransferError(f"the peer sent no manifest: {exc.details() or exc.code()}") from None
    if expect_digest and m.model_digest != expect_digest:
        raise ModelTransferError(f"the peer holds model {m.model_digest}, not {expect_digest}")
    final = os.path.join(dest, m.model_digest)
    path = final if m.is_dir else os.path.join(final, m.name)
    if os.path.exists(path) and model_digest(path) == m.model_digest and all(
            os.path.exists(os.path.join(final, f.path)) for f in m.files):
        return path  # fetched (and verified) before
    part = final + ".partial"
    total = sum(f.size for f in m.files)
    if progress is not None:  # before any chunk: what an interrupted fetch left (kept, not fetched again)
        progress(sum(min(os.path.getsize(t), f.size) for f in m.files
                     for t in [os.path.join(part, _safe_rel(f.path))] if os.path.exists(t)), total)
    done = 0
    for f in m.files:
        target = os.path.join(part, _safe_rel(f.path))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        have = os.path.getsize(target) if os.path.exists(target) else 0
        if have > f.size:
            os.remove(target)
            have = 0
        done += have
        h = _hasher(target, have)  # what an interrupted fetch left, then each chunk as it arrives
        if have < f.size:
            done = _fetch_file(stub, m.model_digest, f, target, have, done, total, progress, chunk_timeout_s, h)
        if h.hexdigest() != f.sha256:
            os.remove(target)
            raise ModelTransferError(f"{f.path}: the received bytes do not match the manifest's sha256 "
                                     "(the copy was deleted)")
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(part, final)
    got = model_digest(path)
    if got != m.model_digest:
        shutil.rmtree(final, ignore_errors=True)
        raise ModelTransferError(f"the fetched model's digest {got} is not the advertised {m.model_digest}")
    return path


def _hasher(path: str, upto: int):
    """sha256 of the first ``upto`` bytes of ``path``, to be continued."""
    h = hashlib.sha256()
    if upto:
        with open(path, "rb") as f:
            left = upto
            while left > 0:
                block = f.read(min(left, 8 << 20))
                if not block:
                    break
                h.update(block)
                left -= len(block)
    return h


def _fetch_file(stub, digest: str, f: pb.ModelFileMsg, target: str, offset: int, done: int, total: int,
                progress: Optional[Progress], chunk_timeout_s: float, h) -> int:
    call = stub.Fetch(pb.FetchRequest(model_digest=digest, path=f.path, offset=offset))
    try:
        with open(target, "ab") as out:
            for chunk in _bounded(call, chunk_timeout_s):
                if chunk.offset != offset or offset + len(chunk.data) > f.size:
                    raise ModelTransferError(f"{f.path}: chunk at {chunk.offset} (expected {offset}) of "
                                             f"{len(chunk.data)} bytes does not fit the manifest")
                out.write(chunk.data)
                h.update(chunk.data)
                offset += len(chunk.data)
                done += len(chunk.data)
                if progress is not None:
                    progress(done, total)
    except grpc.RpcError as exc:
        raise ModelTransferError(f"{f.path}: the transfer stopped at byte {offset} of {f.size} "
                                 f"({exc.details() or exc.code()}); fetching again resumes there") from None
    finally:
        call.cancel()
    if offset != f.size:
        raise ModelTransferError(f"{f.path}: the peer stopped at byte {offset} of {f.size}; fetching again "
                                 "resumes there")
    return done


def _bounded(call, chunk_timeout_s: float):
    """The call's chunks, failing when one takes longer than ``chunk_timeout_s``."""
    import queue

    items: "queue.Queue" = queue.Queue(maxsize=4)
    end = object()

    def pump():  # ends when the call ends (cancelled by the consumer included) or the consumer is gone
        try:
            try:
                for chunk in call:
                    items.put(chunk, timeout=chunk_timeout_s)
                items.put(end, timeout=chunk_timeout_s)
            except grpc.RpcError as exc:
                items.put(exc, timeout=chunk_timeout_s)
        except queue.Full:
            call.cancel()

    threading.Thread(target=pump, daemon=True, name="fetch-pump").start()
    while True:
        try:
            item = items.get(timeout=chunk_timeout_s)
        except queue.Empty:
            call.cancel()
            raise ModelTransferError(f"no data from the peer for {chunk_timeout_s:.0f} s") from None
        if item is end:
            return
        if isinstance(item, grpc.RpcError):
            raise item
        yield item
