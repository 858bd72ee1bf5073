"""The shape planner: which topology a cluster should run, chosen by a cost model over measurements.

:func:`plan_shape` is a pure function of typed inputs (frozen dataclasses): what each node and link
measured (:class:`NodeMeasure`, :class:`LinkMeasure`, per-backend ``all_sum`` latencies in
:class:`Measurements`), the model (:class:`ModelProfile`) and what is wanted (:class:`Request`: the
context length, the optimize target, the batch, the prompt).  It enumerates every candidate -- each
node alone, tensor parallelism (TP) over every node subset whose size splits the model, pipelines with
uneven layer ranges weighted by measured speed and bounded by memory, TP x PP, prefill/decode
disaggregation (PD) -- predicts each one's decode step time (single stream and at batch ``B``), time to
first token (TTFT) and memory per node, and ranks them for the target.  No I/O, no clock: tested as
plain functions (``tests/test_shape.py``); ``mlxcluster plan`` prints :func:`describe` of its result.
Which topologies can run is decided by :meth:`mlxcluster.model.topology.Topology.validate`, the one
set of rules (a TP size that does not split the heads, pipelines outside the Llama family, ...).

The cost model (times in seconds, bytes, bytes/s; ``L`` layers, ``h`` hidden size, ``a`` bytes per
activation element, ``V`` vocabulary):

* **compute** of node ``n`` for ``l`` layers at batch ``B`` on a ``k``-way shard:
  ``c_n(l, B, k) = s_n * (l * (t_n + (B - 1) * u_n) + head) / k`` with ``t_n`` the measured decode time
  of one whole layer at batch 1 (:attr:`NodeMeasure.layer_s`), ``u_n`` its per-extra-sequence slope,
  ``head`` the embedding + norm + output head + sampling time (:attr:`NodeMeasure.head_s`, output
  stage only) and ``s_n`` the host-sharing slowdown (:func:`host_slowdown`).  Splitting by ``k``
  assumes ideal scaling of the sharded matmuls (Megatron-LM's column/row split, Shoeybi et al. 2019).
* **all_sum** of ``m`` bytes over a group of ``k`` ranks (:func:`all_sum_s`):
  ``max(lat_backend, steps(k) * lat_link) + 2 (k - 1) / k * m / bw_min`` -- the backend's measured
  latency: what an ``all_sum`` costs inside a step where a TP formation of the backend measured one of
  its layers (:func:`in_step_all_sum_s`; decode and prefill apart), else the bare probe's figure for a
  decode-sized tensor -- or the slowest link's latency times the algorithm's steps when that is
  larger; the bandwidth term is the ring all-reduce's bytes per rank over the slowest link
  (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005).
* **TP over k nodes** (decode step at batch ``B``): ``max_n c_n(L, B, k)`` (the slowest node bounds it)
  ``+ (2 L + 1) * all_sum(B h a)`` (attention out and MLP out per layer, plus the vocabulary-parallel
  embedding's) ``+ all_gather(B V 4 / k)`` (the vocabulary-parallel head's logits) ``+ frame``
  (rank 0's step frame to ranks N: ``FRAME_S`` + the slowest link's latency).
* **pipeline** of stages ``i`` (``l_i`` layers, TP size ``k_i``): one step is
  ``sum_i stage_i + (S - 1) * hop(B h a) + frame`` with ``stage_i = max_{n in i} c_n(l_i, B, k_i)
  + 2 l_i * all_sum_i`` (``k_i > 1``) and ``hop(m) = lat + m / bw`` between consecutive stages:
  single-stream decode does not overlap stages.  mlxcluster's ``PipelinedModel`` runs a batch through
  the stages in turn, so batch ``B`` does not overlap them either; :attr:`Request.pipeline_overlap`
  predicts a GPipe schedule instead (``M = min(B, S)`` micro-batches: ``(M + S - 1) * max_i
  stage_i(B / M) + hops``, Huang et al. 2019).  Layer ranges: proportional to measured speed
  (``1 / t``) and, separately, fastest-first; each capped by what the stage's memory holds.
* **TTFT** of a ``P``-token prompt: node ``n`` prefills ``f`` of the layers on a ``k``-way shard in
  ``s_n * P * f / (k * prefill_n)`` (``prefill_n``: measured whole-model tokens/s), plus the
  collectives and hops above at ``P h a`` bytes.  **PD**: the fastest prefill node prefills alone and
  streams the K/V layer by layer (``engine/pd.py``) to the decode group:
  ``max(t_prefill, t_kv) + t_kv / L + lat + frame`` with ``t_kv = (P * kv_bytes_per_token / k) / bw``
  per decode rank (the slowest link); decode runs as that group's TP.
* **memory per node**: its share of the weights (``layer_bytes`` per layer / ``k``; embedding and head
  vocabulary-parallel when ``k`` divides ``V``, on the stages that embed / own the output) plus its K/V
  for the context: ``context * sequences * kv_bytes_per_token * (l / L) / k``, ``sequences`` = ``B``
  for the throughput target, else 1.

Choice: the candidate that fits memory with the best figure for the target (decode tok/s; tok/s at
batch ``B``; lowest TTFT), a plan on fewer nodes winning over one predicted better by at most
:data:`NODE_MARGIN`; a plan predicted slower than the fastest single
node that holds the model is never chosen ("slower than a alone").  Each candidate not chosen carries
a one-line reason.  A context beyond the model's positions, or one whose K/V fits no plan, is one
:class:`ShapeError` line.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..model.layout import LayerRange, LayoutError, make_route
from ..model.topology import Topology, TopologyError

__all__ = ["NodeMeasure", "LinkMeasure", "Measurements", "ModelProfile", "Request", "Prediction", "Candidate",
           "ShapeError", "plan_shape", "describe", "chosen", "all_sum_s", "host_slowdown", "measurements_from_json",
           "TpLayerMeasure", "in_step_all_sum_s", "all_sum_line", "with_jaccl_prior", "JACCL_PRIOR_US",
           "OPTIMIZE", "FRAME_S", "HOST_CONTENTION", "MAX_ORDERS", "NODE_MARGIN"]

#: ``--optimize`` targets: single-stream decode tok/s, tok/s at batch ``B``, time to first token.
OPTIMIZE = ("decode", "throughput", "ttft")

#: Seconds rank 0's step frame costs beyond the link's latency (gRPC plus two thread hops on rank N):
#: ~0.3 ms over loopback gRPC (BENCHMARKS.md, "control plane per step": 321 us).
FRAME_S = 0.3e-3

#: Slowdown per rank when ``r > 1`` ranks of one plan share a host (each runs ``r * HOST_CONTENTION``
#: times slower than measured alone).  Calibrated on a 2-core Linux machine (BENCHMARKS.md): SmolLM2-135M
#: at TP=1 ~21.5 tok/s (46.5 ms/step), at TP=3 over MPI 11.7 tok/s (85.5 ms/step); less the 63
#: collectives at 76 us and the frame, one rank's third of the work takes 80 ms = 3 x 1.73 x 15.5 ms
#: (waiters polling, BLAS threads and three processes on two cores).
HOST_CONTENTION = 1.73

#: A plan on more nodes is chosen over one on fewer only when predicted better by more than this
#: fraction of the target's figure.  What extra nodes cost beyond the model (frames and hops between
#: throttled or busy ranks, a shared machine's run-to-run noise) and the spread of the compute
#: measurement itself (three equal 0.4-CPU nodes measured 4.4-5.5 ms per layer in one run) are each
#: several per cent: in issue 31's emulated cluster (a) (benchmarks/bench_shape.py) the planner without
#: it chose a two-node pipeline predicted 1 % faster than one node alone, which ran at 4.4 tok/s against
#: the node alone's 5.3.
NODE_MARGIN = 0.10

#: Most rank orders tried per node set for a pipeline (the order decides which links carry the hops).
MAX_ORDERS = 24

_GB = 1e9


class ShapeError(ValueError):
    """No plan can run (a context too long for every plan, a model that fits nowhere, bad inputs);
    ``str()`` is one line for the user."""


@dataclass(frozen=True)
class NodeMeasure:
    """What one node measured.

    Attributes:
        node_id: the node's id.
        memory_bytes: memory a rank may use for weights and K/V on this node, bytes (the runtime's own
            already subtracted).
        layer_s: forward time of one whole transformer layer for one decode token at batch 1, seconds.
        prefill_tokens_per_s: whole-model prefill throughput of one rank on this node, tokens/s.
        layer_batch_s: extra seconds per layer for each sequence beyond the first in a decode batch.
        head_s: embedding + final norm + output head + sampling per decode step at batch 1, seconds.
        chip: the chip's name, for display.
        host: the machine the node runs on (several nodes on one machine share its cores:
            :func:`host_slowdown`); ``""``: a machine of its own.
    """

    node_id: str
    memory_bytes: int
    layer_s: float
    prefill_tokens_per_s: float
    layer_batch_s: float = 0.0
    head_s: float = 0.0
    chip: str = ""
    host: str = ""


@dataclass(frozen=True)
class LinkMeasure:
    """The measured link between nodes ``a`` and ``b`` (either direction).

    Attributes:
        a, b: node ids.
        latency_s: one-way latency of a small message, seconds.
        bandwidth_bytes_per_s: bytes/s of a large transfer.
        interface: the interface that carries it (``en0``, ``bridge0``, ``thunderbolt0``...), for display.
    """

    a: str
    b: str
    latency_s: float
    bandwidth_bytes_per_s: float
    interface: str = ""


@dataclass(frozen=True)
class TpLayerMeasure:
    """One decoder layer of a tensor-parallel formation at decode, as its ranks measured it at load
    (:func:`mlxcluster.runtime.rank.tp_layer_us`): a rank's share of the layer's compute plus the two
    ``all_sum``s between, in the duty cycle of a real step.

    Attributes:
        backend: the formation's backend (``mpi``, ``ring``, ``jaccl``).
        nodes: the formation's node ids, rank order (the TP size is their count).
        layer_s: sustained mean seconds per layer for one decode token.
        prefill_layer_s: sustained mean seconds per layer for a prompt of ``prefill_tokens`` tokens
            (0: not measured).
        prefill_tokens: that prompt's length.
    """

    backend: str
    nodes: Tuple[str, ...]
    layer_s: float
    prefill_layer_s: float = 0.0
    prefill_tokens: int = 0


@dataclass(frozen=True)
class Measurements:
    """Every measurement of a cluster.

    Attributes:
        nodes: one per node.
        links: one per measured node pair; a pair without one cannot be in the same plan.
        all_sum_us: measured ``all_sum`` latency of a decode-sized tensor per backend (``jaccl``,
            ``mpi``, ``ring``), microseconds; the backends present are the ones available.  Empty: the
            ring, its latency estimated from the links (:func:`all_sum_s`).
        tp_layers: tensor-parallel formations' measured layers (:class:`TpLayerMeasure`): where one of
            the chosen backend's covers measured nodes, it sets the ``all_sum`` latency steps pay
            (:func:`in_step_all_sum_s`) in place of ``all_sum_us``.
    """

    nodes: Tuple[NodeMeasure, ...]
    links: Tuple[LinkMeasure, ...] = ()
    all_sum_us: Mapping[str, float] = field(default_factory=dict)
    tp_layers: Tuple[TpLayerMeasure, ...] = ()

    def node(self, node_id: str) -> NodeMeasure:
        return next(n for n in self.nodes if n.node_id == node_id)

    def link(self, a: str, b: str) -> Optional[LinkMeasure]:
        for lk in self.links:
            if {lk.a, lk.b} == {a, b}:
                return lk
        return None


@dataclass(frozen=True)
class ModelProfile:
    """What the cost model needs of a model.

    Attributes:
        name: display name.
        n_layers, hidden_size, n_heads, n_kv_heads, head_dim, vocab_size: from ``config.json``.
        layer_bytes: weight bytes of one transformer layer as loaded.
        embed_bytes: weight bytes of the token embedding.
        head_bytes: weight bytes of the output head (0 when tied to the embedding).
        max_positions: ``max_position_embeddings``, the longest context in tokens.
        activation_bytes: bytes per activation / K/V element (4 for float32 weights, 2 otherwise).
        tied: the head is the embedding (a pipeline's output stage then holds the embedding too).
        config: the model's ``config.json`` dict, for :meth:`Topology.validate`.
        quantization, weights: the quantisation map and the loaded weight format, for the same.
        kv_bits, kv_group_size: the ranks' KV format (``--kv-bits``; 0: full precision).
    """

    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_bytes: int
    embed_bytes: int
    head_bytes: int
    max_positions: int
    activation_bytes: int = 4
    tied: bool = True
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    quantization: Optional[Mapping[str, Any]] = field(default=None, compare=False, hash=False)
    weights: str = "float32"
    kv_bits: int = 0
    kv_group_size: int = 64

    @property
    def kv_bytes_per_token(self) -> int:
        """K/V cache bytes of one token over every layer: ``2 * n_kv_heads * head_dim * bytes * n_layers``
        at full precision; with ``kv_bits`` ``2 * n_kv_heads * (head_dim * bits / 8 + 2 * head_dim /
        group_size * bytes) * n_layers`` (packed codes plus a scale and a bias per group:
        :meth:`mlxcluster.engine.kvquant.KvFormat.position_bytes`)."""
        if self.kv_bits:
            per = self.head_dim * self.kv_bits // 8 + 2 * (self.head_dim // self.kv_group_size) * self.activation_bytes
            return 2 * self.n_kv_heads * per * self.n_layers
        return 2 * self.n_kv_heads * self.head_dim * self.activation_bytes * self.n_layers

    @property
    def weight_bytes(self) -> int:
        return self.n_layers * self.layer_bytes + self.embed_bytes + self.head_bytes

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, name: str = "the model",
                    quantization: Optional[Mapping[str, Any]] = None, weights: str = "float32",
                    kv_bits: int = 0, kv_group_size: int = 64) -> "ModelProfile":
        """A profile from a ``config.json`` dict: weight bytes from the shapes of a dense or MoE GQA
        layer (q/k/v/o, gate/up/down or every expert's, two norms), times the bytes per weight of the
        format (``quantized``: ``bits / 8`` plus a float16 scale and bias per ``group_size``).

        Raises:
            ShapeError: a config without the sizes needed.
        """
        c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        try:
            h = int(c["hidden_size"])
            n_layers = int(c.get("num_hidden_layers") or c["num_layers"])
            heads = int(c["num_attention_heads"])
            kv = int(c.get("num_key_value_heads") or heads)
            hd = int(c.get("head_dim") or h // heads)
            vocab = int(c["vocab_size"])
            inter = int(c.get("intermediate_size") or 0)
        except (KeyError, TypeError, ValueError) as exc:
            raise ShapeError(f"{name}'s config lacks {exc}: cannot size its layers") from None
        experts = int(c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts") or 0)
        moe = int(c.get("moe_intermediate_size") or 0)
        attn = h * heads * hd * 2 + 2 * h * kv * hd
        mlp = 3 * h * moe * experts if experts and moe else 3 * h * inter
        if quantization and weights == "quantized":
            bits, group = int(quantization.get("bits", 4)), int(quantization.get("group_size", 64))
            per = bits / 8 + 4 / group
        else:
            per = {"float16": 2, "bfloat16": 2}.get(weights, 4)
        act = 4 if weights == "float32" else 2
        tied = bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", True)))
        embed = int(vocab * h * per)
        return cls(name=name, n_layers=n_layers, hidden_size=h, n_heads=heads, n_kv_heads=kv, head_dim=hd,
                   vocab_size=vocab, layer_bytes=int((attn + mlp) * per + 2 * h * act),
                   embed_bytes=embed, head_bytes=0 if tied else embed,
                   max_positions=int(c.get("max_position_embeddings") or 2048), activation_bytes=act,
                   tied=tied, config=dict(config), quantization=quantization, weights=weights,
                   kv_bits=int(kv_bits or 0), kv_group_size=int(kv_group_size or 64))


@dataclass(frozen=True)
class Request:
    """What the plan is for.

    Attributes:
        context: K/V positions each sequence must hold (prompt + generated), tokens.
        optimize: ``decode`` (single-stream tok/s), ``throughput`` (tok/s at ``batch``) or ``ttft``.
        batch: sequences decoded together for ``throughput`` (and the batch figure of every plan).
        prompt_tokens: the prompt length ``P`` of the TTFT figure (at most ``context``).
        pipeline_overlap: predict pipelines at batch ``B`` with stages overlapped (GPipe micro-batches);
            ``False`` is what mlxcluster's ``PipelinedModel`` does today.
    """

    context: int = 4096
    optimize: str = "decode"
    batch: int = 8
    prompt_tokens: int = 512
    pipeline_overlap: bool = False


@dataclass(frozen=True)
class Prediction:
    """Predicted figures of one plan.

    Attributes:
        decode_s: one decode step of one sequence, seconds.
        batch_s: one decode step of ``Request.batch`` sequences, seconds.
        ttft_s: time to first token of ``Request.prompt_tokens`` tokens, seconds.
        memory: ``(node id, bytes)`` each node needs (weights share + K/V), rank order.
        batch: the batch of ``batch_s``.
    """

    decode_s: float
    batch_s: float
    ttft_s: float
    memory: Tuple[Tuple[str, int], ...]
    batch: int = 1

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.decode_s

    @property
    def batch_tok_s(self) -> float:
        return self.batch / self.batch_s


@dataclass(frozen=True)
class Candidate:
    """One plan, predicted or refused.

    Attributes:
        kind: ``single``, ``tp``, ``pipeline``, ``tp_pp`` or ``pd``.
        label: what it runs, e.g. ``TP=3 on a,b,c`` or ``pipeline 20:output,0:9,10:19 on a,b,c``.
        nodes: node ids in rank order (a PD plan: the prefill node first).
        topology: the validated :class:`Topology` (a PD plan: its decode group's), ``None`` when refused
            before one was built.
        backend: the collective backend its cost assumes (``""`` for one rank).
        prediction: ``None`` when it cannot run at all.
        note: its bottleneck, e.g. ``link b-c 12 MB/s``.
        reason: why it was not chosen (``""`` for the chosen plan).
        chosen: the plan :func:`plan_shape` picked.
    """

    kind: str
    label: str
    nodes: Tuple[str, ...]
    topology: Optional[Topology] = None
    backend: str = ""
    prediction: Optional[Prediction] = None
    note: str = ""
    reason: str = ""
    chosen: bool = False


# --------------------------------------------------------------------------- cost model pieces


def host_slowdown(ranks_on_host: int, prefill: bool = False) -> float:
    """Compute slowdown of each of ``ranks_on_host`` ranks computing at once on one host, against its
    measurement alone: 1 for one rank; else ``ranks`` for a prefill (compute-bound: the host's
    throughput is shared; BENCHMARKS.md: TP=3 on 2 cores prefills at 258 tok/s against TP=1's 225) and
    ``ranks * HOST_CONTENTION`` for a decode step (:data:`HOST_CONTENTION`'s calibration).  Stages of a
    pipeline that take turns do not compute at once."""
    if ranks_on_host <= 1:
        return 1.0
    return float(ranks_on_host) if prefill else ranks_on_host * HOST_CONTENTION


#: jaccl's ``all_sum`` latency (µs) for a decode-sized tensor until a jaccl group has measured one
#: (:func:`with_jaccl_prior`): oMLX's measurement over Thunderbolt 5 RDMA, 27-31 µs per collective
#: (the upper end); MLX PR #2808 (the jaccl backend) plots 4-way all-reduce latency on M3 Ultras in
#: the same tens of µs, against the TCP ring's hundreds over the same cables.
JACCL_PRIOR_US = 31.0


def with_jaccl_prior(m: "Measurements", jaccl_capable: bool) -> "Measurements":
    """``m`` with :data:`JACCL_PRIOR_US` as jaccl's ``all_sum`` latency where the nodes can run jaccl
    (``jaccl_capable``: every node lists it, i.e. RDMA devices and an MLX with jaccl:
    ``backends.local_backends``) and no jaccl figure was measured yet; a measured one always stays.
    Without it the planner prices TP's ``all_sum`` from the LAN round trips until a jaccl group has run,
    and ``--plan auto`` may never choose TP over Thunderbolt (issue 43, item 10)."""
    if not jaccl_capable or "jaccl" in m.all_sum_us:
        return m
    return replace(m, all_sum_us={**dict(m.all_sum_us), "jaccl": JACCL_PRIOR_US})


def all_sum_s(nbytes: float, k: int, backend_us: Optional[float], latency_s: float, bandwidth: float,
              backend: str = "ring") -> float:
    """Seconds of one ``all_sum`` of ``nbytes`` over ``k`` ranks.

    ``max(backend_us * 1e-6, steps * latency_s) + 2 (k - 1) / k * nbytes / bandwidth`` with ``steps``
    ``2 (k - 1)`` for a ring (reduce-scatter + all-gather) and ``ceil(log2 k)`` for MPI's recursive
    doubling (Thakur, Rabenseifner & Gropp 2005); the bandwidth term is the ring all-reduce's bytes per
    rank (Patarasuk & Yuan 2009).  ``latency_s`` and ``bandwidth`` are the group's slowest link's.
    jaccl with a figure (measured or :data:`JACCL_PRIOR_US`) takes that figure alone as its latency:
    it runs over Thunderbolt RDMA, not the path whose gRPC round trips gave ``latency_s``.
    """
    if k <= 1:
        return 0.0
    steps = math.ceil(math.log2(k)) if backend == "mpi" else 2 * (k - 1)
    floor = 0.0 if backend == "jaccl" and backend_us else steps * latency_s
    lat = max((backend_us or 0.0) * 1e-6, floor)
    return lat + 2 * (k - 1) / k * nbytes / bandwidth


def _slowest_link(m: Measurements, nodes: Sequence[str]) -> Tuple[float, float, str]:
    """``(latency_s, bandwidth, "link a-b 12 MB/s")`` of the group's slowest link (lowest bandwidth;
    latency: the highest).  Raises :class:`ShapeError` for a pair never measured."""
    lat, bw, worst = 0.0, math.inf, None
    for a, b in itertools.combinations(nodes, 2):
        lk = m.link(a, b)
        if lk is None:
            raise ShapeError(f"link {a}-{b} not measured")
        lat = max(lat, lk.latency_s)
        if lk.bandwidth_bytes_per_s < bw:
            bw, worst = lk.bandwidth_bytes_per_s, lk
    note = f"link {worst.a}-{worst.b} {_fmt_bw(bw)}" if worst else ""
    return lat, bw, note


def _slowdowns(m: Measurements, nodes: Sequence[str], prefill: bool) -> Dict[str, float]:
    """:func:`host_slowdown` of each of ``nodes``, which compute at once (a node without a ``host`` is a
    machine of its own)."""
    host = {n: m.node(n).host or f"\x00{n}" for n in nodes}
    count: Dict[str, int] = {}
    for n in nodes:
        count[host[n]] = count.get(host[n], 0) + 1
    return {n: host_slowdown(count[host[n]], prefill) for n in nodes}


def _in_step(m: Measurements, backend: str, prefill_bytes_per_token: float,
             n_layers: int) -> Optional[Tuple[TpLayerMeasure, float]]:
    """:func:`in_step_all_sum_s` and the :class:`TpLayerMeasure` it comes from."""
    have = {n.node_id for n in m.nodes}
    prefill = prefill_bytes_per_token > 0
    if prefill and n_layers < 1:
        raise ValueError("a prefill figure needs the model's layer count")
    best: Optional[Tuple[Tuple[int, float], TpLayerMeasure]] = None
    for t in m.tp_layers:
        k = len(t.nodes)
        measured = t.prefill_layer_s if prefill else t.layer_s
        if t.backend != backend or k < 2 or not have.issuperset(t.nodes) or not measured > 0 \
                or (prefill and t.prefill_tokens < 1):
            continue
        slow = _slowdowns(m, t.nodes, prefill)

        def share(n: str) -> float:
            nm = m.node(n)
            own = t.prefill_tokens / (n_layers * nm.prefill_tokens_per_s) if prefill else nm.layer_s
            return slow[n] * own / k
        eff = (measured - max(share(n) for n in t.nodes)) / 2
        if prefill:
            try:
                _, bw, _ = _slowest_link(m, t.nodes)
            except ShapeError:  # a pair never measured: no bandwidth term to take out
                continue
            eff -= 2 * (k - 1) / k * t.prefill_tokens * prefill_bytes_per_token / bw
        got = ((k, max(0.0, eff)), t)
        best = got if best is None or got[0] > best[0] else best
    return None if best is None else (best[1], best[0][1])


def in_step_all_sum_s(m: Measurements, backend: str, prefill_bytes_per_token: float = 0.0,
                      n_layers: int = 0) -> Optional[float]:
    """Seconds of latency one ``all_sum`` costs inside a step on ``backend``, from a measured
    tensor-parallel layer (:class:`TpLayerMeasure`), or ``None`` when there is none.

    Decode (``prefill_bytes_per_token`` 0): ``(T - max_n s_n t_n / k) / 2`` -- the layer's measured time
    ``T`` less the compute share the cost model predicts for its slowest rank (module docstring; ``s_n``
    :func:`host_slowdown`), over the layer's two ``all_sum``s.  Prefill (``prefill_bytes_per_token``:
    the activation's bytes per token, ``h a``; ``n_layers``: the model's ``L``): the same for the
    measured ``P0``-token prompt with the share ``s_n P0 / (k L prefill_n)``, less the bandwidth term
    of an ``all_sum`` of ``P0 h a`` bytes over the formation's slowest link (:func:`all_sum_s` adds it
    back at the prompt's size).  At least 0.
    Of several formations of ``backend`` whose nodes were all measured: the largest one's (then the
    highest).

    Why: a step's ``all_sum`` costs what the bare probe does not see -- waits for the slowest rank's
    compute, and under a CPU quota waits for throttled peers that depend on the compute between the
    collectives (issue 31, BENCHMARKS.md "Choosing the shape by measurement").  With this figure the
    formation that was measured is predicted at its measured layer time by construction; other node
    sets and TP sizes of the backend pay the same per ``all_sum``.

    Raises:
        ValueError: a prefill figure asked for without ``n_layers``."""
    got = _in_step(m, backend, prefill_bytes_per_token, n_layers)
    return None if got is None else got[1]


def all_sum_line(m: Measurements) -> str:
    """One line saying which ``all_sum`` latency the planner uses: ``"all_sum over mpi: 12000 µs back to
    back; 3667 µs in a step (TP=3 on a,b,c: 9.00 ms per layer)"``."""
    if not m.all_sum_us:
        return "all_sum: not measured (estimated from the links)"
    backend = min(m.all_sum_us, key=m.all_sum_us.get)
    line = f"all_sum over {backend}: {m.all_sum_us[backend]:.0f} µs back to back"
    got = _in_step(m, backend, 0.0, 0)
    if got is not None:
        t, in_step = got
        line += (f"; {in_step * 1e6:.0f} µs in a step (TP={len(t.nodes)} on {','.join(t.nodes)}: "
                 f"{t.layer_s * 1e3:.2f} ms per layer)")
    return line


def _fmt_bytes(n: float) -> str:
    return f"{n / _GB:.1f} GB" if n >= 0.1 * _GB else f"{n / 1e6:.0f} MB"


def _fmt_bw(bw: float) -> str:
    return f"{bw / 1e9:.1f} GB/s" if bw >= 1e9 else f"{bw / 1e6:.0f} MB/s"


class _Ctx:
    """One :func:`plan_shape` call's inputs and memoised validations."""

    def __init__(self, m: Measurements, model: ModelProfile, req: Request):
        self.m, self.model, self.req = m, model, req
        self._valid: Dict[Topology, Any] = {}
        backends = dict(m.all_sum_us)
        self.backend = min(backends, key=backends.get) if backends else "ring"
        self.backend_us = backends.get(self.backend)
        self.prefill_backend_us = self.backend_us
        in_step = in_step_all_sum_s(m, self.backend)
        if in_step is not None:  # what a step's all_sum costs, measured in a step (in_step_all_sum_s)
            self.backend_us = in_step * 1e6
        in_step = in_step_all_sum_s(m, self.backend, model.hidden_size * model.activation_bytes, model.n_layers)
        if in_step is not None:
            self.prefill_backend_us = in_step * 1e6
        self.seqs = req.batch if req.optimize == "throughput" else 1

    def validate(self, topology: Topology) -> Topology:
        """:meth:`Topology.validate` against the model, once per topology (raises :class:`TopologyError`)."""
        if topology not in self._valid:
            try:
                self._valid[topology] = topology.validate(self.model.config, name=self.model.name,
                                                          quantization=self.model.quantization,
                                                          weights=self.model.weights)
            except TopologyError as exc:
                self._valid[topology] = exc
        got = self._valid[topology]
        if isinstance(got, TopologyError):
            raise got
        return got

    def slowest_link(self, nodes: Sequence[str]) -> Tuple[float, float, str]:
        """:func:`_slowest_link` of ``nodes``."""
        return _slowest_link(self.m, nodes)

    def hop(self, a: str, b: str, nbytes: float) -> float:
        """One point-to-point transfer: ``latency + nbytes / bandwidth`` of link ``a``-``b``."""
        if a == b:
            return 0.0
        lk = self.m.link(a, b)
        if lk is None:
            raise ShapeError(f"link {a}-{b} not measured")
        return lk.latency_s + nbytes / lk.bandwidth_bytes_per_s

    def slowdown(self, nodes: Sequence[str], prefill: bool) -> Dict[str, float]:
        """:func:`_slowdowns` of ``nodes``."""
        return _slowdowns(self.m, nodes, prefill)


# --------------------------------------------------------------------------- one group's figures


@dataclass(frozen=True)
class _Stage:
    nodes: Tuple[str, ...]  # its ranks (TP group), rank order
    layers: int
    embeds: bool
    output: bool


def _stage_memory(ctx: _Ctx, st: _Stage) -> int:
    """Bytes each rank of ``st`` holds: layers' weights and K/V split ``k`` ways, embedding/head (split
    when ``k`` divides the vocabulary)."""
    mp, k = ctx.model, len(st.nodes)
    vocab_k = k if mp.vocab_size % k == 0 else 1
    fixed = 0
    if st.embeds or (st.output and mp.tied):
        fixed += mp.embed_bytes
    if st.output:
        fixed += mp.head_bytes
    kv = ctx.req.context * ctx.seqs * mp.kv_bytes_per_token * st.layers / mp.n_layers
    return int(st.layers * mp.layer_bytes / k + fixed / vocab_k + kv / k)


def _stage_time(ctx: _Ctx, st: _Stage, batch: float, tokens: int, prefill: bool,
                busy: Optional[Sequence[str]] = None) -> float:
    """Seconds for stage ``st`` to run ``batch`` sequences of ``tokens`` tokens (decode: 1) through its
    layers: the slowest rank's compute plus the stage's all_sums (module docstring).  ``busy``: the
    ranks computing at the same time (default: the stage's own), for :func:`host_slowdown`."""
    mp, k = ctx.model, len(st.nodes)
    slow = ctx.slowdown(busy or st.nodes, prefill)
    worst = 0.0
    for n in st.nodes:
        nm = ctx.m.node(n)
        if prefill:
            c = tokens * batch * (st.layers / mp.n_layers) / nm.prefill_tokens_per_s
        else:
            c = st.layers * (nm.layer_s + (batch - 1) * nm.layer_batch_s) + (nm.head_s if st.output else 0.0)
        worst = max(worst, slow[n] * c / k)
    if k > 1:
        lat, bw, _ = ctx.slowest_link(st.nodes)
        act = batch * tokens * mp.hidden_size * mp.activation_bytes
        one = all_sum_s(act, k, ctx.prefill_backend_us if prefill else ctx.backend_us, lat, bw, ctx.backend)
        worst += (2 * st.layers + (1 if st.embeds else 0)) * one
        if st.output and not prefill and mp.vocab_size % k == 0:  # the head's all_gather of logits
            worst += one - 2 * (k - 1) / k * act / bw + (k - 1) / k * batch * mp.vocab_size * 4 / bw
    return worst


def _frame_s(ctx: _Ctx, nodes: Sequence[str]) -> float:
    """Rank 0's step frame to ranks N: ``FRAME_S`` plus the slowest of rank 0's links (0 alone)."""
    if len(nodes) <= 1:
        return 0.0
    return FRAME_S + max(ctx.hop(nodes[0], n, 0) for n in nodes[1:])


def _pipeline_time(ctx: _Ctx, stages: Sequence[_Stage], batch: float, tokens: int, prefill: bool,
                   overlap: bool = False) -> float:
    """Seconds of one pass of ``stages`` (rank order; hidden states flow in layer order)."""
    nodes = [n for st in stages for n in st.nodes]
    first = next(i for i, s in enumerate(stages) if s.embeds)
    flow = list(stages[first:]) + list(stages[:first])
    act = batch * tokens * ctx.model.hidden_size * ctx.model.activation_bytes
    hops = sum(ctx.hop(a.nodes[0], b.nodes[0], act) for a, b in zip(flow, flow[1:]))
    frame = _frame_s(ctx, nodes)
    if overlap and len(stages) > 1 and batch > 1:
        micro = min(batch, len(stages))
        per = max(_stage_time(ctx, st, batch / micro, tokens, prefill, nodes) for st in stages)
        return (micro + len(stages) - 1) * per + hops + frame
    return sum(_stage_time(ctx, st, batch, tokens, prefill) for st in stages) + hops + frame


def _predict(ctx: _Ctx, stages: Sequence[_Stage]) -> Prediction:
    req = ctx.req
    prompt = max(1, min(req.prompt_tokens, req.context))
    memory = tuple((n, _stage_memory(ctx, st)) for st in stages for n in st.nodes)
    return Prediction(decode_s=_pipeline_time(ctx, stages, 1, 1, False),
                      batch_s=_pipeline_time(ctx, stages, req.batch, 1, False, req.pipeline_overlap),
                      ttft_s=_pipeline_time(ctx, stages, 1, prompt, True), memory=memory, batch=req.batch)


def _misfit(ctx: _Ctx, memory: Iterable[Tuple[str, int]]) -> str:
    """``"does not fit: node c needs 3.1 GB, has 2.0 GB"`` for the worst node short of memory, else ``""``."""
    short = [(need - ctx.m.node(n).memory_bytes, n, need) for n, need in memory if need > ctx.m.node(n).memory_bytes]
    if not short:
        return ""
    _, n, need = max(short)
    return f"does not fit: node {n} needs {_fmt_bytes(need)}, has {_fmt_bytes(ctx.m.node(n).memory_bytes)}"


# --------------------------------------------------------------------------- layer splits


def _layer_caps(ctx: _Ctx, groups: Sequence[Tuple[str, ...]]) -> List[int]:
    """Most layers each stage (``groups``, layer order) holds in its ranks' memory (0 or less: none)."""
    mp, caps = ctx.model, []
    per_layer_kv = ctx.req.context * ctx.seqs * mp.kv_bytes_per_token / mp.n_layers
    for i, g in enumerate(groups):
        k = len(g)
        st = _Stage(g, 0, embeds=i == 0, output=i == len(groups) - 1)
        fixed = _stage_memory(ctx, st)
        free = min(ctx.m.node(n).memory_bytes for n in g) - fixed
        caps.append(int(free // ((mp.layer_bytes + per_layer_kv) / k)))
    return caps


def _split(n_layers: int, weights: Sequence[float], caps: Sequence[int]) -> Optional[List[int]]:
    """Layer counts proportional to ``weights`` (largest remainder), each at least 1 and at most its cap,
    the excess of a capped stage spread over the others by the same weights; ``None``: they hold fewer
    than ``n_layers``."""
    s = len(weights)
    if any(c < 1 for c in caps) or sum(caps) < n_layers or n_layers < s:
        return None
    counts = [1] * s
    free = [i for i in range(s)]
    left = n_layers - s
    while left > 0:
        free = [i for i in free if counts[i] < caps[i]]
        total = sum(weights[i] for i in free)
        exact = {i: left * weights[i] / total for i in free}
        give = {i: min(int(exact[i]), caps[i] - counts[i]) for i in free}
        if sum(give.values()) == 0:  # hand out the remainders one at a time
            i = max(free, key=lambda j: exact[j] - int(exact[j]))
            give[i] = 1
        for i, g in give.items():
            counts[i] += g
            left -= g
    return counts


def _greedy(n_layers: int, speed: Sequence[float], caps: Sequence[int]) -> Optional[List[int]]:
    """Fastest stage first up to its cap, one layer each for the rest: the least total compute."""
    s = len(speed)
    if any(c < 1 for c in caps) or sum(caps) < n_layers or n_layers < s:
        return None
    counts, left = [1] * s, n_layers - s
    for i in sorted(range(s), key=lambda j: -speed[j]):
        g = min(left, caps[i] - 1)
        counts[i] += g
        left -= g
    return counts


# --------------------------------------------------------------------------- candidates


def _close(req: Request, p: Prediction, best: Prediction) -> bool:
    """``p`` is within :data:`NODE_MARGIN` of ``best`` by the target's figure."""
    if req.optimize == "ttft":
        return p.ttft_s <= best.ttft_s * (1 + NODE_MARGIN)
    return _metric(req, p) * (1 + NODE_MARGIN) >= _metric(req, best)


def _metric(req: Request, p: Prediction) -> float:
    """Higher is better: tok/s single stream, tok/s at batch, or minus the TTFT."""
    if req.optimize == "throughput":
        return p.batch_tok_s
    if req.optimize == "ttft":
        return -p.ttft_s
    return p.decode_tok_s


def _single(ctx: _Ctx, n: str) -> Candidate:
    st = _Stage((n,), ctx.model.n_layers, True, True)
    pred = _predict(ctx, [st])
    return Candidate("single", f"{n} alone", (n,), Topology(tp=1), "", pred, reason=_misfit(ctx, pred.memory))


def _tp(ctx: _Ctx, nodes: Tuple[str, ...], topology: Topology) -> Candidate:
    st = _Stage(nodes, ctx.model.n_layers, True, True)
    label = f"TP={len(nodes)} on {','.join(nodes)}"
    try:
        _, _, note = ctx.slowest_link(nodes)
        pred = _predict(ctx, [st])
    except ShapeError as exc:
        return Candidate("tp", label, nodes, topology, ctx.backend, reason=str(exc))
    return Candidate("tp", label, nodes, topology, ctx.backend, pred, note, _misfit(ctx, pred.memory))


def _pipeline(ctx: _Ctx, groups: Sequence[Tuple[str, ...]]) -> Candidate:
    """The best pipeline over ``groups`` (rank order, stage 0 = rank 0 = the output stage of a reverse
    route, the others in layer order), over two layer splits (speed-proportional, fastest-first)."""
    mp, req = ctx.model, ctx.req
    layer_order = list(groups[1:]) + [groups[0]]  # reverse route: rank 0 owns K:output
    nodes = tuple(n for g in groups for n in g)
    kind = "tp_pp" if any(len(g) > 1 for g in groups) else "pipeline"
    where = "|".join(",".join(g) for g in groups) if kind == "tp_pp" else ",".join(nodes)
    caps = _layer_caps(ctx, layer_order)
    speed = [len(g) / max(s * ctx.m.node(n).layer_s for n, s in ctx.slowdown(g, False).items())
             for g in layer_order]
    best: Optional[Candidate] = None
    for counts in (_split(mp.n_layers, speed, caps), _greedy(mp.n_layers, speed, caps)):
        if counts is None:
            continue
        ranges, start = [], 0
        for c in counts:
            ranges.append(LayerRange(start, start + c - 1, start + c == mp.n_layers))
            start += c
        ranges = ranges[-1:] + ranges[:-1]  # rank order
        sizes = [len(g) for g in groups]
        try:
            route = make_route(ranges, mp.n_layers, sizes)
            topology = ctx.validate(Topology(layers=route.spec(),
                                             stage_tp=None if set(sizes) == {1} else ",".join(map(str, sizes))))
        except (LayoutError, TopologyError) as exc:
            return Candidate(kind, f"pipeline on {where}", nodes, reason=str(exc))
        stages = [_Stage(g, r.n_layers, r.embeds, r.output) for g, r in zip(groups, ranges)]
        label = f"pipeline {route.identity()} on {where}"
        flow = [g for g, _ in sorted(zip(groups, ranges), key=lambda x: x[1].start)]
        try:  # the slowest link that carries hidden states: between stages, or inside a TP stage
            used = [ctx.slowest_link((a[0], b[0])) for a, b in zip(flow, flow[1:])]
            used += [ctx.slowest_link(g) for g in groups if len(g) > 1]
            ctx.slowest_link(nodes)  # every pair measured (rank 0's frames)
            note = min(used, key=lambda u: u[1])[2]
            pred = _predict(ctx, stages)
        except ShapeError as exc:
            return Candidate(kind, label, nodes, topology, reason=str(exc))
        cand = Candidate(kind, label, nodes, topology, ctx.backend, pred, note, _misfit(ctx, pred.memory))
        if best is None or _metric(req, pred) > _metric(req, best.prediction):
            best = cand
    if best is None:
        per_layer = mp.layer_bytes + req.context * ctx.seqs * mp.kv_bytes_per_token / mp.n_layers
        return Candidate(kind, f"pipeline on {where}", nodes,
                         reason=f"does not fit: the stages hold {max(0, sum(max(c, 0) for c in caps))} of "
                                f"{mp.n_layers} layers ({_fmt_bytes(per_layer)} per layer with its K/V)")
    return best


def _pd(ctx: _Ctx, prefill: str, decode: Candidate) -> Candidate:
    """Prefill on ``prefill`` alone, decode as ``decode`` (a single node or a TP candidate)."""
    mp, req = ctx.model, ctx.req
    label = f"PD prefill {prefill}, decode {decode.label}"
    nodes = (prefill,) + decode.nodes
    try:
        ctx.validate(Topology(role="prefill"))
    except TopologyError as exc:
        return Candidate("pd", label, nodes, reason=str(exc))
    prompt = max(1, min(req.prompt_tokens, req.context))
    alone = _Stage((prefill,), mp.n_layers, True, True)
    t_prefill = _stage_time(ctx, alone, 1, prompt, True)
    k = len(decode.nodes)
    try:
        t_kv = max(ctx.hop(prefill, n, prompt * mp.kv_bytes_per_token / k) for n in decode.nodes)
        lat = max(ctx.hop(prefill, n, 0) for n in decode.nodes)
        _, _, note = ctx.slowest_link(nodes)
    except ShapeError as exc:
        return Candidate("pd", label, nodes, decode.topology, reason=str(exc))
    ttft = max(t_prefill, t_kv) + t_kv / mp.n_layers + lat + _frame_s(ctx, decode.nodes)
    d = decode.prediction
    pre_mem = int(mp.weight_bytes + req.context * mp.kv_bytes_per_token)
    pred = replace(d, ttft_s=ttft, memory=((prefill, pre_mem),) + d.memory)
    return Candidate("pd", label, nodes, decode.topology, decode.backend, pred, note, _misfit(ctx, pred.memory))


def _tp_sizes(ctx: _Ctx, n: int) -> Tuple[Dict[int, Topology], List[Candidate]]:
    """Valid TP sizes 2..n with their topologies, and one refused candidate per size that does not split."""
    valid, refused = {}, []
    for k in range(2, n + 1):
        try:
            valid[k] = ctx.validate(Topology(tp=k))
        except TopologyError as exc:
            refused.append(Candidate("tp", f"TP={k}", (), reason=str(exc)))
    return valid, refused


def _orders(groups: Sequence[Tuple[str, ...]]) -> Iterable[Tuple[Tuple[str, ...], ...]]:
    """Rank orders of a pipeline's stages to try: all (up to :data:`MAX_ORDERS`), given order first."""
    return itertools.islice(itertools.permutations(groups), MAX_ORDERS)


def _set_partitions(items: Sequence[str]) -> Iterable[List[Tuple[str, ...]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        for i in range(len(part)):
            yield part[:i] + [(first,) + part[i]] + part[i + 1:]
        yield [(first,)] + part


def _candidates(ctx: _Ctx) -> List[Candidate]:
    ids = sorted(n.node_id for n in ctx.m.nodes)
    req = ctx.req
    out = [_single(ctx, n) for n in ids]
    valid, refused = _tp_sizes(ctx, len(ids))
    out += refused
    tps = [c for c in (_tp(ctx, sub, valid[k]) for k in sorted(valid) for sub in itertools.combinations(ids, k))]
    out += tps
    # pipelines (single-rank stages) over every subset of 2+ nodes, and TP x PP over set partitions
    # with a TP stage (at most 6 nodes: Bell(6) partitions), the best rank order of each
    for size in range(2, len(ids) + 1):
        for sub in itertools.combinations(ids, size):
            layouts = [[(n,) for n in sub]]
            if len(sub) <= 6 and "mpi" in ctx.m.all_sum_us:  # TP stages split the group: MPI only
                layouts += [p for p in _set_partitions(list(sub))
                            if 1 < len(p) < len(sub) and all(len(g) == 1 or len(g) in valid for g in p)]
            for groups in layouts:
                out.append(_best(req, [_pipeline(ctx, order) for order in _orders(groups)]))
    # PD: the fastest prefill node prefills, each single node / TP group of the others decodes
    ids_by_prefill = sorted(ids, key=lambda n: -ctx.m.node(n).prefill_tokens_per_s)
    if len(ids) >= 2:
        p = ids_by_prefill[0]
        decoders = [c for c in out[:len(ids)] + tps if p not in c.nodes and c.prediction is not None]
        if decoders:
            out.append(_best(req, [_pd(ctx, p, d) for d in decoders]))
    return out


def _best(req: Request, cands: Sequence[Candidate]) -> Candidate:
    """The best of some variants of one plan: by the target among those that fit, else among those
    predicted, else the first refused."""
    predicted = [c for c in cands if c.prediction is not None]
    pool = [c for c in predicted if not c.reason] or predicted
    return max(pool, key=lambda c: _metric(req, c.prediction)) if pool else cands[0]


# --------------------------------------------------------------------------- the planner


def plan_shape(measurements: Measurements, model: ModelProfile, request: Request) -> Tuple[Candidate, ...]:
    """Every candidate plan, predicted and ranked for ``request.optimize``: the chosen one first
    (:attr:`Candidate.chosen`), then the others that fit by the same figure, then those refused.

    Raises:
        ShapeError: one line: an unknown target, no nodes, a context beyond the model's positions, a
            context whose K/V no plan holds, or a model that fits no plan at all.
    """
    req = request
    if req.optimize not in OPTIMIZE:
        raise ShapeError(f"--optimize {req.optimize!r}: choose {', '.join(OPTIMIZE)}")
    if req.context < 1 or req.batch < 1:
        raise ShapeError("the context and the batch must be at least 1")
    if not measurements.nodes:
        raise ShapeError("no nodes measured")
    if len({n.node_id for n in measurements.nodes}) != len(measurements.nodes):
        raise ShapeError("a node id is measured twice")
    if req.context > model.max_positions:
        raise ShapeError(f"context {req.context} tokens is beyond {model.name}'s {model.max_positions} positions")
    ctx = _Ctx(measurements, model, req)
    cands = _candidates(ctx)
    fits = [c for c in cands if c.prediction is not None and not c.reason]
    if not fits:
        def fits_at(tokens: int) -> bool:
            return any(c.prediction is not None and not c.reason
                       for c in _candidates(_Ctx(measurements, model, replace(req, context=tokens))))

        if fits_at(1):
            longest, hi = 1, req.context  # bisect: the longest context some plan holds
            while hi - longest > 1:
                mid = (longest + hi) // 2
                longest, hi = (mid, hi) if fits_at(mid) else (longest, mid)
            raise ShapeError(
                f"context {req.context} tokens is too long for every plan: its K/V cache needs "
                f"{_fmt_bytes(req.context * ctx.seqs * model.kv_bytes_per_token)} "
                f"({model.kv_bytes_per_token} bytes per token"
                f"{f' x {ctx.seqs} sequences' if ctx.seqs > 1 else ''}); the longest any plan holds is "
                f"{longest} tokens")
        total = sum(n.memory_bytes for n in measurements.nodes)
        raise ShapeError(f"{model.name} fits no plan: its weights need {_fmt_bytes(model.weight_bytes)}, "
                         f"the nodes have {_fmt_bytes(total)} in all")
    key = lambda c: (_metric(req, c.prediction), -len(c.nodes))  # noqa: E731
    fits.sort(key=key, reverse=True)
    # a plan on more nodes must win by more than NODE_MARGIN: the fewest nodes among those that close
    best = min((c for c in fits if _close(req, c.prediction, fits[0].prediction)),
               key=lambda c: (len(c.nodes), -_metric(req, c.prediction)))
    if best is not fits[0]:
        fits.remove(best)
        fits.insert(0, best)
    singles = [c for c in fits if c.kind == "single"]
    alone = singles[0] if singles else None
    ranked = [replace(best, chosen=True, reason="")]
    for c in fits[1:]:
        if c.kind != "single" and alone is not None and _metric(req, c.prediction) < _metric(req, alone.prediction):
            why = f"slower than {alone.label}"
        elif _metric(req, c.prediction) > _metric(req, best.prediction):
            why = f"within {NODE_MARGIN:.0%} of {best.label}, on more nodes"
        else:
            why = f"slower than {best.label}"
        ranked.append(replace(c, reason=why))
    rest = [c for c in cands if c not in fits]
    rest.sort(key=lambda c: (c.prediction is None, -_metric(req, c.prediction) if c.prediction else 0))
    return tuple(ranked + rest)


def chosen(ranked: Sequence[Candidate]) -> Candidate:
    """The chosen candidate of :func:`plan_shape`'s result."""
    return next(c for c in ranked if c.chosen)


def _figure(c: Candidate, optimize: str) -> str:
    p = c.prediction
    if p is None:
        return ""
    parts = {"decode": f"{p.decode_tok_s:.1f} tok/s", "throughput": f"{p.batch_tok_s:.1f} tok/s at batch {p.batch}",
             "ttft": f"TTFT {p.ttft_s:.2f} s"}
    first = parts.pop(optimize)
    mem = max(b for _, b in p.memory)
    return f"{first} ({', '.join(parts.values())}, {_fmt_bytes(mem)} max per node)"


def describe(ranked: Sequence[Candidate], optimize: str = "decode", limit: Optional[int] = None) -> List[str]:
    """One line per candidate, chosen first and marked ``*``: ``* TP=3 on a,b,c over mpi: 9.1 tok/s (...)
    [link b-c 12 MB/s]``, the others with `` -- `` and their reason; ``limit``: at most that many lines
    (plus one counting the rest)."""
    lines = []
    for c in ranked:
        over = f" over {c.backend}" if c.backend and len(c.nodes) > 1 else ""
        fig = _figure(c, optimize)
        text = f"{'*' if c.chosen else ' '} {c.label}{over}" + (f": {fig}" if fig else "")
        if c.note:
            text += f" [{c.note}]"
        if c.reason:
            text += f" -- {c.reason}"
        lines.append(text)
    if limit is not None and len(lines) > limit:
        lines = lines[:limit] + [f"  ... {len(lines) - limit} more"]
    return lines


# --------------------------------------------------------------------------- JSON


def measurements_from_json(doc: Any) -> Measurements:
    """:class:`Measurements` from their JSON form: ``{"nodes": [NodeMeasure fields], "links":
    [LinkMeasure fields], "all_sum_us": {"mpi": 76.0, "ring": 4000.0}, "tp_layers": [{"backend": "mpi",
    "nodes": ["a", "b"], "layer_s": 0.004}]}`` (field names and units as the dataclasses'; ``links``,
    ``all_sum_us`` and ``tp_layers`` optional).

    Raises:
        ShapeError: one line naming the first bad entry.
    """
    def build(cls, item, where):
        if not isinstance(item, dict):
            raise ShapeError(f"{where}: expected an object")
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(item) - names)
        if unknown:
            raise ShapeError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(names))})")
        try:
            obj = cls(**item)
        except TypeError as exc:
            raise ShapeError(f"{where}: {str(exc).split('__init__() ')[-1]}") from None
        for name, value in item.items():
            want = cls.__dataclass_fields__[name].type
            numeric = want in ("int", "float")
            if numeric and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
                            or not math.isfinite(value)):
                raise ShapeError(f"{where}: {name} must be a non-negative number, not {value!r}")
            if want == "str" and not isinstance(value, str):
                raise ShapeError(f"{where}: {name} must be a string, not {value!r}")
        return obj

    if not isinstance(doc, dict):
        raise ShapeError("measurements: expected a JSON object with \"nodes\"")
    unknown = sorted(set(doc) - {"nodes", "links", "all_sum_us", "tp_layers"})
    if unknown:
        raise ShapeError(f"measurements: unknown key {unknown[0]!r} (keys: nodes, links, all_sum_us, tp_layers)")
    nodes = doc.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ShapeError("measurements: \"nodes\" must be a non-empty list")
    got = tuple(build(NodeMeasure, n, f"nodes[{i}]") for i, n in enumerate(nodes))
    for i, n in enumerate(got):
        if n.layer_s <= 0 or n.prefill_tokens_per_s <= 0:
            raise ShapeError(f"nodes[{i}]: layer_s and prefill_tokens_per_s must be above 0")
    links = doc.get("links", [])
    if not isinstance(links, list):
        raise ShapeError("measurements: \"links\" must be a list")
    lks = tuple(build(LinkMeasure, lk, f"links[{i}]") for i, lk in enumerate(links))
    ids = {n.node_id for n in got}
    for i, lk in enumerate(lks):
        if lk.a not in ids or lk.b not in ids or lk.a == lk.b:
            raise ShapeError(f"links[{i}]: {lk.a}-{lk.b} is not a pair of measured nodes")
        if lk.bandwidth_bytes_per_s <= 0:
            raise ShapeError(f"links[{i}]: bandwidth_bytes_per_s must be above 0")
    sums = doc.get("all_sum_us", {})
    if not isinstance(sums, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                                         for v in sums.values()):
        raise ShapeError("measurements: \"all_sum_us\" must map backend names to microseconds above 0")
    layers = doc.get("tp_layers", [])
    if not isinstance(layers, list):
        raise ShapeError("measurements: \"tp_layers\" must be a list")
    tps = []
    for i, t in enumerate(layers):
        where = f"tp_layers[{i}]"
        if not isinstance(t, dict) or not {"backend", "nodes", "layer_s"} <= set(t) \
                or not set(t) <= {"backend", "nodes", "layer_s", "prefill_layer_s", "prefill_tokens"}:
            raise ShapeError(f"{where}: expected an object with backend, nodes, layer_s (and optionally "
                             "prefill_layer_s, prefill_tokens)")
        nodes_of = t["nodes"]
        if not isinstance(t["backend"], str) or not isinstance(nodes_of, list) or len(nodes_of) < 2 \
                or any(n not in ids for n in nodes_of):
            raise ShapeError(f"{where}: backend must be a string and nodes a list of two or more measured nodes")
        nums = {}
        for name, want in (("layer_s", "a number above 0"), ("prefill_layer_s", "a non-negative number"),
                           ("prefill_tokens", "a non-negative integer")):
            x = t.get(name, 0)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0 \
                    or (name == "layer_s" and x == 0) or (name == "prefill_tokens" and x != int(x)):
                raise ShapeError(f"{where}: {name} must be {want}, not {x!r}")
            nums[name] = x
        tps.append(TpLayerMeasure(t["backend"], tuple(nodes_of), float(nums["layer_s"]),
                                  float(nums["prefill_layer_s"]), int(nums["prefill_tokens"])))
    return Measurements(got, lks, {str(k): float(v) for k, v in sums.items()}, tuple(tps))
