"""One rank process: join the MLX group, load this rank's shard, serve.

Started by the local launcher (``mlxcluster.runtime.launcher``), by ``mpirun``,
or by a node daemon; never by users directly::

    python -m mlxcluster.runtime.rank --config '{"world_size":3,"ports":[50100,50101,50102],...}'

Its one argument is the rank's whole configuration, a
:class:`~mlxcluster.runtime.rank_config.RankConfig` as JSON (a standby rank,
``--standby``, reads the same object from its bootstrap line instead).

Ring backend: ``MLX_RANK`` and ``MLX_HOSTFILE`` (the JSON list of
``["ip:port"]`` per rank that ``mlx.launch`` writes) come from the environment.
MPI backend: ``mpirun`` provides the rank.

Rank 0 serves the client-facing ``Generation`` service on ``ports[0]``; rank
``r >= 1`` serves ``RankControl`` on ``ports[r]``.  Progress is reported as
JSON lines on stdout, prefixed with ``@@mlxcluster``
(:func:`mlxcluster.runtime.supervisor.emit`).

The group's topology is the configuration's
:class:`~mlxcluster.model.topology.Topology`, checked by ``Topology.validate`` against the model
(the same check ``mlxcluster`` ran before it started the ranks; a rank of ``join`` or a test gets
it here).

Decode modes are fields, not environment toggles: ``compile`` (world size 1 decodes with
``mx.compile``); ``kv_bits`` / ``kv_group_size`` (quantized KV caches,
:mod:`mlxcluster.engine.kvquant`; every rank of a group is given the same).  Defaults of
``max_batch``, ``max_queue`` and ``itl_target_ms`` come from :func:`mlxcluster.config.config`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from concurrent import futures
from typing import Callable, List, Optional, Tuple

_STARTED = time.perf_counter()  # this module's import: near the process's start (for the events' timings)

os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # as in cli.py: failed handshakes are ours to report

from .. import failpoints  # noqa: E402
from ..config import Config, config  # noqa: E402
from .rank_config import RankConfig, prompt_cache_refusal  # noqa: E402
from .supervisor import emit

log = logging.getLogger("mlxcluster.rank")


def _parse(argv: List[str], cfg: Config) -> RankConfig:
    """The :class:`RankConfig` of a rank's command line, ``--config JSON``, with
    :func:`_resolved`'s defaults.

    Raises:
        ValueError: another command line, or a configuration :meth:`RankConfig.from_json` refuses (one line).
    """
    if len(argv) != 2 or argv[0] != "--config":
        raise ValueError("usage: python -m mlxcluster.runtime.rank --config JSON (a RankConfig), "
                         "or --standby [--model PATH]")
    return _resolved(RankConfig.from_json(argv[1]), cfg)


def _resolved(rc: RankConfig, cfg: Config) -> RankConfig:
    """``rc`` with this process's settings (:func:`mlxcluster.config.config`) where it leaves them
    open: ``max_batch``, ``max_queue``, ``itl_target_ms``; and a join node's prompt-cache directory
    (``MLXCLUSTER_PROMPT_CACHE_DIR``: mpirun gives every MPI rank rank 0's command line, so each node's
    own directory reaches its MPI ranks in their environment) as a node default
    (``prompt_cache_node``), used where the formation's topology keeps a disk tier."""
    node = not rc.prompt_cache_dir and bool(cfg.prompt_cache_dir)
    return dataclasses.replace(
        rc, max_batch=cfg.max_batch if rc.max_batch is None else rc.max_batch,
        max_queue=cfg.max_queue if rc.max_queue is None else rc.max_queue,
        itl_target_ms=float(cfg.itl_target_ms) if rc.itl_target_ms is None else rc.itl_target_ms,
        prompt_cache_dir=cfg.prompt_cache_dir if node else rc.prompt_cache_dir,
        prompt_cache_size=cfg.prompt_cache_size if node else rc.prompt_cache_size,
        prompt_cache_node=rc.prompt_cache_node or node)


def _kv_format(args, source):
    """The :class:`~mlxcluster.engine.kvquant.KvFormat` of ``--kv-bits`` / ``--kv-group-size`` for
    ``source``'s model.

    Raises:
        ValueError: a group size that is not supported or does not divide the model's head_dim (one line)."""
    from ..engine.kvquant import config_head_dim, kv_format

    if not args.kv_bits:  # full precision: nothing to check against the model
        return kv_format(0)
    return kv_format(args.kv_bits, args.kv_group_size, config_head_dim(source.config) or None)


class _DiskWriter:
    """The prompt cache's one writer thread behind a bounded queue: :meth:`submit` never blocks
    the MLX thread (a full queue drops the write: False)."""

    def __init__(self, depth: int = 2):
        import queue

        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        threading.Thread(target=self._run, name="prompt-cache-writer", daemon=True).start()

    def submit(self, write) -> bool:
        import queue

        try:
            self._queue.put_nowait(write)
            return True
        except queue.Full:
            return False

    def _run(self) -> None:
        while True:
            write = self._queue.get()
            try:
                write()
            except Exception:  # one failed write never ends the writer
                log.warning("prompt cache: write failed", exc_info=True)


def _group_min(group):
    """``int -> int``: the fewest of the value every rank of ``group`` passes (``all_min``; a
    collective: every rank must call it at the same point of its plan)."""
    import mlx.core as mx

    def agree(n: int) -> int:
        return int(mx.distributed.all_min(mx.array([int(n)], dtype=mx.int32), group=group, stream=mx.cpu).item())

    return agree


