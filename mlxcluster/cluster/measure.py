"""What a node measures where a formation starts (issue 31): its compute, its links, its backends.

* **Compute** (:func:`measure_compute`): one decoder layer of the model, run in a child process (``python
  -m mlxcluster.cluster.measure``, started by :class:`~mlxcluster.runtime.supervisor.Supervisor`) so that
  the node loop never blocks and the node daemon never imports the model: the layer's decode time at batch
  1 and at batch :data:`BATCH` (the slope per extra sequence; each timed as sustained work,
  :func:`sustained_time`, so a CPU quota's throttling counts), one prefill chunk of :data:`CHUNK` tokens
  (whole-model prefill throughput: the chunk's time times the layers, plus the head once), and the
  embedding + final norm + output head + argmax of one step.  Only the first layer's weights are read
  (:func:`~mlxcluster.model.tp.build_model`'s ``prepare`` drops the others before they load).  Cached on
  disk by model digest, chip and weight format (:func:`cache_path`), so it runs once per machine per model;
  nodes on one machine share the file and a lock, so one of them measures.  Bounded by
  :data:`COMPUTE_TIMEOUT_S`.
* **Links** (:func:`measure_link`): to each live peer over the node's data-plane address (the interface
  that would carry the collective), through the peer's ``Node.Measure`` RPC over the cluster's mutual
  TLS: the median round trip of :data:`PINGS` empty calls (latency: half of it) and one bulk call of
  :data:`BULK_BYTES` (bandwidth: its bytes over its time less the round trip).  A few tens of ms per peer,
  bounded by :data:`LINK_DEADLINE_S`, re-measured after :data:`LINK_TTL_S`; run on a thread of its own.
* **Backends**: the ``all_sum`` latency a rank measures at load (``runtime/rank.py``'s ``loaded`` event),
  kept per backend by the node.

A node carries its figures in ``Prepare`` and ``Status`` replies (``NodeMeasureMsg``); the coordinator and
``mlxcluster plan --cluster`` combine every node's into :class:`~mlxcluster.cluster.shape.Measurements`
(:func:`combine`).  :class:`DecodeMeter` turns rank 0's ``Info`` counters into measured decode tok/s for the
prediction's comparison (:func:`off_by`).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from ..config import parse_bytes
from .shape import LinkMeasure, Measurements, NodeMeasure, TpLayerMeasure

__all__ = ["Compute", "NodeReport", "measure_compute", "measure_link", "cache_path", "combine", "to_msg",
           "from_msg", "usable_memory_bytes", "parse_memory", "cap_memory", "DecodeMeter", "off_by", "measurements_json", "gather", "plan_view",
           "sustained_time", "SAMPLE_S", "COMPUTE_TIMEOUT_S", "LINK_TTL_S",
           "LINK_DEADLINE_S", "PINGS", "BULK_BYTES", "BULKS", "OFF_BY"]

#: Longest the compute measurement's child process may run (imports, one layer's load, the timings).
COMPUTE_TIMEOUT_S = 120.0
#: A link's measurement is taken again after this many seconds.
LINK_TTL_S = 60.0
#: Bound on one peer's whole link measurement (every call's deadline comes out of it).
LINK_DEADLINE_S = 1.5
#: Empty calls of the latency probe.
PINGS = 5
#: Bytes of each bulk call of the bandwidth probe (under gRPC's 4 MiB message limit).
BULK_BYTES = 1 << 20
#: Bulk calls of the bandwidth probe; the fastest counts.
BULKS = 2
#: Sequences of the batched decode timing, and tokens of the prefill chunk.
BATCH = 4
CHUNK = 128
#: Timed samples of each measurement (after one warm-up); the fastest counts.
REPEATS = 5
#: Seconds each sample runs its measurement back to back (:func:`sustained_time`): many periods of a CPU
#: quota (``cpu.cfs_period_us``: 100 ms by default, 10 ms in benchmarks/bench_shape.py), so the sample
#: runs at the sustained rate a decode step gets, not a burst inside one period's quota.
SAMPLE_S = 0.5
#: A prediction this far off its measurement (a fraction) is logged with the measurements.
OFF_BY = 0.30
#: Memory a rank leaves to the system and the runtime, bytes.
RESERVE_BYTES = 1 << 30


@dataclass(frozen=True)
class Compute:
    """One node's compute figures (see :class:`~mlxcluster.cluster.shape.NodeMeasure` for the units)."""

    layer_s: float
    layer_batch_s: float
    head_s: float
    prefill_tokens_per_s: float


