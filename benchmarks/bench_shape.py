"""Choosing the shape by measurement (issue 31): three emulated heterogeneous clusters, the shape
planner's ranked predictions from the nodes' own measurements, and every candidate formed and measured.

Usage (root, Linux: network namespaces, ``tc`` and cgroup v1's ``cpu`` controller)::

    .venv/bin/python -m benchmarks.bench_shape [--clusters a,b,c] [--quick] [--tokens 32] [--out FILE]

Each cluster is three ``mlxcluster join`` nodes ``a``, ``b``, ``c``, one per network namespace on one
bridge (:mod:`benchmarks.netns`).  A node is a machine of its own as far as software can tell: its own
UTS namespace (hostname ``shape-X``, so OpenMPI carries its traffic over TCP on the shaped link rather
than shared memory, and the planner does not treat the three as one host), its own ``HOME`` (its
compute-measurement cache, kept across the clusters: the machines are the same three), and its own cgroup v1 ``cpu`` group (``cpu.cfs_quota_us`` over a 10 ms
period, ``cpu.shares`` raised so that the machine's other work does not take the node's quota) that
the daemon is put in before it starts, so its rank processes, ``mpirun``/``orted`` and its
measurement child inherit it; BLAS runs one thread per node (``OPENBLAS_NUM_THREADS=1``).  Links are
shaped in user space (:func:`benchmarks.netns.slow_wire`, :mod:`benchmarks.wire`: ``tc netem``'s delay
and rate, for kernels without ``sch_netem`` -- this machine's has only ``tbf``, ``htb`` and ``pfifo``).

* (a) equal nodes, fast links: every node 0.4 CPU, links unshaped;
* (b) node ``c`` behind a slow, high-latency link: ``c`` 5 ms each way and 50 Mbit/s;
* (c) node ``c`` short of memory: ``join --memory 150MB`` (an even split of the default 4096-token
  context over three nodes needs ~200 MB on each).

Per cluster:

1. the nodes start with ``join --plan auto`` (the default): each measures its compute in its cgroup
   (cached in its ``HOME``), its links, and forms what it chooses; what formed is recorded;
2. the nodes restart with ``--world-size 3`` (TP=3 over MPI: its ranks measure the backend's
   ``all_sum`` and a TP=3 decoder layer, which sets what a step's ``all_sum`` costs); TP=3 is
   measured, then ``mlxcluster plan --cluster --save`` gathers every node's measurements and ranks
   the candidates (``--prompt-tokens`` = the measured prompt's length);
3. every other candidate that fits memory is formed explicitly -- ``X alone``: ``--world-size 1`` on
   X; ``TP=k``: ``--world-size k`` on its nodes; a pipeline: each node's range of the candidate's
   route as its ``--layers``; PD: ``--role prefill`` on the prefill node, ``--role decode`` on the
   decode node -- and measured: a warm-up generation, then one greedy generation per measured prompt
   (``--prompts``; ``--tokens`` tokens each, fixed prompts of ``--prompt-tokens`` tokens): rank 0's
   decode tok/s and TTFT, the tokens compared with the first single node's (TP=1).

4. the chosen plan and the measured best (when another) are formed ``--confirm`` more times each,
   alternately: one pass's best of several candidates of about the same speed is partly its luck.

Printed per cluster: the ranking, then a table -- prediction vs measurement per candidate (off by
``(pred - meas) / meas``), the chosen plan against the measured best (target: within 10 %; first pass,
then the mean over the confirming passes), the predictions within +-30 % (target: all), tokens equal
to TP=1's.  Missed targets are reported, not
errors: the exit status is non-zero only when the benchmark itself fails.  Everything made (namespaces,
cgroups, processes) is removed in ``finally``; every wait is bounded.  A full run of the three clusters
took 24 minutes on a 2-core machine shared with other work (17 without the confirming passes; a
formation that fails costs up to ``--form-timeout``); ``--quick`` (one prompt of 16 tokens, one
confirming pass) ~4 minutes per cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CGROUP_CPU = "/sys/fs/cgroup/cpu"
#: cgroup v1 CFS period of every node's group, µs (short: a rank waiting in a collective is not
#: throttled for long).
PERIOD_US = 10_000
#: ``cpu.shares`` of each node's group (the root's tasks weigh 1024 each): the node gets its quota
#: while other work runs on the machine.
SHARES = 65536
SECRET = "bench-shape-" + uuid.uuid4().hex
PROMPT_TEXTS = (
    "The history of the city begins with a small fishing village on the river. Over the centuries it grew into "
    "a trading port, and merchants from many lands came to sell wool, salt, spices and cloth. ",
    "A good recipe for bread needs only flour, water, salt and yeast. Mix them, knead the dough for ten "
    "minutes, let it rise in a warm place, shape the loaf and bake it until the crust is brown. ",
)
WARMUP_TEXT = "Write one sentence about the sea."


@dataclass(frozen=True)
class NodeSpec:
    """One emulated machine: CPU quota (cores), its link's one-way delay (ms, each direction) and
    rate (Mbit/s; 0: unshaped), and ``join --memory`` (``""``: none)."""

    node_id: str
    cpus: float = 0.4
    delay_ms: float = 0.0
    rate_mbit: float = 0.0
    memory: str = ""


CLUSTERS: Dict[str, Tuple[str, Tuple[NodeSpec, ...]]] = {
    "a": ("equal nodes (0.4 CPU each), fast links (veth, unshaped)",
          (NodeSpec("a"), NodeSpec("b"), NodeSpec("c"))),
    "b": ("node c behind a slow link: 5 ms each way, 50 Mbit/s (all nodes 0.4 CPU)",
          (NodeSpec("a"), NodeSpec("b"), NodeSpec("c", delay_ms=5.0, rate_mbit=50.0))),
    "c": ("node c advertises 150 MB (join --memory): too little for an even split (all nodes 0.4 CPU)",
          (NodeSpec("a"), NodeSpec("b"), NodeSpec("c", memory="150MB"))),
}


def uptime() -> str:
    from benchmarks.netns import _sh

    try:
        return _sh("uptime").stdout.strip()
    except Exception as exc:  # noqa: BLE001 -- a note only
        return f"(uptime: {exc})"


# --------------------------------------------------------------------------- the emulated machines


def _kill_cgroup(path: str) -> None:
    """SIGKILL every process left in cgroup ``path`` (the processes a node started), bounded."""
    for _ in range(20):
        try:
            with open(os.path.join(path, "cgroup.procs")) as fh:
                pids = [int(x) for x in fh.read().split()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


@contextlib.contextmanager
def cgroups(tag: str, specs: Tuple[NodeSpec, ...]) -> Iterator[Dict[str, str]]:
    """One cgroup v1 ``cpu`` group per node (quota ``cpus`` x :data:`PERIOD_US`): yields node id -> path;
    on exit kills what is left in them and removes them."""
    if not os.path.isdir(CGROUP_CPU) or not os.path.exists(os.path.join(CGROUP_CPU, "cpu.cfs_quota_us")):
        raise RuntimeError(f"no cgroup v1 cpu controller at {CGROUP_CPU}")
    made: Dict[str, str] = {}
    try:
        for s in specs:
            path = os.path.join(CGROUP_CPU, f"mlxshape-{tag}-{s.node_id}")
            os.mkdir(path)
            made[s.node_id] = path
            for name, value in (("cpu.cfs_period_us", PERIOD_US), ("cpu.cfs_quota_us", int(s.cpus * PERIOD_US)),
                                ("cpu.shares", SHARES)):
                with open(os.path.join(path, name), "w") as fh:
                    fh.write(str(value))
        yield made
    finally:
        for path in made.values():
            _kill_cgroup(path)
            for _ in range(20):  # bounded: a group empties once its processes are reaped
                try:
                    os.rmdir(path)
                    break
                except OSError:
                    time.sleep(0.25)


@contextlib.contextmanager
def shaped_links(hosts, specs: Tuple[NodeSpec, ...], tag: str) -> Iterator[None]:
    """Each shaped node behind a slow link (:func:`benchmarks.netns.slow_wire`: delay and rate in user space,
    this kernel has no ``sch_netem``); the forwarders run in a cgroup of their own (``cpu.shares`` high, no
    quota: the wire is not a node's CPU)."""
    from benchmarks.netns import slow_wire

    shaped = [(i, s) for i, s in enumerate(specs) if s.delay_ms or s.rate_mbit]
    if not shaped:
        yield
        return
    path = os.path.join(CGROUP_CPU, f"mlxshape-{tag}-wire")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "cpu.shares"), "w") as fh:
            fh.write(str(SHARES))

        def enter() -> None:
            with open(os.path.join(path, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
        with contextlib.ExitStack() as stack:
            for i, s in shaped:
                stack.enter_context(slow_wire(hosts, i, s.delay_ms, s.rate_mbit, preexec_fn=enter))
            yield
    finally:
        _kill_cgroup(path)
        for _ in range(20):  # bounded
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.25)


class Cluster:
    """Three emulated machines (:data:`CLUSTERS`): start and stop ``join`` nodes on them, run the client."""

    def __init__(self, name: str, specs: Tuple[NodeSpec, ...], hosts, groups: Dict[str, str], tmp: str, model: str):
        self.name, self.specs, self.hosts, self.groups, self.tmp, self.model = name, specs, hosts, groups, tmp, model
        self.ns = {s.node_id: ns for s, (ns, _) in zip(specs, hosts)}
        self.procs: Dict[str, subprocess.Popen] = {}
        self.run_no = 0
        self.cluster = ""

    def spec(self, node_id: str) -> NodeSpec:
        return next(s for s in self.specs if s.node_id == node_id)

    def env(self, node_id: Optional[str] = None) -> Dict[str, str]:
        env = dict(os.environ, MLXCLUSTER_SECRET=SECRET, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS="1",
                   OMP_NUM_THREADS="1")
        if node_id is not None:
            home = os.path.join(self.tmp, f"home-{node_id}")  # its own measurement cache
            os.makedirs(home, exist_ok=True)
            env["HOME"] = home
        return env

    def start(self, nodes: Dict[str, List[str]]) -> None:
        """Start ``join`` on each node id of ``nodes`` with its extra options, in a fresh cluster name."""
        self.run_no += 1
        self.cluster = f"shape-{self.name}-{uuid.uuid4().hex[:6]}"
        for nid, extra in nodes.items():
            s = self.spec(nid)
            join = [sys.executable, "-m", "mlxcluster", "join", "--cluster", self.cluster, "--node-id", nid,
                    "--interface", "eth0", "--weights", "float32", "--model", self.model, "--no-dashboard",
                    "--no-standby"] + (["--memory", s.memory] if s.memory else []) + extra
            # into the node's cgroup before exec (ip netns exec remounts /sys: no cgroup there), then a
            # hostname of its own, then the daemon (exec: the same process)
            procs_file = os.path.join(self.groups[nid], "cgroup.procs")

            def enter(path=procs_file) -> None:
                with open(path, "w") as fh:
                    fh.write(str(os.getpid()))
            log = open(os.path.join(self.tmp, f"{self.name}-{self.run_no}-{nid}.log"), "w")
            self.procs[nid] = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[nid], "unshare", "--uts", "--", "sh", "-c",
                 f"hostname shape-{nid} && exec \"$0\" \"$@\""] + join,
                env=self.env(nid), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0,
                preexec_fn=enter)
            log.close()

    def stop(self) -> None:
        """SIGTERM each node (its daemon stops its ranks), SIGKILL after 20 s, then whatever its cgroup holds."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
        for nid in self.procs:
            _kill_cgroup(self.groups[nid])
        self.procs = {}

    def logs(self, chars: int = 1200) -> str:
        out = []
        for nid in sorted(self.procs):
            path = os.path.join(self.tmp, f"{self.name}-{self.run_no}-{nid}.log")
            with contextlib.suppress(OSError), open(path) as fh:
                out.append(f"--- node {nid}:\n" + fh.read()[-chars:])
        return "\n".join(out)

    def in_ns(self, args: List[str], timeout: float) -> subprocess.CompletedProcess:
        """Run ``args`` in the first node's namespace (a client on the cluster's link), bounded."""
        return subprocess.run(["ip", "netns", "exec", self.hosts[0][0]] + args, env=self.env(), capture_output=True,
                              text=True, timeout=timeout)

    def client(self, prompts: List[List[int]], tokens: int, rank0: str, timeout_s: float) -> dict:
        """Wait for the formation's rank 0 and measure it (:func:`client_main`)."""
        path = os.path.join(self.tmp, f"prompts-{self.run_no}.json")
        with open(path, "w") as fh:
            json.dump(prompts, fh)
        try:
            out = self.in_ns([sys.executable, "-m", "benchmarks.bench_shape", "--client", self.cluster,
                              "--prompts-file", path, "--tokens", str(tokens), "--expect-rank0", rank0,
                              "--find-timeout", str(int(timeout_s * 0.6))], timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"client timed out after {timeout_s:.0f} s\n{self.logs()}") from None
        if out.returncode != 0:
            raise RuntimeError(f"client failed: {out.stderr.strip()[-800:]}\n{self.logs()}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def status(self) -> list:
        out = self.in_ns([sys.executable, "-m", "mlxcluster", "status", "--cluster", self.cluster, "--interface",
                          "eth0", "--json", "--timeout", "2"], timeout=60)
        return json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []


# --------------------------------------------------------------------------- the client (in a namespace)


def client_main(cluster: str, prompts_file: str, tokens: int, expect_rank0: str, find_timeout: float) -> int:
    """Find rank 0 (bounded), warm up, then one greedy generation per prompt; one JSON line."""
    from mlxcluster.cluster.client import find_rank0
    from mlxcluster.leader.generation import GenerationClient
    from mlxcluster.security import CLIENT, credentials

    with open(prompts_file) as fh:
        prompts = json.load(fh)
    creds = credentials(os.environ["MLXCLUSTER_SECRET"], cluster, [CLIENT])
    t0 = time.monotonic()
    if expect_rank0:  # this node's formation, ready (not another group's: a PD prefill group is one too)
        from mlxcluster.cluster.client import cluster_status

        while True:  # bounded: find_timeout
            nodes = cluster_status(cluster, ["eth0"], 2.0, creds)
            hit = next((n for n in nodes if n["node_id"] == expect_rank0 and n.get("rank") == 0
                        and n.get("state") == "ready" and n.get("rank0_address")), None)
            if hit is not None:
                address, rank0 = hit["rank0_address"], expect_rank0
                break
            if time.monotonic() - t0 > find_timeout:
                raise SystemExit(f"node {expect_rank0} is not a ready rank 0 after {find_timeout:.0f} s: "
                                 + "; ".join(f"{n['node_id']} {n.get('state')} rank {n.get('rank')}" for n in nodes))
            time.sleep(1.0)
    else:
        address, st = find_rank0(cluster, creds, ["eth0"], timeout_s=find_timeout)
        rank0 = st.node_id
    formed_s = time.monotonic() - t0
    client = GenerationClient(address, creds, timeout_s=300)
    try:
        info = client.info()
        client.generate(WARMUP_TEXT, max_tokens=4)  # warm-up: first-call costs, a different prompt (no prefix hit)
        runs = []
        for ids in prompts:
            r = client.generate(prompt_ids=ids, max_tokens=tokens)
            runs.append({"ttft_s": r.ttft_s, "decode_tok_s": r.decode_tokens_per_s, "token_ids": r.token_ids,
                         "cached": r.cached_prompt_tokens})
    finally:
        client.close()
    print(json.dumps({"rank0": rank0, "expected_rank0": expect_rank0, "world_size": info.world_size,
                      "backend": info.backend, "all_sum_us": info.all_sum_us, "formed_s": round(formed_s, 1),
                      "runs": runs}), flush=True)
    return 0


# --------------------------------------------------------------------------- candidates -> join options


def join_options(cand) -> Dict[str, List[str]]:
    """The ``join`` options of each node that form candidate ``cand`` (a shape planner ``Candidate``)."""
    if cand.kind == "single":
        return {cand.nodes[0]: ["--world-size", "1"]}
    if cand.kind == "tp":
        return {n: ["--world-size", str(len(cand.nodes))] for n in cand.nodes}
    if cand.kind == "pipeline":
        ranges = cand.topology.layers.split(",")  # rank order, as cand.nodes
        return {n: ["--layers", r] for n, r in zip(cand.nodes, ranges)}
    if cand.kind == "pd":
        prefill, decode = cand.nodes[0], cand.nodes[1:]
        opts = {prefill: ["--role", "prefill"]}
        opts.update({n: ["--role", "decode", "--world-size", str(len(decode))] for n in decode})
        return opts
    raise ValueError(f"cannot form a {cand.kind} candidate with join options: {cand.label}")


def rank0_of(cand) -> str:
    return cand.nodes[1] if cand.kind == "pd" else cand.nodes[0]


# --------------------------------------------------------------------------- one cluster


@dataclass
class Row:
    label: str
    kind: str
    fits: bool
    chosen: bool
    pred_tok_s: float = 0.0
    pred_ttft_s: float = 0.0
    meas_tok_s: float = 0.0
    meas_ttft_s: float = 0.0
    tokens_equal: Optional[bool] = None
    note: str = ""
    runs: list = field(default_factory=list)


def _summarise(got: dict) -> Tuple[float, float]:
    runs = got["runs"]
    return statistics.mean(r["decode_tok_s"] for r in runs), statistics.mean(r["ttft_s"] for r in runs)


def off(pred: float, meas: float) -> Optional[float]:
    return (pred - meas) / meas if pred > 0 and meas > 0 else None


def run_cluster(name: str, args, model: str, prompts: List[List[int]]) -> dict:
    from benchmarks.netns import bridged_hosts
    from mlxcluster.cluster.shape import (ModelProfile, Request, ShapeError, describe, measurements_from_json,
                                          plan_shape)
    from mlxcluster.model.loader import inspect_model

    desc, specs = CLUSTERS[name]
    result: dict = {"cluster": name, "setup": desc, "uptime_start": uptime(), "nodes": [s.__dict__ for s in specs]}
    print(f"\n=== cluster ({name}): {desc}\n    {result['uptime_start']}", flush=True)
    t_cluster = time.monotonic()
    tag = uuid.uuid4().hex[:4]
    with contextlib.ExitStack() as stack:
        tmp = args.logs
        os.makedirs(tmp, exist_ok=True)
        hosts = stack.enter_context(bridged_hosts(3))
        groups = stack.enter_context(cgroups(tag, specs))
        stack.enter_context(shaped_links(hosts, specs, tag))
        cl = Cluster(name, specs, hosts, groups, tmp, model)
        stack.callback(cl.stop)
        ids = [s.node_id for s in specs]

        # 1. join --plan auto: each node measures its compute in its own cgroup, then the shape forms
        cl.start({n: [] for n in ids})
        got = cl.client([prompts[0]], 4, "", args.form_timeout)
        st = next((n for n in cl.status() if n.get("rank") == 0 and n.get("plan")), None)
        result["auto"] = {"rank0": got["rank0"], "world_size": got["world_size"],
                          "plan": (st or {}).get("plan")}
        print(f"join --plan auto formed: world size {got['world_size']}, rank 0 {got['rank0']}"
              + (f", plan {st['plan']['label']}" if st and st.get("plan") else ""), flush=True)
        cl.stop()

        # 2. TP=3 (its ranks measure MPI's all_sum), then every node's measurements -> the ranking
        tp3_opts = {n: ["--world-size", "3"] for n in ids}
        cl.start(tp3_opts)
        tp3 = cl.client(prompts, args.tokens, ids[0], args.form_timeout)
        save = os.path.join(tmp, f"measurements-{name}.json")
        doc, plan_text = None, ""
        for _ in range(20):  # bounded: every node's compute, every link, the backend's all_sum, the TP layer
            out = cl.in_ns([sys.executable, "-m", "mlxcluster", "plan", "--cluster", cl.cluster, "--interface",
                            "eth0", "--save", save, "--prompt-tokens", str(args.prompt_tokens), "--top", "40"],
                           timeout=90)
            if out.returncode == 0 and os.path.exists(save):
                with open(save) as fh:
                    doc = json.load(fh)
                plan_text = out.stdout
                if len(doc["nodes"]) == 3 and len(doc["links"]) == 3 and doc.get("all_sum_us") and doc.get("tp_layers"):
                    break
            time.sleep(3)
        if doc is None:
            raise RuntimeError(f"plan --cluster gathered nothing: {out.stderr.strip()[-500:]}\n{cl.logs()}")
        cl.stop()
        result["measurements"] = doc
        result["plan_text"] = plan_text
        print(f"\nmlxcluster plan --cluster --save ({len(doc['nodes'])} nodes, {len(doc['links'])} links, "
              f"all_sum {doc.get('all_sum_us')}):\n{plan_text}", flush=True)

        info = inspect_model(model)
        profile = ModelProfile.from_config(info.config, name=info.name, quantization=info.quantization,
                                           weights="float32")
        try:
            ranked = plan_shape(measurements_from_json(doc), profile, Request(prompt_tokens=args.prompt_tokens))
        except ShapeError as exc:
            raise RuntimeError(f"planner: {exc}") from None
        result["ranking"] = describe(ranked, "decode")

        # 3. every candidate that fits, formed explicitly and measured
        rows: List[Row] = []
        reference: Optional[List[List[int]]] = None
        for cand in ranked:
            p = cand.prediction
            fits = p is not None and not cand.reason.startswith("does not fit")
            row = Row(cand.label, cand.kind, fits, cand.chosen, p.decode_tok_s if p else 0.0, p.ttft_s if p else 0.0)
            rows.append(row)
            if p is None:
                row.note = cand.reason
                continue
            if cand.kind == "tp" and set(cand.nodes) == set(ids):
                got = tp3
            elif not fits:
                row.note = cand.reason
                continue
            else:
                cl.start(join_options(cand))
                try:
                    got = cl.client(prompts, args.tokens, rank0_of(cand), args.form_timeout)
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                    row.note = f"failed: {str(exc).splitlines()[0][:200]}"
                    print(f"{cand.label}: {row.note}", flush=True)
                    cl.stop()
                    continue
                cl.stop()
            if got["rank0"] != rank0_of(cand):
                row.note = f"rank 0 is {got['rank0']}, expected {rank0_of(cand)}"
            row.meas_tok_s, row.meas_ttft_s = _summarise(got)
            row.runs = got["runs"]
            if not fits:
                row.note = ((row.note + "; " if row.note else "")
                            + f"refused by the planner ({cand.reason}), run anyway")
            toks = [r["token_ids"] for r in got["runs"]]
            if reference is None and cand.kind == "single":
                reference = toks
            row.tokens_equal = None if reference is None else toks == reference
            print(f"{cand.label}: predicted {row.pred_tok_s:.1f} tok/s, TTFT {row.pred_ttft_s:.2f} s; measured "
                  f"{row.meas_tok_s:.1f} tok/s, TTFT {row.meas_ttft_s:.2f} s (formed in {got['formed_s']} s)",
                  flush=True)
        # candidates measured before the first single node: compare now
        if reference is not None:
            for row in rows:
                if row.runs and row.tokens_equal is None:
                    row.tokens_equal = [r["token_ids"] for r in row.runs] == reference
        # 4. the chosen plan against the measured best, again, alternately (one pass's best of several
        # candidates of about the same speed is partly its luck): their mean decode tok/s over every pass
        result["confirm"] = confirm(cl, ranked, rows, args, prompts)
    result["rows"] = [r.__dict__ for r in rows]
    result["uptime_end"] = uptime()
    result["seconds"] = round(time.monotonic() - t_cluster, 1)
    return result


def confirm(cl: "Cluster", ranked, rows: List[Row], args, prompts: List[List[int]]) -> Optional[dict]:
    """Form the chosen plan and the measured best (when another) ``args.confirm`` more times each,
    alternately; ``{label: [decode tok/s of each pass]}`` with the first pass's figure first."""
    measured = [r for r in rows if r.runs and r.fits]
    chosen_row = next((r for r in rows if r.chosen and r.runs), None)
    if not measured or chosen_row is None or args.confirm <= 0:
        return None
    best_row = max(measured, key=lambda r: r.meas_tok_s)
    passes = {chosen_row.label: [chosen_row.meas_tok_s]}
    if best_row is chosen_row:
        return {"passes": passes}
    passes[best_row.label] = [best_row.meas_tok_s]
    by_label = {c.label: c for c in ranked}
    for _ in range(args.confirm):  # bounded
        for label in (chosen_row.label, best_row.label):
            cand = by_label[label]
            cl.start(join_options(cand))
            try:
                got = cl.client(prompts, args.tokens, rank0_of(cand), args.form_timeout)
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                print(f"confirming {label}: failed: {str(exc).splitlines()[0][:200]}", flush=True)
                continue
            finally:
                cl.stop()
            passes[label].append(_summarise(got)[0])
            print(f"confirming {label}: {passes[label][-1]:.1f} tok/s", flush=True)
    return {"passes": passes}


# --------------------------------------------------------------------------- report


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 100:+.0f}%"


