"""One rank process's device memory: the Metal working set, the wired limit, the KV budget, the cache.

Every ``mx`` memory call of the runtime goes through one :class:`Device` (the real one,
:data:`DEVICE`, or a test's fake with a made-up device report), so the rules below are plain
functions of the numbers the device reports:

* :class:`WiredLimit`: wire the shard before it loads -- ``min(max_recommended_working_set_size,
  shard + WIRED_MARGIN_BYTES)`` (mlx-lm wires the working set around generation,
  ``mlx_lm/generate.py: wired_limit``; exo caps it at the model's size + 4 GB, exo PR #1672) --
  and restore the previous limit on exit.  Without it a large model pages (mlx-examples #1061).
* :func:`fit_refusal`: a shard larger than the working set is refused before any weight is read:
  on Metal running out of memory aborts the process (``libc++abi: terminating``, mlx #479).
* :func:`kv_budget_bytes`: the bytes one rank's KV caches may grow to, never 0 ("no bound").
* :class:`CacheUpkeep`: a periodic ``mx.clear_cache()`` in the decode loop (mlx-lm clears every 256
  tokens in ``generate_step`` and every 512 steps in ``BatchGenerator``, ``mlx_lm/generate.py``).

On MLX's CPU backend the device reports no working set: nothing is wired, nothing is refused here,
and the KV budget is sized against the RAM available.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

log = logging.getLogger(__name__)

__all__ = ["Device", "MlxDevice", "DEVICE", "WiredLimit", "wired", "working_set_bytes", "fit_refusal",
           "kv_budget_bytes", "CacheUpkeep", "ShardTooLarge", "GiB", "weight_file_bytes", "held_bytes",
           "shard_share"]

GiB = 1 << 30
#: wired beyond the shard (exo PR #1672: "the 4GB buffer accounts for KV cache and inference overhead")
WIRED_MARGIN_BYTES = 4 * GiB
#: working set kept free of the KV budget on Metal: a step's activations and temporaries (a 2048-token
#: prefill chunk of a 70B model holds a few hundred MiB of them); a choice, not an upstream figure
ACTIVATION_MARGIN_BYTES = 1 * GiB
#: the KV budget when nothing is left for it: a warning, and requests larger than this are refused
#: at admission (``Scheduler.kv_refusal``) rather than run into an out-of-memory abort
KV_FLOOR_BYTES = 256 << 20
#: mlx-lm's threshold for its "close to the maximum recommended size" warning (``wired_limit``)
NEAR_WORKING_SET = 0.9
#: decode steps between two ``mx.clear_cache()`` calls (``generate_step``: every 256 tokens) ...
CLEAR_CACHE_STEPS = 256
#: ... and sooner, checked every :data:`CACHE_CHECK_STEPS` steps, once MLX's buffer cache holds more
CLEAR_CACHE_BYTES = 1 * GiB
CACHE_CHECK_STEPS = 16


class ShardTooLarge(MemoryError):
    """This rank's shard cannot fit the device's working set (one line naming the numbers)."""


class Device:
    """The memory calls of one MLX device; :class:`MlxDevice` makes them, tests fake them.

    ``device_info()`` is MLX's dict (``max_recommended_working_set_size`` and ``memory_size`` in
    bytes on Metal; neither on the CPU backend)."""

    def device_info(self) -> Dict[str, Any]:
        raise NotImplementedError

    def set_wired_limit(self, limit: int) -> int:
        """Set the wired limit (bytes); returns the previous one."""
        raise NotImplementedError

    def set_cache_limit(self, limit: int) -> int:
        """Set the buffer cache's limit (bytes); returns the previous one."""
        raise NotImplementedError

    def clear_cache(self) -> None:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for queued work (mlx-lm does before it restores the wired limit)."""

    @property
    def active_memory(self) -> int:
        """Bytes of live arrays (the weights, once loaded, and the KV caches)."""
        raise NotImplementedError

    @property
    def cache_memory(self) -> int:
        """Bytes held in MLX's buffer cache (freed arrays kept for reuse)."""
        raise NotImplementedError


class MlxDevice(Device):
    """The default device's memory, through ``mlx.core``: ``mx.device_info()`` where MLX has it, else
    the deprecated ``mx.metal.device_info()`` of older MLX (which now prints a deprecation warning)."""

    def device_info(self) -> Dict[str, Any]:
        import mlx.core as mx

        if hasattr(mx, "device_info"):
            return dict(mx.device_info())
        metal = getattr(mx, "metal", None)
        return dict(metal.device_info()) if metal is not None and metal.is_available() else {}

    def set_wired_limit(self, limit: int) -> int:
        import mlx.core as mx

        return int(mx.set_wired_limit(int(limit)))

    def set_cache_limit(self, limit: int) -> int:
        import mlx.core as mx

        return int(mx.set_cache_limit(int(limit)))

    def clear_cache(self) -> None:
        import mlx.core as mx

        mx.clear_cache()

    def synchronize(self) -> None:
        import mlx.core as mx

        mx.synchronize()

    @property
    def active_memory(self) -> int:
        import mlx.core as mx

        return int(mx.get_active_memory())

    @property
    def cache_memory(self) -> int:
        import mlx.core as mx

        return int(mx.get_cache_memory())