@dataclass(frozen=True)
class NodeReport:
    """What one node reports about itself: its compute (``None`` until measured), its usable memory, its
    links to peers (by peer id), its measured ``all_sum`` per backend (µs) and the tensor-parallel layer
    its last TP formation measured, per backend (:class:`~mlxcluster.cluster.shape.TpLayerMeasure`)."""

    node_id: str
    memory_bytes: int = 0
    compute: Optional[Compute] = None
    chip: str = ""
    host: str = ""
    weights: str = ""
    links: Tuple[LinkMeasure, ...] = ()
    all_sum_us: Mapping[str, float] = field(default_factory=dict)
    error: str = ""
    tp_layers: Tuple[TpLayerMeasure, ...] = ()


# --------------------------------------------------------------------------- wire form


def to_msg(report: NodeReport, ages: Optional[Mapping[str, float]] = None):
    """The ``NodeMeasureMsg`` of ``report`` (``ages``: seconds since each peer's link was measured)."""
    from ..protocol import mlxcluster_pb2 as pb

    c = report.compute
    msg = pb.NodeMeasureMsg(memory_bytes=max(0, int(report.memory_bytes)), chip=report.chip, host=report.host,
                            weights=report.weights, error=report.error)
    if c is not None:
        msg.layer_s, msg.layer_batch_s, msg.head_s = c.layer_s, c.layer_batch_s, c.head_s
        msg.prefill_tokens_per_s = c.prefill_tokens_per_s
    for lk in report.links:
        msg.links.add(peer=lk.b, latency_s=lk.latency_s, bandwidth_bytes_per_s=lk.bandwidth_bytes_per_s,
                      interface=lk.interface, age_s=round((ages or {}).get(lk.b, 0.0), 1))
    for backend, us in report.all_sum_us.items():
        msg.all_sum_us[backend] = float(us)
    for t in report.tp_layers:
        msg.tp_layers.add(backend=t.backend, nodes=list(t.nodes), layer_us=t.layer_s * 1e6,
                          prefill_layer_us=t.prefill_layer_s * 1e6, prefill_tokens=t.prefill_tokens)
    return msg


def _ok(x: float) -> bool:
    return x == x and 0.0 < x < float("inf")


def from_msg(node_id: str, msg) -> NodeReport:
    """A :class:`NodeReport` from node ``node_id``'s ``NodeMeasureMsg``; figures that are not positive
    finite numbers (a peer's bad or missing values) are left out."""
    compute = None
    if _ok(msg.layer_s) and _ok(msg.prefill_tokens_per_s):
        compute = Compute(msg.layer_s, max(0.0, msg.layer_batch_s) if msg.layer_batch_s == msg.layer_batch_s else 0.0,
                          max(0.0, msg.head_s) if msg.head_s == msg.head_s else 0.0, msg.prefill_tokens_per_s)
    links = tuple(LinkMeasure(node_id, lk.peer, lk.latency_s, lk.bandwidth_bytes_per_s, lk.interface)
                  for lk in msg.links if lk.peer and lk.peer != node_id and _ok(lk.bandwidth_bytes_per_s)
                  and lk.latency_s == lk.latency_s and 0.0 <= lk.latency_s < float("inf"))
    sums = {k: v for k, v in msg.all_sum_us.items() if _ok(v)}
    tps = tuple(TpLayerMeasure(t.backend, tuple(t.nodes), t.layer_us * 1e-6,
                               *((t.prefill_layer_us * 1e-6, t.prefill_tokens)
                                 if _ok(t.prefill_layer_us) and t.prefill_tokens > 0 else (0.0, 0)))
                for t in msg.tp_layers if t.backend and len(t.nodes) >= 2 and _ok(t.layer_us))
    return NodeReport(node_id, int(msg.memory_bytes), compute, msg.chip, msg.host, msg.weights, links, sums,
                      msg.error, tps)