def _prompt_cache(args, group, source, model, weights, topo):
    """This rank's :class:`~mlxcluster.engine.prompt_disk.DiskPrompts` for ``--prompt-cache-dir``
    (None without).

    Raises:
        ValueError: a group it cannot serve, or a bad ``--prompt-cache-size`` (one line).
        OSError: the directory cannot be made or written."""
    if not args.prompt_cache_dir:
        return None
    from ..engine.kvquant import format_of
    from ..engine.prompt_disk import DEFAULT_SIZE, DiskPrompts, Identity, parse_size

    why = prompt_cache_refusal(topo)
    if why and args.prompt_cache_node:  # the node's default: this formation keeps none
        log.warning("%s: this rank keeps no disk tier", why)
        return None
    if why:
        raise ValueError(why)
    size = parse_size(args.prompt_cache_size) if args.prompt_cache_size else DEFAULT_SIZE
    c = source.config
    # the K/V layout as a handoff names it (kv_identity), with this rank's KV heads; the topology, rank and
    # world size in the identity name the shard
    heads = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    try:
        heads = int(getattr(model.model.layers[0].self_attn, "n_kv_heads", heads))
    except (AttributeError, IndexError, TypeError):
        pass
    kv = kv_identity(source, weights, heads, _kv_dtype(model), format_of(model))
    identity = Identity(model_digest=kv.digest, weights=weights, rank=group.rank(), world_size=group.size(),
                        topology=" ".join(topo.to_args()), n_layers=int(c["num_hidden_layers"]),
                        n_kv_heads=kv.n_kv_heads, head_dim=kv.head_dim, kv_dtype=kv.dtype, kv_bits=kv.kv_bits,
                        kv_group_size=kv.kv_group_size)
    return DiskPrompts(args.prompt_cache_dir, size, identity, submit=_DiskWriter().submit)


def init_group(backend: str, world_size: int):
    """Join the MLX distributed group of ``world_size`` ranks over ``backend``
    (``ring``, ``mpi``, ``jaccl``); a singleton group at world size 1.

    Raises:
        RuntimeError: the backend formed a group of another size.
    """
    import mlx.core as mx

    if world_size == 1:
        return mx.distributed.init(backend="any")  # a singleton group
    group = mx.distributed.init(backend=backend, strict=True)
    if group.size() != world_size:
        raise RuntimeError(f"{backend} backend formed a group of {group.size()} ranks, expected {world_size}")
    return group


def _fit_and_wire(info, weights: str, topo, group, wired) -> Optional[int]:
    """Check this rank's shard of ``info``'s model against the device's working set and wire it
    (:class:`~mlxcluster.engine.memory.WiredLimit` ``wired``), before any weight is read.  The shard's
    bytes: the weight files' size, as held in ``weights`` (:func:`~mlxcluster.engine.memory.held_bytes`),
    times this rank's share under ``topo`` (:func:`~mlxcluster.engine.memory.shard_share`).  Returns
    them (``None``: not estimated).

    Raises:
        ShardTooLarge: the shard exceeds the working set (one line naming the numbers)."""
    from ..engine import memory as mem

    share = mem.shard_share(topo, info.n_layers, group.rank(), group.size())
    files = mem.weight_file_bytes(info.path)
    need = None if share is None else int(mem.held_bytes(files, info.quantization, weights) * share)
    why = mem.fit_refusal(need, wired.device, f"{share or 0:.3g} of the {files} bytes of weight files, "
                                              f"held as {weights}")
    if why:
        raise mem.ShardTooLarge(why)
    wired.set(need)
    return need


