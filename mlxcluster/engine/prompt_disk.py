"""The prefix cache's disk tier: prompts' K/V that outlive the process (``--prompt-cache-dir``).

:class:`~mlxcluster.engine.prefix_cache.PrefixCache` (the memory tier) holds earlier prompts' K/V for later
prompts that start the same way; :class:`DiskPrompts` keeps the long ones (at least
``MIN_TOKENS`` positions) in files too, so that a restarted group takes a long shared prefix from
disk instead of prefilling it.  Only :meth:`DiskPrompts.load` reads K/V; at start only the files'
headers are read (their token ids: the index :meth:`PrefixCache.match` looks through).

On-disk layout (format version ``VERSION`` = 1)::

    DIR/                                    --prompt-cache-dir
      <identity key>/                       16 hex digits: sha256 of Identity.fields() as sorted JSON
        index.json                          {"version": 1, "lru": [file names, least recently used first]}
        <sha256 of the token ids, 32 hex>.safetensors    one held prompt
        *.tmp                               a write in progress (temp file, then os.replace)

Each ``.safetensors`` file is a standard safetensors file (8-byte little-endian header length, a
JSON header, the raw tensors): tensors ``layers.{i}.keys`` and ``layers.{i}.values`` for every layer
``i`` of this rank's model, each ``(1, n_kv_heads of this rank, n, head_dim)`` in the K/V dtype
(``BF16``/``F16``/``F32``) -- positions ``[0, n)`` of the prompt, whose last position (always
computed) is not held.  With quantized K/V (``kv_bits`` 4 or 8, ``--kv-bits``;
:mod:`~mlxcluster.engine.kvquant`) the cache's packed arrays are stored as they are, never
dequantized: ``layers.{i}.keys`` / ``layers.{i}.values`` are then the codes ``(1, n_kv_heads, n,
head_dim * kv_bits / 32)`` ``U32``, and ``layers.{i}.keys.scales``, ``layers.{i}.keys.biases`` (and
the same for ``values``) ``(1, n_kv_heads, n, head_dim / kv_group_size)`` in the K/V dtype
(``x = scale * code + bias`` per group of ``kv_group_size`` elements along ``head_dim``,
``mx.quantize``'s affine layout).  Its ``__metadata__`` (strings, as safetensors wants):

* ``format``: ``"mlxcluster-prompt-kv"``; ``version``: ``"1"``;
* the identity (:class:`Identity`): ``model_digest`` (``mlxcluster.model.loader.model_digest``),
  ``weights`` (the weight format: quantized, float16, ...), ``rank``, ``world_size``, ``topology``
  (the topology's rank options, ``Topology.to_args`` joined by spaces: the route / TP split that
  decides which layers and heads this rank's K/V hold), ``n_layers``, ``n_kv_heads`` (this rank's),
  ``head_dim``, ``kv_dtype``, ``kv_bits`` (0: K/V not quantized), ``kv_group_size`` (only when
  ``kv_bits`` is not 0);
* ``tokens``: the ``n`` token ids, a JSON list.

A file whose identity is not this rank's (another model, shard layout, or KV format: a file written
with ``--kv-bits 8`` is refused by a full-precision rank and the reverse), whose header does not parse, whose size is not the one
its header declares (truncated), whose tensors are missing or of another shape or dtype, or that
``mx.load`` cannot read is refused -- never loaded -- with one log line, counted in
:attr:`DiskPrompts.refused`; it is deleted only when it is corrupt and in this rank's own identity
directory (a file of another identity is never deleted).  Least recently used files are deleted
when the directory's files pass the size bound (``--prompt-cache-size``).

Writes: :meth:`DiskPrompts.save` (on the MLX thread) copies the arrays to numpy and hands the file
write to ``submit`` (``runtime/rank.py``: one writer thread behind a bounded queue, so that a
hundreds-of-MB write never stalls a decode step; a full queue drops the write); without ``submit``
the write is synchronous (tests).  This module runs no thread of its own; a lock guards the index
against the writer.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from ..config import parse_bytes
from .kvquant import quantized

log = logging.getLogger(__name__)

FORMAT = "mlxcluster-prompt-kv"
VERSION = 1
#: shorter prompts are not written (the disk tier is for long shared prefixes)
MIN_TOKENS = 256
#: --prompt-cache-size's default
DEFAULT_SIZE = 4 * 2**30
_HEADER_MAX = 64 * 2**20  # a larger JSON header is no file of ours
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def parse_size(text: str) -> int:
    """Bytes of a ``--prompt-cache-size`` such as ``4GiB``, ``800MB``, ``1.5G`` or ``1000000``
    (:func:`mlxcluster.config.parse_bytes`'s units).

    Raises:
        ValueError: not such a size, or not positive (one line)."""
    return parse_bytes(text, "--prompt-cache-size", "4GiB, 800MB")


@dataclass(frozen=True)
class Identity:
    """What decides whether a file's K/V are this rank's: the model, its weight format, this rank's
    shard of the group's layout, the K/V format."""

    model_digest: str
    weights: str
    rank: int
    world_size: int
    topology: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_bits: int = 0
    kv_group_size: int = 0

    def fields(self) -> Dict[str, str]:
        """The metadata fields a file must match (``kv_group_size`` only with ``kv_bits``: a
        full-precision identity, and so its directory's key, is what it was before quantized K/V)."""
        out = {k: str(v) for k, v in asdict(self).items()}
        if not self.kv_bits:
            out.pop("kv_group_size")
        return out

    def tensors(self, n: int) -> Dict[str, Tuple[str, List[int]]]:
        """The tensors a file of ``n`` positions holds: name -> (safetensors dtype, shape)."""
        code = _DTYPES.get(self.kv_dtype, "?")
        shape = [1, self.n_kv_heads, n, self.head_dim]
        out: Dict[str, Tuple[str, List[int]]] = {}
        for i in range(self.n_layers):
            for part in ("keys", "values"):
                if not self.kv_bits:
                    out[f"layers.{i}.{part}"] = (code, shape)
                    continue
                groups = [1, self.n_kv_heads, n, self.head_dim // max(1, self.kv_group_size)]
                out[f"layers.{i}.{part}"] = ("U32", [1, self.n_kv_heads, n, self.head_dim * self.kv_bits // 32])
                out[f"layers.{i}.{part}.scales"] = (code, groups)
                out[f"layers.{i}.{part}.biases"] = (code, groups)
        return out

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()[:16]


class Refused(Exception):
    """A file that is not loaded (one line); ``corrupt``: unreadable, as opposed to of another identity."""

    def __init__(self, message: str, corrupt: bool):
        super().__init__(message)
        self.corrupt = corrupt


def read_header(path: str) -> Tuple[Dict[str, str], Dict[str, dict]]:
    """``(metadata, tensors)`` of a safetensors file, from its header alone (the file's size checked
    against the header's offsets).

    Raises:
        Refused: (corrupt) no safetensors header, or a truncated file."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise Refused("shorter than a safetensors header", True)
            n = int.from_bytes(raw, "little")
            if n > min(size - 8, _HEADER_MAX):
                raise Refused("header length past the end of the file", True)
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise Refused("header is not a JSON object", True)
        meta = header.pop("__metadata__", None) or {}
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except Refused:
        raise
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise Refused(f"unreadable header ({type(exc).__name__}: {exc})", True) from None
    if 8 + n + end != size:
        raise Refused(f"{size} bytes, its header declares {8 + n + end} (truncated)", True)
    return meta, header


def _to_numpy(a: mx.array):
    import numpy as np

    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def write_safetensors(path: str, tensors: Sequence[Tuple[str, str, Sequence[int], object]],
                      metadata: Dict[str, str]) -> int:
    """Write ``tensors`` (``(name, safetensors dtype, shape, numpy array of its bytes)``) and ``metadata``
    as one safetensors file at ``path``, atomically (a temp file beside it, fsync'd, then
    ``os.replace``).  Returns the file's size."""
    header: Dict[str, object] = {}
    offset = 0
    for name, code, shape, arr in tensors:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for _, _, _, arr in tensors:
                f.write(memoryview(arr).cast("B"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    return 8 + len(raw) + offset


class DiskPrompts:
    """This rank's prompts on disk under ``root``/:meth:`Identity.key` (the module's layout), at most
    ``max_bytes`` of files, least recently used deleted first.

    Raises:
        OSError: the directory cannot be made or written (one line)."""

    def __init__(self, root: str, max_bytes: int, identity: Identity, min_tokens: int = MIN_TOKENS,
                 submit: Optional[Callable[[Callable[[], None]], bool]] = None):
        self.identity = identity
        self.max_bytes = int(max_bytes)
        self.min_tokens = max(1, int(min_tokens))
        self.submit = submit
        self.dir = os.path.join(root, identity.key())
        os.makedirs(self.dir, exist_ok=True)
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise OSError(f"--prompt-cache-dir {root}: {self.dir} is not writable")
        self._lock = threading.Lock()
        #: held prompts (token ids) -> (file name, bytes), least recently used first
        self.entries: "collections.OrderedDict[tuple, Tuple[str, int]]" = collections.OrderedDict()
        self.bytes = 0
        self.refused = 0   # files refused (another identity, corrupt, truncated)
        self.written = 0   # files written
        self.evicted = 0   # files deleted by the size bound
        self.dropped = 0   # writes dropped (the writer's queue was full)
        self.loads = 0     # files loaded (disk hits)
        self._scan()

    # -- start: the headers only ------------------------------------------------------
    def _scan(self) -> None:
        try:
            with open(os.path.join(self.dir, "index.json")) as f:
                order = [str(n) for n in json.load(f).get("lru", [])]
        except (OSError, ValueError, AttributeError):
            order = []
        names = []
        for name in os.listdir(self.dir):
            path = os.path.join(self.dir, name)
            if name.endswith(".tmp"):  # a write a stopped process left
                _remove(path)
            elif name.endswith(".safetensors"):
                names.append(name)
        rank = {n: i for i, n in enumerate(order)}
        names.sort(key=lambda n: (rank.get(n, -1), _mtime(os.path.join(self.dir, n))))
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                meta, tensors = read_header(path)
                tokens = self._check(meta, tensors)
            except Refused as exc:
                self._refuse(path, exc)
                continue
            size = os.path.getsize(path)
            self.entries[tokens] = (name, size)
            self.bytes += size
        if self.entries:
            log.info("prompt cache: %d prompts (%d positions, %.1f MiB) on disk in %s", len(self.entries),
                     sum(map(len, self.entries)), self.bytes / 2**20, self.dir)

    def _check(self, meta: Dict[str, str], tensors: Dict[str, dict]) -> tuple:
        """The token ids of a file whose header is this rank's, else :class:`Refused`."""
        if meta.get("format") != FORMAT or meta.get("version") != str(VERSION):
            raise Refused(f"format {meta.get('format')!r} version {meta.get('version')!r}, "
                          f"not {FORMAT} {VERSION}", False)
        for k, v in self.identity.fields().items():
            if meta.get(k) != v:
                raise Refused(f"{k} {meta.get(k)!r}, this rank's is {v!r}", False)
        try:
            tokens = tuple(int(t) for t in json.loads(meta["tokens"]))
        except (KeyError, ValueError, TypeError) as exc:
            raise Refused(f"no token ids ({exc})", True) from None
        for name, (code, want) in self.identity.tensors(len(tokens)).items():
            t = tensors.get(name)
            if t is None or list(t.get("shape", ())) != want or t.get("dtype") != code:
                raise Refused(f"{name} is {t and (t.get('dtype'), t.get('shape'))}, not {code} {want}", True)
        if not tokens:
            raise Refused("no positions", True)
        return tokens

    def _refuse(self, path: str, exc: Refused) -> None:
        self.refused += 1
        own = os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.dir)
        if exc.corrupt and own:
            _remove(path)
        log.warning("prompt cache: refused %s: %s%s", path, exc, " (deleted)" if exc.corrupt and own else "")

    # -- lookup -----------------------------------------------------------------------
    def keys(self) -> List[tuple]:
        """The held prompts' token ids (a snapshot)."""
        with self._lock:
            return list(self.entries)

    def load(self, tokens: tuple) -> Optional[list]:
        """Per layer ``(keys, values)`` of held prompt ``tokens`` (``(1, heads, len(tokens), head_dim)``,
        or quantized triples ``(codes, scales, biases)`` with ``kv_bits``), marked used; ``None`` where
        its file is refused (then no longer held)."""
        with self._lock:
            held = self.entries.get(tokens)
        if held is None:
            return None
        path = os.path.join(self.dir, held[0])
        try:
            meta, tensors = read_header(path)
            if self._check(meta, tensors) != tokens:
                raise Refused("token ids differ from the index's", True)
            try:
                arrays, meta = mx.load(path, return_metadata=True)
                n = self.identity.n_layers
                if self.identity.kv_bits:
                    kv = [tuple(tuple(arrays[f"layers.{i}.{part}{s}"] for s in ("", ".scales", ".biases"))
                                for part in ("keys", "values")) for i in range(n)]
                else:
                    kv = [(arrays[f"layers.{i}.keys"], arrays[f"layers.{i}.values"]) for i in range(n)]
                mx.eval(kv)
            except Exception as exc:  # mx.load's errors are RuntimeError/ValueError
                raise Refused(f"unreadable ({type(exc).__name__}: {exc})", True) from None
        except Refused as exc:
            self._forget(tokens)
            self._refuse(path, exc)
            return None
        with self._lock:
            if tokens in self.entries:
                self.entries.move_to_end(tokens)
            self.loads += 1
        self._persist_index()
        return kv

    # -- writes -----------------------------------------------------------------------
    def wants(self, tokens: tuple, bytes_estimate: int = 0) -> bool:
        """Whether :meth:`save` would write ``tokens`` (long enough, not held already -- a held prompt
        that starts with all of them is marked used instead --, within the size bound)."""
        if len(tokens) < self.min_tokens or bytes_estimate > self.max_bytes:
            return False
        n = len(tokens)
        with self._lock:
            for held in self.entries:
                if len(held) >= n and held[:n] == tokens:
                    self.entries.move_to_end(held)
                    return False
        return True

    def save(self, tokens: tuple, kv: list) -> None:
        """Write ``kv`` (per layer ``(keys, values)``, ``(1, heads, len(tokens), head_dim)`` -- or the
        quantized triples, with ``kv_bits`` --, evaluated) as ``tokens``' file: the arrays are copied to
        numpy here (the MLX thread), the file written by ``submit`` (or now)."""
        code = _DTYPES.get(self.identity.kv_dtype)
        if code is None:
            return
        tensors = []
        for i, layer in enumerate(kv):
            for part, x in zip(("keys", "values"), layer):
                if quantized(x):  # codes, scales, biases as the cache holds them
                    for suffix, a, c in zip(("", ".scales", ".biases"), x, ("U32", code, code)):
                        tensors.append((f"layers.{i}.{part}{suffix}", c, a.shape, _to_numpy(a)))
                else:
                    tensors.append((f"layers.{i}.{part}", code, x.shape, _to_numpy(x)))
        name = hashlib.sha256(json.dumps(list(tokens)).encode()).hexdigest()[:32] + ".safetensors"
        meta = {"format": FORMAT, "version": str(VERSION), **self.identity.fields(),
                "tokens": json.dumps(list(tokens), separators=(",", ":"))}

        def write() -> None:
            try:
                size = write_safetensors(os.path.join(self.dir, name), tensors, meta)
            except OSError as exc:
                log.warning("prompt cache: writing %s failed: %s", name, exc)
                return
            with self._lock:
                old = self.entries.pop(tokens, None)
                self.bytes -= old[1] if old else 0
                self.entries[tokens] = (name, size)
                self.bytes += size
                self.written += 1
                gone = []
                while self.bytes > self.max_bytes and len(self.entries) > 1:
                    _, (old_name, old_size) = self.entries.popitem(last=False)
                    self.bytes -= old_size
                    self.evicted += 1
                    gone.append(old_name)
            for old_name in gone:
                _remove(os.path.join(self.dir, old_name))
            self._persist_index()
            log.info("prompt cache: wrote %d positions (%.1f MiB) to %s", len(tokens), size / 2**20, name)

        if self.submit is None:
            write()
        elif not self.submit(write):
            self.dropped += 1
            log.warning("prompt cache: the writer is busy: %d positions not written", len(tokens))

    def _forget(self, tokens: tuple) -> None:
        with self._lock:
            old = self.entries.pop(tokens, None)
            self.bytes -= old[1] if old else 0

    def _persist_index(self) -> None:
        with self._lock:
            order = [name for name, _ in self.entries.values()]
        path = os.path.join(self.dir, "index.json")
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"version": VERSION, "lru": order}, f)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("prompt cache: index not written: %s", exc)
            _remove(tmp)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0