def combine(reports: Mapping[str, NodeReport], only: Optional[Tuple[str, ...]] = None) -> Measurements:
    """:class:`Measurements` of the nodes in ``reports`` (``only``: of these node ids) that measured their
    compute and memory: one link per pair that either end measured (both: the slower -- lower bandwidth,
    higher latency), the ``all_sum`` of each backend any node measured (several: the largest, from the
    largest group), and each tensor-parallel formation's measured layer once (its slowest report)."""
    ids = [nid for nid in sorted(reports) if only is None or nid in only]
    nodes = []
    for nid in ids:
        r = reports[nid]
        if r.compute is None or r.memory_bytes <= 0:
            continue
        c = r.compute
        nodes.append(NodeMeasure(nid, r.memory_bytes, c.layer_s, c.prefill_tokens_per_s, c.layer_batch_s, c.head_s,
                                 r.chip, r.host))
    have = {n.node_id for n in nodes}
    pairs: Dict[Tuple[str, str], LinkMeasure] = {}
    for nid in ids:
        for lk in reports[nid].links:
            if lk.a not in have or lk.b not in have:
                continue
            key = tuple(sorted((lk.a, lk.b)))
            old = pairs.get(key)
            if old is None:
                pairs[key] = LinkMeasure(key[0], key[1], lk.latency_s, lk.bandwidth_bytes_per_s, lk.interface)
            else:
                pairs[key] = LinkMeasure(key[0], key[1], max(old.latency_s, lk.latency_s),
                                         min(old.bandwidth_bytes_per_s, lk.bandwidth_bytes_per_s),
                                         old.interface or lk.interface)
    sums: Dict[str, float] = {}
    tps: Dict[Tuple[str, Tuple[str, ...]], TpLayerMeasure] = {}
    for nid in ids:
        for backend, us in reports[nid].all_sum_us.items():
            sums[backend] = max(sums.get(backend, 0.0), us)
        for t in reports[nid].tp_layers:
            old = tps.get((t.backend, t.nodes))
            if all(n in have for n in t.nodes) and (old is None or t.layer_s > old.layer_s):
                tps[(t.backend, t.nodes)] = t
    return Measurements(tuple(nodes), tuple(pairs[k] for k in sorted(pairs)), sums,
                        tuple(tps[k] for k in sorted(tps)))


# --------------------------------------------------------------------------- links