def _load(args, group, preloaded=None, wired=None):
    """This rank's ``(source, model, weights, topology, tokenizer_job)``: the model of ``--model``,
    the topology of its :class:`RankConfig` ``args`` validated against that model and
    ``group`` (:meth:`Topology.validate`, where every rule lives), and this rank's part of the model.
    ``preloaded``: a standby's :class:`~mlxcluster.model.loader.ModelSource`, used when it is
    the file ``--model`` names (:func:`_standby`).  ``tokenizer_job``: on rank 0, the future of
    ``(tokenizer, eos_token_ids)`` built in a thread while the shard loads (:func:`_with_tokenizer`
    puts them in the source before rank 0 serves); ``None`` where the source has its own or
    needs none (ranks >= 1 never tokenise).  ``wired``: this process's
    :class:`~mlxcluster.engine.memory.WiredLimit` (default: a new one on the real device): the
    shard is checked and wired before its weights are read (:func:`_fit_and_wire`); the caller
    restores it on exit.

    Raises:
        TopologyError: a topology the model or the group cannot run (one line).
        LayoutError: tensor-parallel stages on a backend that cannot split groups (MLX's ring).
        ShardTooLarge: the shard cannot fit the GPU's working set (one line; nothing was loaded).
    """
    from ..engine.kvquant import set_format
    from ..engine.memory import WiredLimit
    from ..model.layout import LayoutError
    from ..model.loader import default_weight_format, read_model
    from ..model.tp import build_model

    wired = wired if wired is not None else WiredLimit()
    path = args.model or config().model
    weights = args.weights or default_weight_format()
    checked = []

    def check(info) -> None:  # before the weights are read: a topology or a shard that cannot run
        topo = args.group_topology().validate(info.config, name=info.name, quantization=info.quantization,
                                                 weights=weights)
        topo.check_group(group.size())
        _fit_and_wire(info, weights, topo, group, wired)
        checked.append(topo)

    same = preloaded is not None and os.path.realpath(preloaded.path) == os.path.realpath(path)
    if same:
        check(preloaded)
    source = preloaded if same else read_model(path, tokenizer=False, before_weights=check)
    topo = checked[0]
    job = None
    if not same and group.rank() == 0:  # rank 0 alone tokenises
        from ..model.loader import tokenizer_of

        job = _tokenizer_worker().submit(tokenizer_of, source)
    kv_fmt = _kv_format(args, source)  # before the weights load: a bad group size is one line at once
    n = source.n_layers
    if topo.afd is not None:
        from ..model.afd import AfdModel, prune_for_afd

        layout = topo.afd_layout(n)
        whole = build_model(source.config, source.weights, source.quantization, weights, None, consume_weights=True,
                            prepare=lambda m: prune_for_afd(m, layout, group.rank()))
        model = AfdModel(whole, layout, group, topo.afd_microbatches)
        set_format(model, kv_fmt)
        return source, model, weights, topo, job
    if topo.layers is not None:  # pipeline: each rank holds whole layers (its stage's)
        from ..model.pp import PipelinedModel, PipelineStage, prune_to_stage

        route = topo.route(n)
        me = route.stages[topo.stage_of(group.rank())]  # this rank's row of the grid
        stage_group = None
        if any(s.tp > 1 for s in route.stages):
            try:  # a collective: every rank splits, also those of single-rank stages
                stage_group = group.split(me.index)
            except Exception as exc:  # MLX's ring: "Group split not supported"
                raise LayoutError(f"tensor-parallel stages need a backend that splits groups (mpi): {exc}") from None
            if me.tp == 1:
                stage_group = None
        keep_all = topo.local_decode and group.rank() == 0  # decodes alone: every layer
        # the other layers are dropped before they are materialised: a stage's memory is its share
        whole = build_model(source.config, source.weights, source.quantization, weights, stage_group,
                            consume_weights=True,
                            prepare=None if keep_all else (lambda m: prune_to_stage(m, me.layers)))
        stage = PipelineStage(whole, me.layers, prune=not keep_all)
        identity = None
        if topo.local_decode:
            c = source.config
            identity = kv_identity(source, weights, int(c.get("num_key_value_heads") or c["num_attention_heads"]),
                                   str(stage.blocks[0].input_layernorm.weight.dtype).rsplit(".", 1)[-1], kv_fmt)
        model = PipelinedModel(stage, route, group, stage_group, epoch=args.epoch, local_decode=topo.local_decode,
                               identity=identity, relay=topo.pp_logits == "relay")
        set_format(model, kv_fmt)  # and its stage's model (--local-decode's rank 0 decodes on it)
        return source, model, weights, topo, job
    # consume_weights: full-size arrays are freed layer by layer as this rank's slices materialise
    model = build_model(source.config, source.weights, source.quantization, weights, group,
                        consume_weights=True)
    set_format(model, kv_fmt)
    return source, model, weights, topo, job


def _with_tokenizer(source, job) -> None:
    """Put rank 0's tokenizer (``job``: :func:`_load`'s future) into ``source``.

    Raises:
        ModelError: the tokenizer could not be built."""
    if job is not None:
        source.tokenizer, source.eos_token_ids = job.result()


def kv_identity(source, weights: str, n_heads: int, dtype: str, fmt=None):
    """The :class:`ModelIdentity` of K/V this process computes: model digest, weight format,
    ``n_heads`` KV heads (this rank's), head dim, K/V dtype, and the KV format ``fmt`` (a
    :class:`~mlxcluster.engine.kvquant.KvFormat`, ``--kv-bits`` / ``--kv-group-size``; ``None``: full
    precision)."""
    from ..engine.kvquant import FULL, config_head_dim
    from ..model.loader import model_digest
    from ..engine.handoff import identity_of

    fmt = fmt or FULL
    return identity_of(model_digest(source.path), weights, n_heads, config_head_dim(source.config), dtype, fmt.bits,
                       fmt.group_size)


def _kv_dtype(model) -> str:
    return str(model.model.layers[0].input_layernorm.weight.dtype).rsplit(".", 1)[-1]


def _kv_report(source, model) -> dict:
    """The ``loaded`` event's KV fields: ``kv_bits`` (0: full precision), ``kv_group_size`` (0 then) and
    ``kv_bytes_per_token`` (this rank's keys + values of one position over every full-attention layer
    it holds, :func:`~mlxcluster.engine.kvquant.bytes_per_token`)."""
    import mlx.core as mx

    from ..engine.kvquant import bytes_per_token, config_head_dim, format_of

    fmt = format_of(model)
    try:
        blocks = list(model.layers)
        dtype = blocks[0].input_layernorm.weight.dtype if blocks else mx.float32
        per_token = bytes_per_token(model, config_head_dim(source.config), mx.zeros((), dtype=dtype).itemsize)
    except Exception:  # an unusual wrapper: the format alone
        per_token = 0
    return dict(kv_bits=fmt.bits, kv_group_size=fmt.group_size, kv_bytes_per_token=per_token)


def _pd_sides(args, topo, group, source, model, weights, creds):
    """``(prefill_service, decode_side)`` for a validated PD ``topo`` (``--role prefill`` /
    ``--prefill-peer``; else ``None``s).  Its rules (one rank, no pipeline, ...) are
    :meth:`Topology.validate`'s."""
    if not topo.pd:
        return None, None
    from ..engine.kvquant import format_of

    c = source.config
    n_kv = int(c.get("num_key_value_heads") or c["num_attention_heads"])
    dtype = _kv_dtype(model)
    if topo.role == "prefill":
        from ..leader.pd import PrefillService

        digest_identity = kv_identity(source, weights, n_kv, dtype, format_of(model))

        def identity(n: int):
            out = type(digest_identity)()
            out.CopyFrom(digest_identity)
            out.n_kv_heads = n
            return out

        return PrefillService(model, None, source.vocab_size, source.context_length, identity, n_kv,
                              max_queue=args.max_queue), None
    from ..engine.pd import head_slice
    from ..leader.pd import DecodeSide

    head0, n = head_slice(n_kv, group.size(), group.rank())
    return None, DecodeSide(topo.prefill_peer, creds, group.rank(), group.size(), int(c["num_hidden_layers"]),
                            kv_identity(source, weights, n, dtype, format_of(model)), head0)