#: the process's device (tests pass a fake :class:`Device` instead)
DEVICE: Device = MlxDevice()


def working_set_bytes(device: Optional[Device] = None) -> int:
    """The device's ``max_recommended_working_set_size`` in bytes (Metal's recommended ceiling for
    resident GPU memory); 0 where it reports none (MLX's CPU backend)."""
    try:
        return max(0, int((device or DEVICE).device_info().get("max_recommended_working_set_size") or 0))
    except Exception:  # noqa: BLE001 -- an unreadable report is no report
        log.debug("device report unreadable", exc_info=True)
        return 0


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def fit_refusal(shard_bytes: Optional[int], device: Optional[Device] = None, source: str = "") -> str:
    """Why a shard of ``shard_bytes`` cannot load on ``device``, in one line, else ``""``: more bytes
    than the device's working set (on Metal the allocation would abort the process, mlx #479).
    ``source`` says where ``shard_bytes`` came from.  No working set (CPU) or no estimate: ``""``."""
    ws = working_set_bytes(device)
    if not ws or not shard_bytes:
        return ""
    if shard_bytes > ws:
        return (f"this rank's shard needs {_gib(shard_bytes)} ({shard_bytes} bytes{', ' + source if source else ''}) "
                f"but the GPU's working set is {_gib(ws)} ({ws} bytes, max_recommended_working_set_size of "
                f"mx.device_info()): shard the model over more ranks or use a smaller quantization")
    if shard_bytes > NEAR_WORKING_SET * ws:
        log.warning("this rank's shard (%s) is close to the GPU's working set (%s): little is left for K/V",
                    _gib(shard_bytes), _gib(ws))
    return ""


class WiredLimit:
    """The wired limit of one rank process: :meth:`set` before its shard loads, :meth:`restore` on exit.

    Args:
        device: the :class:`Device` (default :data:`DEVICE`).
        margin: bytes wired beyond the shard (:data:`WIRED_MARGIN_BYTES`, exo PR #1672)."""

    def __init__(self, device: Optional[Device] = None, margin: int = WIRED_MARGIN_BYTES):
        self.device = device or DEVICE
        self.margin = margin
        self.previous: Optional[int] = None  # the limit before set (None: nothing set)
        self.limit = 0

    def set(self, shard_bytes: Optional[int]) -> int:
        """Wire ``min(working set, shard_bytes + margin)`` bytes (the whole working set, as mlx-lm
        does, when ``shard_bytes`` is unknown); returns the limit set, 0 where the device reports no
        working set (CPU: nothing is wired)."""
        ws = working_set_bytes(self.device)
        if not ws:
            log.debug("no Metal working set reported (CPU backend): no memory is wired")
            return 0
        limit = ws if not shard_bytes else min(ws, int(shard_bytes) + self.margin)
        previous = self.device.set_wired_limit(limit)
        if self.previous is None:
            self.previous = previous
        self.limit = limit
        log.info("wired limit %s (working set %s, shard %s)", _gib(limit), _gib(ws),
                 _gib(shard_bytes) if shard_bytes else "unknown")
        return limit

    def restore(self) -> None:
        """Put the limit found by the first :meth:`set` back (after queued work, as mlx-lm's
        ``wired_limit`` does); a no-op when nothing was set."""
        if self.previous is None:
            return
        self.device.synchronize()
        self.device.set_wired_limit(self.previous)
        self.previous, self.limit = None, 0


@contextmanager
def wired(shard_bytes: Optional[int], device: Optional[Device] = None) -> Iterator[WiredLimit]:
    """``with wired(n):`` :meth:`WiredLimit.set` for the block, :meth:`WiredLimit.restore` after it."""
    limit = WiredLimit(device)
    limit.set(shard_bytes)
    try:
        yield limit
    finally:
        limit.restore()


