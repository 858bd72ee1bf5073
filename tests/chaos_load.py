"""The chaos workload of issue 29 (lossless failover), shared by its tests and its benchmark.

:func:`run_chaos` drives a *target* -- something that serves the OpenAI API and has processes to
fault -- with 4 clients streaming greedy chat completions in a closed loop for ``duration_s``,
while every ``period_s`` seconds one victim gets SIGKILL, or SIGSTOP then SIGCONT ``stop_s``
later, alternating.  It records every request (text, finish reason, the arrival time of each
content chunk, the error if any), every fault, the answers without faults before and after, and
the time from each fault to the first token each request in flight at it received after it.  With
``n_faults`` and ``ready`` (e.g. :class:`Streaming`: the answers stream on the group now serving) the
faults come as soon as the target is ready for them instead of on the clock: the tests' short runs, one
fault of each kind.

Targets (duck-typed): ``url``; ``serving()`` -> bool; ``victims()`` -> ``{name: pids}`` of what may
be faulted now (``None`` while not serving); ``fault(name, pids, kind)`` (kind ``SIGKILL`` or
``SIGSTOP``) and, ``stop_s`` later, ``recover(name, pids, kind)`` (thaw a frozen victim; restart a
killed node, where the target is nodes that return); ``stop()``; ``log_tail()`` -> str.

* :class:`ChaosServe`: a real ``serve --world-size 3``; victims are its rank processes.
* :class:`ChaosCluster`: ``join`` nodes in network namespaces behind ``serve --cluster``; victims
  are the nodes holding a rank (daemon and rank together).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

import httpx
import openai

from harness import descendants, until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = ["Name three colours.", "What is the capital of France?", "Count from one to ten.",
           "Say something about the sea."]
MAX_TOKENS = 24


def rank_pids(parent_pid: int) -> Dict[int, int]:
    """``{rank: pid}`` of the rank processes below ``parent_pid`` (ring: ``MLX_RANK``; mpirun's:
    ``OMPI_COMM_WORLD_RANK``)."""
    ranks = {}
    for pid in descendants(parent_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        rank = env.get(b"MLX_RANK", env.get(b"OMPI_COMM_WORLD_RANK"))
        if b"mlxcluster.runtime.rank" in cmdline and rank is not None:
            ranks[int(rank)] = pid
    return ranks


def signal_pids(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # gone already (its group was torn down)
            pass


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class ServeProcess:
    """A ``mlxcluster serve`` process on 127.0.0.1 (its stderr kept), model name ``m``."""

    def __init__(self, args, env=None):
        self.port = free_port()
        env = dict(env or os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcluster", "serve", *args, "--port", str(self.port), "--model-name", "m",
             "--log-level", "warning"],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr: list = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def serving(self) -> bool:
        assert self.proc.poll() is None, "".join(self.stderr[-20:])
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self) -> str:
        return "".join(self.stderr[-40:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class ChaosServe(ServeProcess):
    """A real ``serve --world-size 3`` (the default backend) on the real model; victims: its ranks."""

    def __init__(self, model_path, world_size=3):
        env = dict(os.environ)
        env.pop("MLXCLUSTER_SECRET", None)
        super().__init__(["--world-size", str(world_size), "--model", model_path, "--weights", "float32"], env)
        self.world_size = world_size

    def victims(self) -> Optional[Dict[str, List[int]]]:
        r = rank_pids(self.proc.pid)
        return {f"rank {k}": [v] for k, v in r.items()} if len(r) == self.world_size else None

    def fault(self, name, pids, kind):
        signal_pids(pids, signal.SIGKILL if kind == "SIGKILL" else signal.SIGSTOP)

    def recover(self, name, pids, kind):
        if kind == "SIGSTOP":  # a killed rank is replaced by the healer's new group
            signal_pids(pids, signal.SIGCONT)


class ChaosCluster(ServeProcess):
    """``join`` nodes on ``hosts`` (network namespaces from :func:`benchmarks.netns.bridged_hosts`;
    the last ``spares`` of them ``--spare``; ``world_size`` ``None``: the largest valid size; ``backend``
    ``None``: auto; ``extra``: more ``join`` options), formed,
    and ``serve --cluster`` here on ``root_ip`` (:func:`benchmarks.netns.root_link`); victims: the
    nodes holding a rank of the formation (each node's daemon, rank, orted: the whole machine)."""

    def __init__(self, tmp_path, hosts, root_ip, world_size=3, spares=1, backend=None, extra=()):
        from test_cluster import SECRET, JoinNode, _env

        self.cluster = f"cf-{uuid.uuid4().hex[:8]}"
        self.root_ip, self.world_size = root_ip, world_size
        from mlxcluster.security import CLIENT, credentials

        self.creds = credentials(SECRET, self.cluster, [CLIENT])
        self.nodes = {}
        for i, (ns, ip) in enumerate(hosts):
            spare = i >= len(hosts) - spares
            self.nodes[f"host-{i}"] = JoinNode(tmp_path, self.cluster, f"host-{i}", ip, 50051, netns=ns,
                                               interface="eth0", world_size=world_size, backend=backend,
                                               extra=(["--spare"] if spare else []) + list(extra))
        try:
            # browsed from here over root_ip (as victims() does), not by a `status` process per poll
            until(self.members, 240, f"cluster {self.cluster} to form", interval_s=1.0)
            super().__init__(["--cluster", self.cluster, "--interface", root_ip],
                             env=_env({"MLXCLUSTER_SECRET": SECRET}))
        except BaseException:
            self.stop_nodes()
            raise

    def members(self):
        """``{node id: rank}`` of one whole ready formation (of ``world_size`` nodes when given), else
        ``None``."""
        from mlxcluster.cluster.client import ClusterLookupError, cluster_status

        try:
            status = cluster_status(self.cluster, [self.root_ip], timeout_s=2.0, creds=self.creds)
        except (ClusterLookupError, ValueError, OSError):
            return None
        ready = [n for n in status if n.get("state") == "ready" and n.get("formation_id")]
        if len({n["formation_id"] for n in ready}) != 1 or len(ready) != ready[0]["world_size"] or \
                (self.world_size and len(ready) != self.world_size):
            return None
        return {n["node_id"]: n["rank"] for n in ready}

    def victims(self):
        members = self.members()
        if not members:
            return None
        return {nid: [self.nodes[nid].proc.pid] + descendants(self.nodes[nid].proc.pid) for nid in members}

    def fault(self, name, pids, kind):
        signal_pids(pids, signal.SIGKILL if kind == "SIGKILL" else signal.SIGSTOP)
        if kind == "SIGKILL":
            self.nodes[name].proc.wait(10)

    def recover(self, name, pids, kind):
        if kind == "SIGKILL":
            self.nodes[name].start()  # the machine comes back: the same node id rejoins
        else:
            signal_pids(pids, signal.SIGCONT)

    def log_tail(self):
        nodes = "\n".join(f"--- {nid}\n{n.text()[-1500:]}" for nid, n in self.nodes.items())
        return super().log_tail() + "\n" + nodes

    def stop_nodes(self):
        for n in self.nodes.values():
            n.signal_all(signal.SIGCONT)
            n.stop()

    def stop(self):
        try:
            super().stop()
        finally:
            self.stop_nodes()


def ask(client, prompt):
    """One streamed greedy chat completion: (text, finish_reason, [arrival time of each content chunk])."""
    text, finish, times = "", None, []
    for c in client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}], stream=True,
                                            temperature=0, max_tokens=MAX_TOKENS):
        if c.choices:
            if c.choices[0].delta.content:
                text += c.choices[0].delta.content
                times.append(time.monotonic())
            finish = c.choices[0].finish_reason or finish
    return text, finish, times