def all_sum_times(group, hidden: int, iterations: int, warmup: int = 3) -> List[float]:
    """Seconds taken by each of ``iterations`` ``all_sum``s of a decode-sized (1, 1, ``hidden``)
    float32 tensor over ``group``, after ``warmup`` untimed ones (the first calls connect).
    Every rank must call it (a collective).

    Raises:
        RuntimeError: the sum is wrong (a broken group)."""
    import mlx.core as mx

    x = mx.ones((1, 1, hidden), dtype=mx.float32)
    mx.eval(x)
    for _ in range(warmup):
        mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))
    times, y = [], x
    for _ in range(iterations):
        t0 = time.perf_counter()
        y = mx.distributed.all_sum(x, group=group, stream=mx.cpu)
        mx.eval(y)
        times.append(time.perf_counter() - t0)
    if float(y[0, 0, 0].item()) != group.size():  # sums of ones are exact
        raise RuntimeError(f"all_sum gave {y[0, 0, 0].item()}, expected {group.size()}")
    return times


#: Seconds each probe runs back to back (:func:`all_sum_latency_us`, :func:`tp_layer_us`) under a CPU
#: quota: several periods of it (a cgroup's 100 ms default period; 10 ms in benchmarks/bench_shape.py),
#: yet a small part of a group start.
PROBE_S = 0.3
#: ... and without one (:func:`probe_window_s`): no throttled periods to average over, only calls
#: (a decode layer ~1 ms here: dozens of them).
PROBE_FREE_S = 0.05


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[Tuple[int, int]]:
    """``(quota_us, period_us)`` of the tightest CPU quota on this process's cgroup path, from the
    cgroup v2 ``cpu.max`` or the v1 ``cpu`` controller's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``
    of each group from the process's own up to the root (Linux kernel documentation,
    ``admin-guide/cgroup-v2.rst`` "cpu.max" and ``scheduler/sched-bwc.rst``); ``None`` without one
    (macOS, an unlimited group, unreadable files)."""
    try:
        with open(proc_cgroup, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    found: List[Tuple[int, int]] = []

    def walk(base: str, rel: str, read) -> None:
        parts = [x for x in rel.strip("/").split("/") if x]
        for depth in range(len(parts), -1, -1):
            got = read(os.path.join(base, *parts[:depth]))
            if got is not None:
                found.append(got)

    def v2(d: str) -> Optional[Tuple[int, int]]:
        try:
            with open(os.path.join(d, "cpu.max"), encoding="utf-8") as fh:
                quota, period = (fh.read().split() + ["100000"])[:2]
            return None if quota == "max" else (int(quota), int(period))
        except (OSError, ValueError):
            return None

    def v1(d: str) -> Optional[Tuple[int, int]]:
        try:
            with open(os.path.join(d, "cpu.cfs_quota_us"), encoding="utf-8") as fh:
                quota = int(fh.read().strip())
            with open(os.path.join(d, "cpu.cfs_period_us"), encoding="utf-8") as fh:
                period = int(fh.read().strip())
        except (OSError, ValueError):
            return None
        return (quota, period) if quota > 0 and period > 0 else None

    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if hier == "0" and controllers == "":
            walk(root, rel, v2)
        elif "cpu" in controllers.split(","):
            for name in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                if os.path.isdir(os.path.join(root, name)):
                    walk(os.path.join(root, name), rel, v1)
                    break
    return min(found, key=lambda qp: qp[0] / qp[1]) if found else None


def probe_window_s(quota: Optional[Tuple[int, int]]) -> float:
    """Seconds each load-time probe runs: :data:`PROBE_S` under a CPU ``quota`` (:func:`cpu_quota`),
    else :data:`PROBE_FREE_S`."""
    return PROBE_S if quota else PROBE_FREE_S
#: Calls between two agreements to stop (:func:`sustained_collective_s`).
PROBE_CHUNK = 8
#: Bound on the probe's chunks whatever the clock says (8 x 400 calls).
PROBE_MAX_CHUNKS = 400


def sustained_collective_s(call: Callable[[], None], any_done: Callable[[bool], bool], seconds: float = PROBE_S,
                           chunk: int = PROBE_CHUNK, max_chunks: int = PROBE_MAX_CHUNKS,
                           clock: Callable[[], float] = time.perf_counter) -> float:
    """Mean seconds per ``call`` (one collective, evaluated) over back-to-back calls lasting about
    ``seconds``: calls run in chunks of ``chunk``; after each chunk every rank passes ``any_done``
    whether its own clock passed ``seconds`` and gets back whether any rank's did (itself a collective,
    untimed), so every rank stops after the same chunk -- a count agreed without a coordinator.

    Sustained, not burst: under a CPU quota (cgroup ``cpu.max``) 30 back-to-back all_sums fit in one
    period's quota and read the link's burst latency (106 µs), while a decode step's all_sums wait on
    throttled peers (4-9 ms; issue 31's emulated cluster (a), BENCHMARKS.md).  The mean, not the median:
    the waits on a throttled peer are the cost."""
    total, calls, t_start = 0.0, 0, clock()
    for _ in range(max(1, max_chunks)):
        t0 = clock()
        for _ in range(max(1, chunk)):
            call()
        total += clock() - t0
        calls += max(1, chunk)
        if any_done(clock() - t_start >= seconds):
            break
    return total / calls


def _any_done(group) -> Callable[[bool], bool]:
    """:func:`sustained_collective_s`'s agreement over ``group``: whether any rank passed ``True``
    (an ``all_sum`` of the ranks' flags)."""
    import mlx.core as mx

    def any_done(done: bool) -> bool:
        flag = mx.distributed.all_sum(mx.array([1.0 if done else 0.0]), group=group, stream=mx.cpu)
        return float(flag.item()) > 0
    return any_done


def all_sum_latency_us(group, hidden: int, seconds: float = PROBE_S) -> float:
    """Sustained mean latency of ``all_sum`` of a decode-sized (1, 1, ``hidden``) float32 tensor over
    ``group``, in µs (0.0 at world size 1; :func:`sustained_collective_s`, after 3 untimed calls that
    connect).  Every rank must call it (a collective).

    Raises:
        RuntimeError: the sum is wrong (a broken group)."""
    import mlx.core as mx

    if group.size() == 1:
        return 0.0
    x = mx.ones((1, 1, hidden), dtype=mx.float32)
    mx.eval(x)
    out = [x]

    def call() -> None:
        out[0] = mx.distributed.all_sum(x, group=group, stream=mx.cpu)
        mx.eval(out[0])

    for _ in range(3):
        call()
    mean = sustained_collective_s(call, _any_done(group), seconds)
    if float(out[0][0, 0, 0].item()) != group.size():  # sums of ones are exact
        raise RuntimeError(f"all_sum gave {out[0][0, 0, 0].item()}, expected {group.size()}")
    return mean * 1e6


#: Prompt tokens of the prefill half of the tensor-parallel layer probe (:func:`tp_layer_us`): the compute
#: measurement's prefill chunk (:data:`mlxcluster.cluster.measure.CHUNK`).
PREFILL_PROBE_TOKENS = 128


def tp_layer_us(group, model, hidden: int, tokens: int = 1, seconds: float = PROBE_S) -> float:
    """Sustained mean time of one of this rank's tensor-parallel decoder layers, in µs: the first layer
    of ``model`` (sharded over ``group``: its share of the matmuls and the two ``all_sum``s of attention
    and MLP outputs) back to back (:func:`sustained_collective_s`, after 2 untimed calls) -- ``tokens``
    = 1: one decode token at the position after 32 cached ones; more: a prompt of ``tokens`` tokens
    from position 0 (causal).  0.0 at world size 1.

    Why a layer and not only the bare ``all_sum`` probe (:func:`all_sum_latency_us`): what a step's
    ``all_sum`` costs depends on the compute between them -- waits for the slowest rank, and under a
    CPU quota (cgroup ``cpu.max``) waits for throttled peers, which depend on the quota periods' phases
    and on the duty cycle (issue 31's emulated clusters: the bare probe read 0.1-12.5 ms where decode
    steps' all_sums cost 1.2-9.5 ms, and a 128-token prefill's far more).  The shape planner derives the
    in-step ``all_sum`` from this figure and its own compute model (:func:`mlxcluster.cluster.shape.in_step_all_sum_s`).
    Every rank must call it (the layer's collectives).

    Raises:
        RuntimeError: the model has no decoder layers (the caller skips the probe)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    if group.size() == 1:
        return 0.0
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        raise RuntimeError("no decoder layers to time")
    layer = layers[0]
    dtype = layer.input_layernorm.weight.dtype
    cache = KVCache()
    if tokens <= 1:
        mx.eval(layer(mx.ones((1, 32, hidden), dtype=dtype), mask="causal", cache=cache))
    x = mx.ones((1, max(1, tokens), hidden), dtype=dtype)
    mask = "causal" if tokens > 1 else None
    back = max(1, tokens)

    def call() -> None:
        mx.eval(layer(x, mask=mask, cache=cache))
        cache.offset -= back  # the same positions again: the cache does not grow

    for _ in range(2):
        call()
    return sustained_collective_s(call, _any_done(group), seconds, chunk=PROBE_CHUNK if tokens <= 1 else 2) * 1e6


def _tp_layer_probe(topo, group, model, hidden: int, seconds: float = PROBE_S) -> Tuple[float, float]:
    """``(decode, prefill)`` :func:`tp_layer_us` (one token; :data:`PREFILL_PROBE_TOKENS`) where the group
    is one tensor-parallel group over every layer (TP, a PD prefill or decode group), else ``(0.0, 0.0)``
    (pipelines, AFD: their layers are not split over the group; blocks without self-attention)."""
    if group.size() == 1 or topo.kind not in ("tp", "prefill", "decode"):
        return 0.0, 0.0
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers or not hasattr(layers[0], "self_attn"):  # linear-attention / SSM blocks: other caches
        return 0.0, 0.0
    try:  # every rank runs the same architecture: one that cannot run this call fails alike on all
        return (tp_layer_us(group, model, hidden, seconds=seconds),
                tp_layer_us(group, model, hidden, PREFILL_PROBE_TOKENS, seconds))
    except Exception:  # noqa: BLE001 -- a figure for the planner, never a reason to fail the formation
        log.debug("tensor-parallel layer probe skipped", exc_info=True)
        return 0.0, 0.0


def _serve_rank_n(args, group, source, model, executor, addresses, creds, decode_side=None,
                  prompt_cache=None) -> None:
    from ..control.follower import serve_follower

    rank = group.rank()
    serve_follower(model, rank, group.size(), source, executor, args.bind,
                   int(addresses[rank].rsplit(":", 1)[1]), creds, decode_side=decode_side,
                   on_ready=lambda: emit("ready", rank=rank, address=addresses[rank]),
                   # progress events for the benchmarks ("of_rank", not "rank": not a change of the rank's state)
                   on_stop=lambda: emit("counters", of_rank=rank, **_counters(model, executor)),
                   prompt_cache=prompt_cache, prompt_agree=_group_min(group))


def _counters(model, executor) -> dict:
    """A rank N's ``counters`` event, after each leave: its MLX thread's
    :meth:`~mlxcluster.control.mlx_thread.MlxThread.plan_waits` (issue 42's benchmark: does the rank
    wait for plans) and ``--afd``'s messages and the FFN's idle/busy seconds (``model.counters()``)."""
    from ..control.mlx_thread import MlxThread

    out = dict(executor.plan_waits()) if isinstance(executor, MlxThread) else {}
    if hasattr(model, "counters"):
        out.update(model.counters())
    return out


def _serve_rank0(args, group, source, model, weights, executor, addresses, creds, all_sum_us,
                 prefill_service=None, decode_side=None, topo=None, prompt_cache=None) -> None:
    from ..leader.generation import serve_rank0

    if prefill_service is not None:
        prefill_service.executor = executor
    draft_service = None
    if topo is not None and topo.role == "draft":  # --role draft: this model drafts for target groups
        from ..leader.remote_draft import DraftService

        draft_service = DraftService(model, source.vocab_size, source.tokenizer, executor, name=source.name)
    asyncio.run(serve_rank0(
        model, source, executor, addresses, args.bind, backend=args.backend, weight_format=weights,
        prefill_service=prefill_service, decode_side=decode_side, draft_service=draft_service,
        credentials=creds, all_sum_us=all_sum_us, step_timeout_s=args.step_timeout, max_batch=args.max_batch, max_queue=args.max_queue,
        itl_target_s=max(0.0, args.itl_target_ms or 0.0) / 1000.0, compile_decode=args.compile,
        draft=args.draft, draft_tokens=args.draft_tokens,
        prompt_cache=prompt_cache,
        # every rank of a larger group agrees on a disk join's positions, its own disk tier or none
        prompt_agree=_group_min(group) if group.size() > 1 else None,
        on_connecting=lambda: emit("connecting", rank=0, peers=addresses[1:]),
        on_ready=lambda: emit("ready", rank=0, address=addresses[0])))


def _credentials():
    """This rank's TLS credentials, from ``MLXCLUSTER_SECRET``/``MLXCLUSTER_CLUSTER``
    (the launcher or the node daemon sets them; a rank never runs without them), with the CA seed
    its parent derived (``MLXCLUSTER_CA_SEED``: no scrypt on the rank's start).

    Raises:
        SecretError: no secret in the environment."""
    from ..security import credentials

    cfg = config()
    return credentials(cfg.secret, cfg.cluster, seed=cfg.ca_seed)


def _exit_with_parent() -> None:
    """Exit this rank when the process that started it (launcher, ``serve``, ``join`` daemon, or
    mpirun's orted) dies, even by SIGKILL: a daemon thread blocks in
    :func:`~mlxcluster.runtime.supervisor.wait_parent_exit` (the parent's pidfd on Linux, kqueue on
    macOS: woken at the exit, no polling).  (Not ``PR_SET_PDEATHSIG``: it fires when the launching
    *thread* ends, and launchers may start ranks from a worker thread.)  At once matters: a rank that
    outlives its node daemon keeps its links to the other ranks open, and a peer node that lets go of
    its own rank meanwhile (``RANK_REPORT_S`` after the loss) would be the rank rank 0 names lost
    (``tests/test_cluster.py``, seen with a 1 s check)."""
    from .supervisor import wait_parent_exit

    def watch() -> None:
        wait_parent_exit()
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


#: A standby preloads the model only while its estimated size in memory is at most this share
#: of the memory available (it holds a whole copy beside this node's running rank, if any).
STANDBY_PRELOAD_SHARE = 0.25

#: Modules a standby imports ahead (:func:`_standby`): what loading and serving a rank imports.
STANDBY_IMPORTS = ("mlx.core", "mlx_lm.models.cache", "mlxcluster.model.tp", "mlxcluster.control.follower",
                   "mlxcluster.leader.generation", "grpc", "transformers", "mlx_lm.tokenizer_utils")


def _preload_bytes(path: str, weight_format: Optional[str] = None) -> int:
    """Estimated bytes of ``path``'s model once read (:func:`~mlxcluster.model.loader.read_model`)
    and held as ``weight_format`` (default: this platform's,
    :func:`~mlxcluster.model.loader.default_weight_format`): the size of its weight files (a
    ``.gguf`` file, or a directory's ``*.safetensors``/``*.gguf``) as
    :func:`~mlxcluster.engine.memory.held_bytes` holds them -- as stored for ``"quantized"``
    (Metal: the weights stay packed); dequantised x8 for a quantized model as float32 (a GGUF
    file, or a ``quantization`` entry in ``config.json``: 4-bit assumed, an upper bound for
    8-bit), x2 for 16-bit weights as float32.

    Raises:
        OSError: ``path`` cannot be read.
    """
    from ..engine.memory import held_bytes, weight_file_bytes

    if weight_format is None:
        from ..model.loader import default_weight_format

        weight_format = default_weight_format()
    quantized = path.endswith(".gguf") or (os.path.isdir(path) and any(f.endswith(".gguf") for f in os.listdir(path)))
    try:
        with open(os.path.join(path, "config.json")) as f:
            quantized = quantized or "quantization" in json.load(f)
    except (OSError, ValueError):
        pass
    return held_bytes(weight_file_bytes(path), {"bits": 4} if quantized else None, weight_format)


def _standby(argv: List[str], cfg: Config, executor: futures.Executor) -> Optional[tuple]:
    """``rank --standby``: a rank process started ahead of its formation (by a ``join`` node,
    :class:`mlxcluster.runtime.standby.Standby`), so that a re-formation skips the work that does
    not depend on it: the interpreter's start, the imports (MLX, mlx-lm, gRPC, the engine), the TLS
    credentials (scrypt) and -- when it fits, :data:`STANDBY_PRELOAD_SHARE` -- reading and
    dequantising the model file, on ``executor`` (the rank's MLX thread: MLX's streams are per
    thread, so the arrays are made where the rank will use them).  Then it emits ``standby`` and blocks on stdin for ONE line, the
    JSON ``{"config": RankConfig.to_dict(), "env": {name: value}}`` of the rank it becomes (the
    environment: the backend's ``MLX_*`` variables, set before the group is initialised).

    Returns:
        ``(RankConfig, preloaded source or None)``, or ``None`` at end of input (the node stopped it).
    Raises:
        ValueError: a malformed bootstrap line.
    """
    t0 = time.perf_counter()
    import importlib

    for module in STANDBY_IMPORTS:  # the imports a rank makes before it serves
        importlib.import_module(module)
    from ..model.loader import read_model

    path = argv[argv.index("--model") + 1] if "--model" in argv[:-1] else cfg.model
    source = None
    try:
        import psutil

        if _preload_bytes(path) <= STANDBY_PRELOAD_SHARE * psutil.virtual_memory().available:
            def preload():
                import importlib

                import mlx.core as mx
                from ..model.arch import model_classes

                loaded = read_model(path)
                mx.eval(list(loaded.weights.values()))
                model_classes(loaded.config)  # imports mlx-lm's module of the architecture
                if loaded.tokenizer is not None:  # may become rank 0: the streaming detokenizer's module
                    importlib.import_module("mlx_lm.tokenizer_utils")
                return loaded

            source = executor.submit(preload).result()
    except Exception:  # no model yet (a node still fetching it), or unreadable: the rank reads it later
        log.debug("standby: model not preloaded", exc_info=True)
    emit("standby", pid=os.getpid(), preloaded=source is not None, seconds=round(time.perf_counter() - t0, 3))
    line = sys.stdin.readline()
    if not line.strip():
        return None
    try:
        boot = json.loads(line)
        raw, env = boot["config"], boot.get("env", {})
        if not (isinstance(raw, dict) and isinstance(env, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ValueError("standby: the bootstrap line is not {\"config\": {...}, \"env\": {str: str}}") from None
    args = RankConfig.from_dict(raw)  # ValueError: one line naming the field
    os.environ.update(env)
    return args, source


_TOKENIZER_WORK: Optional[futures.ThreadPoolExecutor] = None


def _tokenizer_worker() -> futures.ThreadPoolExecutor:
    """Rank 0's one thread for tokenizer work, off its MLX thread: the modules' import from the
    process's start (:func:`_import_tokenizer_early`), then the tokenizer's build while the shard
    loads (:func:`_load`) -- one worker, so in that order (``transformers``' lazy module cannot be
    imported from two threads at once)."""
    global _TOKENIZER_WORK
    if _TOKENIZER_WORK is None:
        _TOKENIZER_WORK = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
    return _TOKENIZER_WORK


def _import_tokenizer_early(world_size: int, cfg: Config) -> None:
    """On rank 0 (known before the group forms: world size 1, or :attr:`Config.launch_rank`, the
    launcher's ``MLX_RANK`` or OpenMPI's ``OMPI_COMM_WORLD_RANK``), import the tokenizer's modules (``transformers``,
    ~0.6 s here) on :func:`_tokenizer_worker` while the group initialises and the other ranks
    load, instead of after: rank 0 alone builds a tokenizer, and its load is the group's
    critical path."""
    rank = "0" if world_size == 1 else cfg.launch_rank
    if rank != "0":
        return
    # Two threads importing the two halves of a circular import deadlock (Python raises
    # ``_DeadlockError`` in one): ``transformers`` imports ``importlib.abc`` (which imports
    # ``importlib.resources.abc``) while this thread's loads import ``importlib.resources`` (whose
    # ``__init__`` imports ``.abc``). Seen in CI as "rank 0: deadlock detected by
    # _ModuleLock('importlib.resources.abc')". The standard library's cycles are imported here
    # first, on the calling thread, before the worker starts (~20 ms).
    import importlib

    for name in ("importlib.abc", "importlib.resources", "importlib.metadata"):
        importlib.import_module(name)

    _import_on_tokenizer_worker("mlxcluster.model.tokenizer", "transformers")


def _import_on_tokenizer_worker(*modules: str) -> None:
    """Import ``modules`` in order on :func:`_tokenizer_worker` (off the MLX thread); a failure is
    logged at debug level only: whoever uses the module imports it again and reports what fails."""
    def work() -> None:
        import importlib

        try:
            for name in modules:
                importlib.import_module(name)
        except Exception:
            log.debug("import of %s on the tokenizer thread failed", ", ".join(modules), exc_info=True)

    _tokenizer_worker().submit(work)


def _import_detokenizer() -> None:
    """Import the streaming detokenizer's module (``mlx_lm.tokenizer_utils``) on rank 0's
    :func:`_tokenizer_worker`, after the tokenizer's build and the load's probes: its ``from
    transformers import AutoTokenizer`` makes transformers index its model packages (~0.3 s here),
    else on the event loop during the group's first Generate call (a re-formed group's first
    replayed token).  Before the probes it was on the group's critical path: rank 0 waits for its
    tokenizer before the probes (:func:`main`), and every rank waits for rank 0 in them."""
    _import_on_tokenizer_worker("mlx_lm.tokenizer_utils")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # mlx-lm's package __init__ (transformers) is not run here: mlxcluster/__init__.py defers it
    try:
        cfg = config()
        failpoints.setup(cfg.failpoints)  # tests: MLXCLUSTER_FAILPOINTS (none unless set)
        creds = _credentials()
    except ValueError as exc:  # SecretError included
        emit("error", message=str(exc))
        return 2
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr,
                        format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    preloaded = None
    standby = argv[:1] == ["--standby"]
    # All MLX work of this process runs on this one thread.
    from ..control.mlx_thread import MlxThread

    executor = MlxThread()  # times its current work: HealthReply/InfoReply.busy_s
    _exit_with_parent()
    if standby:
        try:
            boot = _standby(argv[1:], cfg, executor)
        except ValueError as exc:
            emit("error", message=str(exc))
            return 2
        if boot is None:
            return 0
        args, preloaded = boot
        cfg = Config.from_env()  # its environment now holds the bootstrap line's (MLX_RANK: launch_rank)
    try:
        args = _resolved(args, cfg) if standby else _parse(argv, cfg)
        addresses = list(args.addresses())
    except ValueError as exc:
        emit("error", message=str(exc))
        return 2
    if preloaded is None:
        _import_tokenizer_early(args.world_size, cfg)
    rank = None
    from ..engine.memory import WiredLimit

    wired = WiredLimit()  # set by _load before the shard loads, restored on the way out
    try:
        # timings (seconds): since this process started (imports, credentials), of the group's init
        # (MPI_Init / the ring's connections), of the load, of the all_sum probe (waits for the slowest rank)
        t_init = time.perf_counter()
        emit("init", backend=args.backend, pid=os.getpid(), start_s=round(t_init - _STARTED, 3))
        group = init_group(args.backend, args.world_size)
        rank = group.rank()
        if not args.bind:  # MPI ranks of a join formation: one command line for every rank
            args = dataclasses.replace(args, bind=addresses[rank].rsplit(":", 1)[0])
        t0 = time.perf_counter()
        emit("loading", rank=rank, init_s=round(t0 - t_init, 3))
        source, model, weights, topo, tokenizer_job = executor.submit(_load, args, group, preloaded, wired).result()
        import mlx.core as mx

        # rank 0's tokenizer first: built in a thread meanwhile, it would take the CPU the probes time
        # (under a CPU quota it read a TP layer 3x slower than the steps ran, issue 31's cluster (a))
        t_tok = time.perf_counter()
        _with_tokenizer(source, tokenizer_job)
        t1 = time.perf_counter()
        window = probe_window_s(cpu_quota())  # ranks may differ: the probes' stop is agreed
        all_sum_us = executor.submit(all_sum_latency_us, group, int(source.hidden_size), window).result()
        layer_us, prefill_layer_us = executor.submit(_tp_layer_probe, topo, group, model,
                                                     int(source.hidden_size), window).result()
        emit("loaded", rank=rank, seconds=round(time.perf_counter() - t0, 3), load_s=round(t1 - t0, 3),
             probe_s=round(time.perf_counter() - t1, 3), tokenizer_wait_s=round(t1 - t_tok, 3),
             parameter_bytes=model.parameter_bytes(), peak_memory_bytes=int(mx.get_peak_memory()),
             weights=weights, all_sum_us=round(all_sum_us, 1), tp_layer_us=round(layer_us, 1),
             tp_prefill_layer_us=round(prefill_layer_us, 1), tp_prefill_tokens=PREFILL_PROBE_TOKENS,
             **_kv_report(source, model))
        if rank == 0:
            _import_detokenizer()
        prefill_service, decode_side = _pd_sides(args, topo, group, source, model, weights, creds)
        try:
            prompt_cache = _prompt_cache(args, group, source, model, weights, topo)
        except (ValueError, OSError) as exc:
            emit("error", rank=rank, message=str(exc))
            return 2
        if rank == 0:
            _serve_rank0(args, group, source, model, weights, executor, addresses, creds, all_sum_us,
                         prefill_service, decode_side, topo, prompt_cache)
        else:
            _serve_rank_n(args, group, source, model, executor, addresses, creds, decode_side, prompt_cache)
        return 0
    except Exception as exc:  # report one line to the launcher, details to the log
        log.debug("rank failed", exc_info=True)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        emit("error", rank=rank, message=message)
        return 1
    finally:
        _restore_wired(wired, executor)


def _restore_wired(wired, executor, timeout_s: float = 5.0) -> None:
    """Put the wired limit back on the MLX thread (after its queued work, as mlx-lm's ``wired_limit``
    does); a thread still busy ``timeout_s`` later (stuck in a collective) is not waited for: the
    process's exit releases what it wired."""
    if wired.previous is None:
        return
    try:
        executor.submit(wired.restore).result(timeout=timeout_s)
    except Exception:  # noqa: BLE001 -- on the way out: never a reason to hang or fail
        log.debug("wired limit not restored", exc_info=True)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # do not wait on threads stuck in a collective