def _available_ram() -> int:
    """Bytes of RAM available now (psutil; else ``sysconf``'s available pages); 0 when unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def kv_budget_bytes(device: Optional[Device] = None, fraction: float = 0.5,
                    available: Optional[int] = None) -> int:
    """Bytes this rank's KV caches may grow to, called once its shard is loaded; never 0.

    On Metal the working set less what is resident (``active_memory``: the shard) less
    :data:`ACTIVATION_MARGIN_BYTES` (mlx-lm sizes against ``max_recommended_working_set_size``);
    on the CPU backend ``fraction`` of the RAM available now (``available``, bytes; default
    psutil's).  Each rank holds its own share of each sequence's K/V (its KV heads, or its
    stage's layers), which is what rank 0 measures per position: the budget is per rank.
    Where nothing is left: :data:`KV_FLOOR_BYTES`, with a warning (requests that need more are
    refused at admission)."""
    device = device or DEVICE
    ws = working_set_bytes(device)
    if ws:
        budget, against = ws - int(device.active_memory) - ACTIVATION_MARGIN_BYTES, f"working set {_gib(ws)}"
    else:
        ram = _available_ram() if available is None else int(available)
        budget, against = int(ram * fraction), f"{fraction:.0%} of {_gib(ram)} RAM available"
    if budget < KV_FLOOR_BYTES:
        log.warning("no memory left for K/V (%s, %s resident): KV budget %s; requests that need more are "
                    "refused", against, _gib(int(device.active_memory)), _gib(KV_FLOOR_BYTES))
        return KV_FLOOR_BYTES
    return budget


def weight_file_bytes(path: str) -> int:
    """Bytes of a model's weight files on disk: a ``.gguf`` file, or a directory's ``*.safetensors``
    and ``*.gguf`` files (their apparent sizes: nothing is read).

    Raises:
        OSError: ``path`` cannot be listed."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
               if f.endswith((".safetensors", ".gguf")))


#: bytes per element of each dequantised weight format (``model/loader.py: WEIGHT_FORMATS``)
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def held_bytes(file_bytes: int, quantization: Optional[Dict[str, Any]], weight_format: str) -> int:
    """Bytes weights of ``file_bytes`` on disk take once loaded as ``weight_format``: as stored for
    ``"quantized"`` (Metal's default, ``model/loader.py: default_weight_format``: packed weights
    stay packed, 16-bit ones stay 16-bit); dequantised, the format's bytes per element over the
    stored bits (``quantization["bits"]``, 4 when unsaid: a 4-bit model held as float32 is 8x its
    file) or over 16 bits for an unquantised model."""
    if weight_format not in _ITEMSIZE:
        return int(file_bytes)
    bits = int((quantization or {}).get("bits") or 4) if quantization else 16
    return int(file_bytes) * _ITEMSIZE[weight_format] * 8 // bits


def shard_share(topo, n_layers: int, rank: int, world_size: int) -> Optional[float]:
    """The part of the model's weights rank ``rank`` of ``world_size`` holds under the
    :class:`~mlxcluster.model.topology.Topology` ``topo``: 1/N in a tensor-parallel group (TP, PD
    groups); in a pipeline its stage's layers over the model's, over the stage's TP size (the
    whole model for ``--local-decode``'s rank 0) -- the layers' share of the weights, as exo's
    ``get_weights_size`` estimates a shard (embeddings and head not apportioned); ``None`` for
    AFD (attention and FFN ranks hold unlike parts: not estimated)."""
    if topo.kind == "afd":
        return None
    if topo.kind == "pipeline":
        if topo.local_decode and rank == 0:
            return 1.0
        stage = topo.route(n_layers).stages[topo.stage_of(rank)]
        return stage.layers.n_layers / n_layers / stage.tp
    return 1.0 / max(1, world_size)


class CacheUpkeep:
    """A periodic ``mx.clear_cache()`` for a rank's decode loop: :meth:`tick` once per step clears
    every ``every`` steps, and sooner -- checked every ``check_every`` steps, one call -- once the
    buffer cache holds more than ``limit`` bytes; at most one clear per ``check_every`` steps
    beyond the periodic one.  mlx-lm: every 256 tokens (``generate_step``), every 512 steps
    (``BatchGenerator``), ``mlx_lm/generate.py``."""

    def __init__(self, device: Optional[Device] = None, every: int = CLEAR_CACHE_STEPS,
                 limit: int = CLEAR_CACHE_BYTES, check_every: int = CACHE_CHECK_STEPS):
        self.device = device or DEVICE
        self.every, self.limit, self.check_every = max(1, every), limit, max(1, check_every)
        self.steps = 0
        self.clears = 0

    def tick(self) -> bool:
        """One decode step; returns whether the cache was cleared."""
        self.steps += 1
        due = self.steps % self.every == 0 or (
            self.limit > 0 and self.steps % self.check_every == 0 and self.device.cache_memory > self.limit)
        if due:
            self.device.clear_cache()
            self.clears += 1
        return due