def measure_link(call: Callable[[int, float], None], clock: Callable[[], float] = time.perf_counter,
                 pings: int = PINGS, bulk_bytes: int = BULK_BYTES,
                 deadline_s: float = LINK_DEADLINE_S) -> Tuple[float, float]:
    """``(latency_s, bandwidth_bytes_per_s)`` of one link: ``call(nbytes, timeout_s)`` makes one round trip
    carrying ``nbytes`` (raises on failure); latency is half the shortest of ``pings`` empty round trips,
    bandwidth ``bulk_bytes`` over the fastest of :data:`BULKS` bulk calls' time (fewer when the deadline
    would not allow another) less that round trip (at least a tenth of it).

    The shortest, not the median: the probe's round trip runs through both node daemons, whose gRPC
    threads may wait for the CPU (a busy machine, a CPU quota), and the collective's messages do not;
    a link of 5 ms each way between 0.4-CPU nodes measured 5.5-19 ms by the median (issue 31's
    emulated cluster (b)).  The fastest bulk call: the first on a fresh connection runs in TCP's slow
    start (1 MB over that link: 2-5 MB/s of its 6.25).

    Raises:
        TimeoutError: the probes did not finish within ``deadline_s`` (whatever ``call`` raises, too).
    """
    end = clock() + deadline_s

    def left() -> float:
        rest = end - clock()
        if rest <= 0:
            raise TimeoutError(f"link probe took over {deadline_s:.1f} s")
        return rest

    call(0, left())  # warm-up: connection and TLS handshake
    rtts = []
    for _ in range(max(1, pings)):
        t0 = clock()
        call(0, left())
        rtts.append(clock() - t0)
    rtt = min(rtts)
    bulk = math.inf
    for i in range(BULKS):
        if i and end - clock() < 1.5 * bulk:
            break  # a slow link: no time left for another bulk call within the deadline
        t0 = clock()
        call(bulk_bytes, left())
        bulk = min(bulk, clock() - t0)
    return rtt / 2, bulk_bytes / max(bulk - rtt, bulk / 10, 1e-9)


# --------------------------------------------------------------------------- compute


def parse_memory(text: str) -> int:
    """A memory size as ``join --memory`` takes it (:func:`mlxcluster.config.parse_bytes`'s units), e.g.
    ``"1.5GiB"``, ``"800MB"``, ``"2000000000"``.

    Returns:
        bytes, >= 1 MB.

    Raises:
        ValueError: anything else, or a size below 1 MB (one line).
    """
    return parse_bytes(text, "--memory", "8GiB, 800MB", minimum=10**6, too_small="at least 1 MB")


def cap_memory(memory: int, limit: int) -> int:
    """``join --memory``: a node's memory figure in bytes (what it advertises over mDNS, or what it plans
    its ranks with, :func:`usable_memory_bytes`) capped at ``limit`` bytes (0: no cap; an unknown 0
    becomes the limit)."""
    if limit <= 0:
        return memory
    return min(memory, limit) if memory > 0 else limit


def usable_memory_bytes() -> int:
    """Memory a rank on this machine may use for weights and K/V: on a Mac MLX's recommended working set
    when it reports one, else the memory available now, less :data:`RESERVE_BYTES` (0: unknown)."""
    try:
        import psutil

        avail = int(psutil.virtual_memory().available)
    except Exception:
        avail = 0
    if sys.platform == "darwin":
        from ..engine.memory import working_set_bytes

        ws = working_set_bytes()  # mx.device_info() (mx.metal.device_info() is deprecated)
        if ws:
            avail = min(avail, ws) if avail else ws
    return max(0, avail - RESERVE_BYTES)


def cache_path(cache_dir: str, digest: str, chip: str, weights: str) -> str:
    """The cache file of the compute measurement of model ``digest`` in ``weights`` on ``chip``."""
    key = hashlib.sha256(json.dumps([digest, chip, weights, sys.platform]).encode()).hexdigest()[:24]
    return os.path.join(cache_dir, f"compute-{key}.json")