def answers(url, prompts=PROMPTS):
    """``{prompt: (text, finish_reason)}``: each prompt's greedy answer, asked concurrently (one client per
    prompt; the group batches them as it batches the chaos clients)."""
    def one(prompt):
        return ask(openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600), prompt)[:2]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return dict(zip(prompts, pool.map(one, prompts)))


def _completion_tokens(url) -> float:
    """serve's ``mlxcluster_provider_completion_tokens_total`` (counted as the tokens are streamed)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mlxcluster_provider_completion_tokens_total"))


class Streaming:
    """``ready(n)`` for :func:`run_chaos`: the group that serves after ``n`` re-formations (``/health``'s
    ``group.restarts``) has streamed ``tokens`` more tokens since it was first seen serving -- the clients'
    answers are under way on it, so the n-th fault hits them mid-answer (not a group that has just come up,
    nor a pause between requests)."""

    def __init__(self, target, tokens: int = 8):
        self.target, self.tokens = target, tokens
        self.first: Dict[int, float] = {}  # n -> completion tokens when that group was first seen serving

    def __call__(self, n: int) -> bool:
        try:
            restarts = httpx.get(self.target.url + "/health", timeout=5).json()["group"]["restarts"]
            if restarts < n:
                return False
            count = _completion_tokens(self.target.url)
        except (httpx.HTTPError, KeyError, ValueError):
            return False
        return count >= self.first.setdefault(n, count) + self.tokens


def pct(values, q):
    """The ``q`` quantile (nearest rank) of ``values``; NaN for none."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def run_chaos(target, duration_s, period_s=30.0, stop_s=20.0, seed=29, log=print, before_fault=None,
              kinds=("SIGKILL", "SIGSTOP"), n_faults=None, ready=None):
    """The chaos run on ``target`` (stopped at the end): a dict with ``reference`` and ``after``
    (prompt -> (text, finish) without faults, before and after), ``results`` (prompt, t0, t1, text,
    finish, chunk times, error), ``faults`` (time, victim, kind), ``gaps`` (seconds from a fault to
    the next token of each request in flight at it), ``metrics`` (serve's /metrics text), ``state``
    (its dashboard state), ``t_start`` and ``log`` (serve's last lines).  ``before_fault(n)`` is
    called before the n-th fault (0 first), once the target serves (e.g. to start a request the
    fault must hit); ``kinds``: the faults, taken in turn.  ``n_faults``: that many faults, each
    ``period_s`` at the soonest after the previous one, whatever ``duration_s`` (the run lasts until
    the last victim recovered); ``ready(n)``: the n-th fault also waits for it to be true (polled
    while the target serves, victims recovering on the way; e.g. :class:`Streaming`)."""
    rng = random.Random(seed)
    try:
        until(target.serving, 300, "the target to serve")
        reference = answers(target.url)  # the answers without faults
        done = threading.Event()
        results, faults = [], []
        lock = threading.Lock()

        def worker(prompt):
            c = openai.OpenAI(base_url=target.url + "/v1", api_key="x", max_retries=0, timeout=600)
            while not done.is_set():
                t0 = time.monotonic()
                try:
                    text, finish, times = ask(c, prompt)
                    error = None
                except Exception as exc:  # recorded: the tests assert there is none
                    text, finish, times, error = "", None, [], f"{type(exc).__name__}: {exc}"
                with lock:
                    results.append((prompt, t0, time.monotonic(), text, finish, times, error))

        workers = [threading.Thread(target=worker, args=(p,), daemon=True) for p in PROMPTS]
        t_start = time.monotonic()
        for w in workers:
            w.start()
        kinds, pending = list(kinds), []  # (recovery time, name, pids, kind)

        def recover_due(now):
            for item in [x for x in pending if x[0] <= now]:
                pending.remove(item)
                target.recover(*item[1:])

        def sleep_until(t):
            """The workload's schedule (not a synchronisation): wait until ``t``, recovering each
            victim when its time comes on the way."""
            for _ in range(1000):  # one pass per recovery due before t, at most
                now = time.monotonic()
                recover_due(now)
                if now >= t:
                    return
                done.wait(min([t] + [x[0] for x in pending]) - now)

        def faultable(n):
            recover_due(time.monotonic())
            return target.serving() and (ready is None or ready(n)) and target.victims()

        n = 0
        while n_faults is None or n < n_faults:
            t_fault = t_start + (n + 1) * period_s
            if n_faults is None and t_fault >= t_start + duration_s:
                break
            sleep_until(t_fault)
            victims = until(lambda: faultable(n), 300, "a serving group to fault", interval_s=0.1)
            if before_fault is not None:
                before_fault(n)
            name = rng.choice(sorted(victims))
            kind = kinds[n % len(kinds)]
            t = time.monotonic()
            target.fault(name, victims[name], kind)
            pending.append((t + stop_s, name, victims[name], kind))
            faults.append((t, name, kind))
            log(f"chaos: {kind} {name} (pids {victims[name]}) at {t - t_start:.1f} s")
            n += 1
        sleep_until(max([t_start + duration_s] + [x[0] for x in pending]))
        done.set()
        for w in workers:
            w.join(600)
        assert not any(w.is_alive() for w in workers), "a client never finished its last request"
        until(target.serving, 300, "the target to serve after the last fault")
        after = answers(target.url)
        metrics = httpx.get(target.url + "/metrics", timeout=10).text
        state = httpx.get(target.url + "/dashboard/state", timeout=10).json()
        gaps = []
        for t_f, _name, _kind in faults:
            for _p, t0, t1, _text, _fin, times, _err in results:
                if t0 < t_f < t1:
                    later = [x for x in times if x > t_f]
                    if later:
                        gaps.append(later[0] - t_f)
        return {"reference": reference, "results": results, "faults": faults, "after": after, "gaps": gaps,
                "metrics": metrics, "state": state, "t_start": t_start, "log": target.log_tail()}
    finally:
        target.stop()