def report(res: dict) -> List[str]:
    rows = [r for r in res["rows"]]
    lines = [f"cluster ({res['cluster']}): {res['setup']}",
             f"load: {res['uptime_start']} -> {res['uptime_end']}; {res['seconds']:.0f} s",
             f"join --plan auto formed: world size {res['auto']['world_size']}, rank 0 {res['auto']['rank0']}"
             + (f" ({res['auto']['plan']['label']})" if res['auto'].get('plan') else ""),
             "",
             "| candidate | pred tok/s | meas tok/s | off | pred TTFT s | meas TTFT s | off | tokens = TP=1 | note |",
             "|---|---:|---:|---:|---:|---:|---:|:-:|---|"]
    for r in rows:
        label = ("**" + r["label"] + "** (chosen)") if r["chosen"] else r["label"]
        meas = bool(r["runs"])
        lines.append(
            f"| {label} | {r['pred_tok_s']:.1f} | {r['meas_tok_s']:.1f} | "
            f"{_pct(off(r['pred_tok_s'], r['meas_tok_s'])) if meas else '-'} | {r['pred_ttft_s']:.2f} | "
            f"{r['meas_ttft_s']:.2f} | {_pct(off(r['pred_ttft_s'], r['meas_ttft_s'])) if meas else '-'} | "
            f"{'-' if r['tokens_equal'] is None else ('yes' if r['tokens_equal'] else 'NO')} | {r['note']} |"
            if meas else
            f"| {label} | {r['pred_tok_s']:.1f} | - | - | {r['pred_ttft_s']:.2f} | - | - | - | {r['note']} |")
    measured = [r for r in rows if r["runs"] and r["fits"]]
    chosen = next((r for r in rows if r["chosen"]), None)
    if measured and chosen and chosen["runs"]:
        best = max(measured, key=lambda r: r["meas_tok_s"])
        ratio = chosen["meas_tok_s"] / best["meas_tok_s"]
        lines.append("")
        lines.append(f"chosen {chosen['label']}: {chosen['meas_tok_s']:.1f} tok/s measured; measured best "
                     f"{best['label']}: {best['meas_tok_s']:.1f} tok/s -> {ratio * 100:.0f}% of the best "
                     f"({'met' if ratio >= 0.9 else 'MISSED'}: within 10%)")
    conf = (res.get("confirm") or {}).get("passes") or {}
    if len(conf) == 2:
        (c_label, c_pass), (b_label, b_pass) = conf.items()
        c_mean, b_mean = statistics.mean(c_pass), statistics.mean(b_pass)
        ratio = c_mean / b_mean
        lines.append(f"confirmed, {len(c_pass)} passes each, alternately: chosen {c_label} "
                     f"{' / '.join(f'{x:.1f}' for x in c_pass)} (mean {c_mean:.1f}) tok/s; {b_label} "
                     f"{' / '.join(f'{x:.1f}' for x in b_pass)} (mean {b_mean:.1f}) -> {ratio * 100:.0f}% "
                     f"({'met' if ratio >= 0.9 else 'MISSED'}: within 10%)")
    n_dec = [r for r in measured if off(r["pred_tok_s"], r["meas_tok_s"]) is not None]
    ok_dec = [r for r in n_dec if abs(off(r["pred_tok_s"], r["meas_tok_s"])) <= 0.30]
    ok_ttft = [r for r in n_dec if abs(off(r["pred_ttft_s"], r["meas_ttft_s"]) or 9) <= 0.30]
    eq = [r for r in measured if r["tokens_equal"]]
    lines.append(f"predictions within +-30%: decode {len(ok_dec)}/{len(n_dec)}, TTFT {len(ok_ttft)}/{len(n_dec)}; "
                 f"tokens equal to TP=1: {len(eq)}/{len(measured)}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clusters", default="a,b,c", help="which emulated clusters: a, b, c (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="one measured prompt of 16 tokens per candidate")
    ap.add_argument("--tokens", type=int, default=32, help="tokens generated per measured prompt")
    ap.add_argument("--prompts", type=int, default=2, help="measured prompts per candidate (1 or 2)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="length of each measured prompt, tokens (TTFT)")
    ap.add_argument("--confirm", type=int, default=2,
                    help="passes more of the chosen plan and the measured best, alternately (--quick: 1)")
    ap.add_argument("--form-timeout", type=float, default=300.0, help="seconds a formation and its client may take")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--out", default=None, help="also write every result as JSON to this file")
    ap.add_argument("--logs", default=None, help="keep the nodes' logs and measurements in this directory")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--expect-rank0", default="", help=argparse.SUPPRESS)
    ap.add_argument("--find-timeout", type=float, default=180.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        return client_main(args.client, args.prompts_file, args.tokens, args.expect_rank0, args.find_timeout)
    names = [c.strip() for c in args.clusters.split(",") if c.strip()]
    bad = [c for c in names if c not in CLUSTERS]
    if bad or not names:
        ap.error(f"--clusters: choose from {', '.join(CLUSTERS)}")
    if args.quick:
        args.tokens, args.prompts, args.confirm = min(args.tokens, 16), 1, min(args.confirm, 1)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # cleanup runs
    if os.geteuid() != 0:
        print("bench_shape: needs root (network namespaces, tc, cgroups)", file=sys.stderr)
        return 2
    from mlxcluster.model.loader import load_tokenizer, resolve_model_path

    model = resolve_model_path(args.model)
    tok, _ = load_tokenizer(model)
    prompts = []
    for text in PROMPT_TEXTS[:max(1, min(args.prompts, len(PROMPT_TEXTS)))]:
        ids = list(tok.encode(text * 20))[:args.prompt_tokens]
        prompts.append(ids)
    t0 = time.monotonic()
    results = []
    scratch = None
    if not args.logs:  # one directory for the whole run: each node's HOME (its measurement cache) is kept
        scratch = args.logs = tempfile.mkdtemp(prefix="bench-shape-")  # across the clusters, as a machine's
    try:
        for name in names:
            results.append(run_cluster(name, args, model, prompts))
    except Exception as exc:  # the benchmark's own failure: the clusters measured so far are still printed
        print(f"bench_shape: {type(exc).__name__}: {exc}", file=sys.stderr)
        status = 1
    else:
        status = 0
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        if args.out:
            with open(args.out, "w") as fh:
                json.dump({"results": results, "args": vars(args), "seconds": round(time.monotonic() - t0, 1)},
                          fh, indent=2)
    print(f"\n\nbench_shape: {len(results)} cluster(s) in {time.monotonic() - t0:.0f} s "
          f"(--tokens {args.tokens}, {len(prompts)} prompt(s) of {args.prompt_tokens} tokens)")
    for res in results:
        print("\n" + "\n".join(res["ranking"]))
        print("\n" + "\n".join(report(res)))
    return status


if __name__ == "__main__":
    sys.exit(main())