def _read_cache(path: str) -> Optional[Compute]:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
        c = Compute(float(doc["layer_s"]), float(doc["layer_batch_s"]), float(doc["head_s"]),
                    float(doc["prefill_tokens_per_s"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return c if _ok(c.layer_s) and _ok(c.prefill_tokens_per_s) and c.layer_batch_s >= 0 and c.head_s >= 0 else None


def measure_compute(model_path: str, weights: str, digest: str, chip: str, cache_dir: str,
                    timeout_s: float = COMPUTE_TIMEOUT_S,
                    started: Callable[[object], None] = lambda sup: None) -> Tuple[Optional[Compute], str]:
    """This machine's :class:`Compute` for the model (``(None, why)`` on failure): from the cache when
    there, else measured by a child process (and cached).  Blocks up to ``timeout_s`` (plus the wait for a
    co-located node measuring the same under the cache's lock); call it off the node loop.  ``started``
    gets the child's :class:`~mlxcluster.runtime.supervisor.Supervisor` (its ``stop()`` ends the
    measurement: a node stopping)."""
    path = cache_path(cache_dir, digest, chip, weights)
    got = _read_cache(path)
    if got is not None:
        return got, ""
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = open(path + ".lock", "a")
    except OSError as exc:
        return None, f"cannot use the measurement cache {cache_dir}: {exc}"
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a node on this machine measuring the same: its result, below
        got = _read_cache(path)
        if got is not None:
            return got, ""
        got, err = _run_child(model_path, weights, timeout_s, started)
        if got is not None:
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "w", encoding="utf-8") as fh:
                    json.dump({"layer_s": got.layer_s, "layer_batch_s": got.layer_batch_s, "head_s": got.head_s,
                               "prefill_tokens_per_s": got.prefill_tokens_per_s, "chip": chip,
                               "weights": weights, "model_digest": digest}, fh)
                os.replace(tmp, path)
            except OSError:
                pass
        return got, err


def _run_child(model_path: str, weights: str, timeout_s: float,
               started: Callable[[object], None]) -> Tuple[Optional[Compute], str]:
    from ..runtime.supervisor import Supervisor, rank_env

    sup = Supervisor()
    try:
        sup.spawn([sys.executable, "-m", "mlxcluster.cluster.measure", "--model", model_path, "--weights", weights],
                  rank_env(1), name="measure")
    except OSError as exc:
        return None, f"cannot start the measurement: {exc}"
    started(sup)
    try:
        def done() -> bool:
            return any(e.get("event") in ("measured", "error") for e in sup.events) or \
                all(p.returncode is not None for p in sup.processes)
        if not sup.wait_for(done, timeout_s):
            return None, f"the compute measurement took over {timeout_s:.0f} s"
        for e in sup.events:
            if e.get("event") == "measured":
                try:
                    c = Compute(float(e["layer_s"]), float(e["layer_batch_s"]), float(e["head_s"]),
                                float(e["prefill_tokens_per_s"]))
                except (KeyError, TypeError, ValueError):
                    break
                return c, ""
            if e.get("event") == "error":
                return None, f"the compute measurement failed: {e.get('message', '?')}"
        return None, "the compute measurement failed: " + (sup.failure or "it stopped")
    finally:
        sup.stop(timeout_s=2.0)


def sustained_time(run: Callable[[], None], clock: Callable[[], float] = time.perf_counter,
                   repeats: int = REPEATS, sample_s: float = SAMPLE_S, max_calls: int = 10_000) -> float:
    """Seconds per call of ``run`` (one call: the work, evaluated), as sustained work runs it: each of
    ``repeats`` samples calls ``run`` back to back for at least ``sample_s`` seconds (at most
    ``max_calls`` calls) and counts its time per call; the fastest sample counts (the least disturbed
    by other work on the machine: a shared host's contention is the cost model's, ``host_slowdown``).

    A sample spans many calls, not one: under a CPU quota (a cgroup's ``cpu.cfs_quota_us`` per
    ``cpu.cfs_period_us``: a container, a node given part of a machine) a single call of a few ms runs
    at the core's full speed inside one period's quota, while a decode step's tens of ms are throttled
    to the quota's share -- the fastest single call measured a 0.5-CPU node ~2x faster than its decode
    steps ran (issue 31's emulated clusters, benchmarks/bench_shape.py).  One warm-up call first."""
    run()
    best = float("inf")
    for _ in range(max(1, repeats)):
        calls, t0 = 0, clock()
        while True:
            run()
            calls += 1
            elapsed = clock() - t0
            if elapsed >= sample_s or calls >= max_calls:
                break
        best = min(best, elapsed / calls)
    return best


def _best_time(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    import mlx.core as mx

    return sustained_time(lambda: mx.eval(fn()), repeats=repeats)


def compute_of(model, n_layers: int) -> Compute:
    """Time ``model``'s first decoder layer (the others dropped) and its head (see the module docstring)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    lm = model._lm
    inner = lm.model
    layer = inner.layers[0]
    h = int(inner.embed_tokens.weight.shape[-1]) if hasattr(inner.embed_tokens, "weight") else int(model.args.hidden_size)
    from mlx.utils import tree_flatten

    floats = [v for _, v in tree_flatten(layer.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    dtype = floats[0].dtype if floats else mx.float32

    def decode(batch: int) -> float:
        cache = KVCache()
        mx.eval(layer(mx.random.normal((batch, 32, h)).astype(dtype), mask="causal", cache=cache))  # 32 positions
        x = mx.random.normal((batch, 1, h)).astype(dtype)

        def step():
            out = layer(x, mask=None, cache=cache)
            cache.offset -= 1  # the same position again: the cache does not grow
            return out
        return _best_time(step)

    t1 = decode(1)
    tb = decode(BATCH)
    chunk = mx.random.normal((1, CHUNK, h)).astype(dtype)
    t_chunk = _best_time(lambda: layer(chunk, mask="causal", cache=KVCache()), max(3, REPEATS // 2))
    ids = mx.array([[1]])
    hn = mx.random.normal((1, 1, h)).astype(dtype)
    t_head = _best_time(lambda: (inner.embed_tokens(ids), mx.argmax(model.head(inner.norm(hn))[:, -1], axis=-1)))
    prefill = CHUNK / (n_layers * t_chunk + t_head)
    return Compute(t1, max(0.0, (tb - t1) / (BATCH - 1)), t_head, prefill)


def main(argv: Optional[List[str]] = None) -> int:
    """The child process: load the model's first layer, time it, emit ``measured`` (or ``error``)."""
    from ..runtime.supervisor import emit

    ap = argparse.ArgumentParser(prog="python -m mlxcluster.cluster.measure")
    ap.add_argument("--model", required=True)
    ap.add_argument("--weights", required=True)
    args = ap.parse_args(argv)
    try:
        from ..model.loader import read_model
        from ..model.tp import build_model

        source = read_model(args.model, tokenizer=False)

        def first_layer_only(m) -> None:
            m._lm.model.layers = m._lm.model.layers[:1]
        model = build_model(source.config, source.weights, source.quantization, args.weights, None,
                            consume_weights=True, prepare=first_layer_only)
        c = compute_of(model, int(source.n_layers))
        emit("measured", layer_s=c.layer_s, layer_batch_s=c.layer_batch_s, head_s=c.head_s,
             prefill_tokens_per_s=c.prefill_tokens_per_s, host=socket.gethostname())
        return 0
    except Exception as exc:  # one line to the node
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        emit("error", message=msg)
        return 1


# --------------------------------------------------------------------------- prediction vs measurement


class DecodeMeter:
    """Measured single-stream decode tok/s from rank 0's ``Info`` counters, read once per probe: only the
    intervals over which exactly one sequence ran at both ends count (tokens over seconds); ``None`` until
    :attr:`min_tokens` tokens were counted."""

    def __init__(self, min_tokens: int = 16):
        self.min_tokens = min_tokens
        self._last: Optional[Tuple[float, int, int]] = None  # (time, generated tokens, running)
        self.tokens = 0
        self.seconds = 0.0

    def update(self, now: float, generated_tokens: int, running: int) -> None:
        last = self._last
        self._last = (now, generated_tokens, running)
        if last is None or last[2] != 1 or running != 1 or generated_tokens < last[1] or now <= last[0]:
            return
        self.tokens += generated_tokens - last[1]
        self.seconds += now - last[0]

    @property
    def tok_s(self) -> Optional[float]:
        return self.tokens / self.seconds if self.tokens >= self.min_tokens and self.seconds > 0 else None


def plan_view(msg) -> Optional[Dict[str, object]]:
    """A ``PlanMsg`` as the dashboard's and ``status --json``'s dict (``None``: no plan): ``label``,
    ``mode``, predicted ``decode_tok_s`` and ``ttft_s`` (for ``prompt_tokens``), ``measured_decode_tok_s``
    and ``measured_ttft_s`` (``None`` until measured), ``note``."""
    if msg is None:
        return None
    return {"label": msg.label, "mode": msg.mode, "decode_tok_s": round(msg.decode_tok_s, 2) or None,
            "ttft_s": round(msg.ttft_s, 3) or None, "prompt_tokens": msg.prompt_tokens,
            "measured_decode_tok_s": round(msg.measured_decode_tok_s, 2) or None,
            "measured_ttft_s": round(msg.measured_ttft_s, 3) or None, "note": msg.note}


def gather(cluster: str, interfaces, timeout_s: float, creds) -> Tuple[Dict[str, NodeReport], List[str], Dict[str, str]]:
    """Every node of ``cluster`` found over mDNS within ``timeout_s``, asked for its ``Status`` (mutual
    TLS, side by side): ``(reports by node id, notes, model digest by node id)``; a note per node that did
    not answer, reports no measurements, or has not measured its compute.

    Raises:
        ValueError: an unknown interface.
        OSError: the mDNS sockets cannot be opened.
    """
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from ..protocol import mlxcluster_pb2 as pb
    from ..protocol import mlxcluster_pb2_grpc as pb_grpc
    from ..security import describe_rpc_error, node_name
    from .discovery import browse, resolve_interfaces

    def node_status(info):  # as client.node_status (which this module cannot import: a cycle)
        channel = creds.channel(f"{info.address}:{info.port}", node_name(info.node_id))
        try:
            return pb_grpc.NodeStub(channel).Status(pb.NodeStatusRequest(), timeout=2.0)
        finally:
            channel.close()

    infos = browse(cluster, resolve_interfaces(list(interfaces)) if interfaces else [], timeout_s)
    reports: Dict[str, NodeReport] = {}
    notes: List[str] = []
    digests: Dict[str, str] = {}

    def ask(info):
        try:
            return info, node_status(info), None
        except grpc.RpcError as exc:
            return info, None, describe_rpc_error(exc)
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(ask, infos))
    for info, st, err in answers:
        nid = info.node_id
        if st is None:
            notes.append(f"node {nid}: unreachable ({err})")
            continue
        digests[nid] = st.model_digest
        if not st.HasField("measure"):
            notes.append(f"node {nid}: reports no measurements (an mlxcluster without them)")
            continue
        r = reports[nid] = from_msg(nid, st.measure)
        if r.compute is None:
            notes.append(f"node {nid}: " + (f"compute not measured: {r.error}" if r.error else "still measuring its compute"))
    return reports, notes, digests


def measurements_json(m: Measurements) -> Dict[str, object]:
    """``m`` in the JSON form :func:`~mlxcluster.cluster.shape.measurements_from_json` reads (``plan
    --measurements FILE``), for a log line or a file."""
    from dataclasses import asdict

    return {"nodes": [asdict(n) for n in m.nodes], "links": [asdict(lk) for lk in m.links],
            "all_sum_us": dict(m.all_sum_us),
            "tp_layers": [dict(asdict(t), nodes=list(t.nodes)) for t in m.tp_layers]}


def off_by(predicted: float, measured: float) -> float:
    """``|predicted - measured| / measured`` (0 when either is unknown)."""
    if not (predicted > 0 and measured > 0):
        return 0.0
    return abs(predicted - measured) / measured


if __name__ == "__main__":
    sys.exit(main())