def check_chaos(out, label="chaos"):
    """Print the run's summary and assert it lost nothing: no failed request, every answer its
    fault-free one (before and after the faults)."""
    results, reference = out["results"], out["reference"]
    errors = [r for r in results if r[6] is not None]
    wrong = [(r[0], r[3], reference[r[0]][0]) for r in results if r[6] is None and r[3:5] != reference[r[0]]]
    gaps = out["gaps"]
    print(f"{label}: {len(results)} requests, {len(out['faults'])} faults, {len(errors)} failed, {len(wrong)} wrong; "
          f"fault -> first replayed token p50 {pct(gaps, 0.5):.2f} s p95 {pct(gaps, 0.95):.2f} s over {len(gaps)} "
          f"requests in flight; failover {out['state'].get('failover')}")
    t_start = out["t_start"]
    when = lambda t: f"{t - t_start:.1f} s"  # noqa: E731
    if errors or wrong:  # the whole story, untruncated
        print("faults:", [(when(t), name, kind) for t, name, kind in out["faults"]])
        for r in results:
            print("request:", r[0], when(r[1]), when(r[2]), repr(r[3]), r[4], len(r[5]), r[6])
        print("serve's log:\n" + out["log"])
    assert not errors, ([(r[0], when(r[1]), when(r[2]), r[6]) for r in errors[:3]],
                        [(when(t), name, kind) for t, name, kind in out["faults"]], out["log"])
    assert not wrong, wrong[:3]
    assert out["after"] == reference  # serving normally after the last fault
    assert len(results) >= 4 and out["faults"]
