"""What a node measures (issue 31: cluster/measure.py), as plain functions: the wire form, combining
the nodes' reports into the shape planner's Measurements, the link probe's arithmetic, the compute
cache, the measured decode rate and the off-by check.  No processes, no network."""

from __future__ import annotations

import json

import pytest

from mlxcluster.cluster import measure as ms
from mlxcluster.cluster.shape import LinkMeasure, TpLayerMeasure, measurements_from_json
from mlxcluster.protocol import mlxcluster_pb2 as pb

C = ms.Compute(layer_s=1.2e-3, layer_batch_s=5e-5, head_s=0.01, prefill_tokens_per_s=250.0)


def report(nid, links=(), compute=C, mem=8 * 10**9, sums=None, error="", tp=()):
    return ms.NodeReport(nid, mem, compute, "cpu", "host", "float32",
                         tuple(LinkMeasure(nid, peer, lat, bw, "lo") for peer, lat, bw in links), sums or {}, error,
                         tuple(TpLayerMeasure(b, tuple(nodes), *figures) for b, nodes, *figures in tp))


def test_a_report_survives_the_wire_and_bad_peer_figures_are_dropped():
    r = report("a", [("b", 4e-5, 2e9)], sums={"mpi": 76.0}, tp=[("mpi", "ab", 6.5e-3, 0.04, 128), ("ring", "ab", 1e-3)])
    back = ms.from_msg("a", pb.NodeMeasureMsg.FromString(ms.to_msg(r, {"b": 3.0}).SerializeToString()))
    assert back == r
    bad = pb.NodeMeasureMsg(memory_bytes=5, layer_s=float("nan"), prefill_tokens_per_s=100.0)
    bad.links.add(peer="b", latency_s=1e-4, bandwidth_bytes_per_s=-1.0)
    bad.links.add(peer="a", latency_s=1e-4, bandwidth_bytes_per_s=1e9)  # to itself
    bad.all_sum_us["ring"] = float("inf")
    bad.tp_layers.add(backend="mpi", nodes=["a", "b"], layer_us=float("nan"))
    bad.tp_layers.add(backend="mpi", nodes=["a"], layer_us=100.0)  # not a group
    got = ms.from_msg("a", bad)
    assert got.compute is None and got.links == () and got.all_sum_us == {} and got.tp_layers == ()


def test_combine_takes_each_link_from_either_end_the_slower_when_both_and_skips_unmeasured_nodes():
    reports = {"a": report("a", [("b", 4e-5, 2e9), ("c", 1e-4, 1e9)], sums={"mpi": 60.0},
                           tp=[("mpi", "abc", 6e-3)]),
               "b": report("b", [("a", 8e-5, 3e9)], sums={"mpi": 76.0, "ring": 4000.0},
                           tp=[("mpi", "abc", 7e-3), ("mpi", "ad", 1e-3)]),  # with d: left out
               "c": report("c", [("b", 5e-5, 5e8)]),
               "d": report("d", [("a", 1e-5, 1e10)], compute=None)}  # still measuring: left out
    m = ms.combine(reports)
    assert [n.node_id for n in m.nodes] == ["a", "b", "c"]
    ab = m.link("a", "b")
    assert (ab.latency_s, ab.bandwidth_bytes_per_s) == (8e-5, 2e9)
    assert m.link("b", "c").bandwidth_bytes_per_s == 5e8 and m.link("a", "d") is None
    assert m.all_sum_us == {"mpi": 76.0, "ring": 4000.0}
    assert m.tp_layers == (TpLayerMeasure("mpi", ("a", "b", "c"), 7e-3),)  # once, its slowest report
    assert [n.node_id for n in ms.combine(reports, only=("a", "c")).nodes] == ["a", "c"]
    # the JSON form is what plan --measurements reads
    assert measurements_from_json(json.loads(json.dumps(ms.measurements_json(m)))) == m


def test_the_link_probe_halves_the_shortest_round_trip_and_divides_the_fastest_bulk_by_its_time():
    clock = [0.0]
    sent = []

    def call(nbytes, timeout_s):
        sent.append((nbytes, timeout_s))
        clock[0] += 2e-4 + nbytes / 1e9  # 200 µs round trip, 1 GB/s

    lat, bw = ms.measure_link(call, clock=lambda: clock[0], pings=5, bulk_bytes=10**6)
    assert lat == pytest.approx(1e-4) and bw == pytest.approx(1e9)
    assert [n for n, _ in sent] == [0] * 6 + [10**6] * ms.BULKS and all(0 < t <= ms.LINK_DEADLINE_S for _, t in sent)

    # the daemons' threads waiting for the CPU delay some round trips (not the link's latency), and the
    # first bulk call runs in TCP's slow start (half the link's rate): the probe sees through both
    extra = iter([0.0, 5e-3, 3e-3, 0.0, 4e-3, 6e-3])  # warm-up, then the 5 pings
    bulks = iter([2.0, 1.0])

    def busy(nbytes, timeout_s):
        clock[0] += 2e-4 + (nbytes / 1e9 * next(bulks) if nbytes else next(extra))
    lat, bw = ms.measure_link(busy, clock=lambda: clock[0], pings=5, bulk_bytes=10**6)
    assert lat == pytest.approx(1e-4) and bw == pytest.approx(1e9)

    def stuck(nbytes, timeout_s):
        clock[0] += 1.0
    with pytest.raises(TimeoutError):
        ms.measure_link(stuck, clock=lambda: clock[0], deadline_s=1.5)


def test_the_compute_measurement_is_cached_by_digest_chip_and_format(tmp_path, monkeypatch):
    runs = []

    def child(path, weights, timeout_s, started):
        runs.append(weights)
        return C, ""
    monkeypatch.setattr(ms, "_run_child", child)
    assert ms.measure_compute("m", "float32", "d1", "chip", str(tmp_path)) == (C, "")
    assert ms.measure_compute("m", "float32", "d1", "chip", str(tmp_path)) == (C, "")  # cached
    assert runs == ["float32"]
    ms.measure_compute("m", "float16", "d1", "chip", str(tmp_path))
    ms.measure_compute("m", "float32", "d2", "chip", str(tmp_path))
    assert len(runs) == 3
    assert ms.cache_path(str(tmp_path), "d1", "chip", "float32") != ms.cache_path(str(tmp_path), "d1", "other", "float32")
    # a corrupt cache file is measured again, a failure is not cached
    open(ms.cache_path(str(tmp_path), "d1", "chip", "float32"), "w").write("{not json")
    monkeypatch.setattr(ms, "_run_child", lambda *a: (None, "boom"))
    assert ms.measure_compute("m", "float32", "d1", "chip", str(tmp_path)) == (None, "boom")


def test_the_decode_meter_counts_single_stream_intervals_only():
    meter = ms.DecodeMeter(min_tokens=16)
    meter.update(0.0, 0, 0)
    meter.update(1.0, 5, 1)      # idle -> running: a prefill inside, not counted
    meter.update(2.0, 15, 1)     # 10 tokens in 1 s
    assert meter.tok_s is None   # fewer than 16 tokens so far
    meter.update(3.0, 25, 1)     # 10 more
    meter.update(4.0, 60, 2)     # two sequences: not single-stream
    meter.update(5.0, 80, 1)
    assert meter.tok_s == pytest.approx(10.0)


def test_off_by_is_relative_to_the_measurement():
    assert ms.off_by(13.0, 10.0) == pytest.approx(0.3)
    assert ms.off_by(10.0, 0.0) == 0.0 and ms.off_by(0.0, 10.0) == 0.0
    assert ms.off_by(14.0, 10.0) > ms.OFF_BY > ms.off_by(12.0, 10.0)


def test_join_memory_sizes_and_the_cap_on_what_a_node_offers():
    """``join --memory``: decimal and binary units, case-insensitive; a cap on the advertised memory
    and on the memory the node plans its ranks with (an unknown 0 becomes the cap; no cap: unchanged)."""
    assert ms.parse_memory("800MB") == 800 * 10**6 and ms.parse_memory("1.5GiB") == 3 * 2**29
    assert ms.parse_memory("2g") == 2 * 10**9 and ms.parse_memory(" 2000000000 ") == 2 * 10**9
    for bad in ("", "lots", "8 parsecs", "-1GB", "512KB"):
        with pytest.raises(ValueError, match="--memory"):
            ms.parse_memory(bad)
    assert ms.cap_memory(64 * 2**30, 0) == 64 * 2**30 and ms.cap_memory(40 * 2**30, 0) == 40 * 2**30
    assert ms.cap_memory(64 * 2**30, 2**30) == 2**30 and ms.cap_memory(40 * 2**30, 2**30) == 2**30
    assert ms.cap_memory(0, 48 * 2**30) == 48 * 2**30 and ms.cap_memory(40 * 2**30, 48 * 2**30) == 40 * 2**30


class _Quota:
    """A fake clock and a piece of work under a CPU quota: ``cost_s`` of CPU per call, at most ``quota_s``
    of CPU per ``period_s`` (cgroup v1 CFS): beyond it the work waits for the next period."""

    def __init__(self, cost_s: float, quota_s: float, period_s: float):
        self.cost, self.quota, self.period = cost_s, quota_s, period_s
        self.now, self.used, self.index = 0.0, 0.0, 0

    def clock(self) -> float:
        return self.now

    def run(self) -> None:
        left = self.cost
        while left > 1e-12:
            if self.used >= self.quota - 1e-12:  # throttled until the next period
                self.index += 1
                self.now, self.used = self.index * self.period, 0.0
                continue
            end = (self.index + 1) * self.period
            step = min(left, self.quota - self.used, end - self.now)
            self.now += step
            self.used += step
            left -= step
            if self.now >= end - 1e-12:
                self.index, self.used = self.index + 1, 0.0


def test_the_compute_timing_is_sustained_so_a_cpu_quota_counts():
    # 1 ms of work per call on a node given half a core (5 ms per 10 ms period): a decode step runs at
    # 2 ms per call; one call alone fits in a period's quota and looks twice as fast
    from mlxcluster.cluster.measure import sustained_time

    q = _Quota(1e-3, 5e-3, 10e-3)
    assert abs(sustained_time(q.run, q.clock, repeats=3, sample_s=0.1) - 2e-3) < 0.1e-3
    q = _Quota(1e-3, 5e-3, 10e-3)
    assert abs(sustained_time(q.run, q.clock, repeats=3, sample_s=0.0) - 1e-3) < 0.05e-3  # a burst: not what runs
    # without a quota the sustained time is the call's
    q = _Quota(1e-3, 10e-3, 10e-3)
    assert abs(sustained_time(q.run, q.clock, repeats=3, sample_s=0.1) - 1e-3) < 0.05e-3


def test_the_all_sum_probe_is_a_sustained_mean_and_every_rank_stops_after_the_same_chunk():
    # an all_sum of 100 µs busy-polling on a node given 0.4 CPU (4 ms per 10 ms period): back to back it
    # runs at 250 µs a call; the old probe (median of 30 calls) fit in one period's quota and read 100 µs
    from mlxcluster.runtime.rank import sustained_collective_s

    q = _Quota(100e-6, 4e-3, 10e-3)
    votes = []

    def any_done(mine: bool) -> bool:  # two ranks: the peer's clock passes the mark one chunk earlier
        votes.append(mine)
        return mine or len(votes) >= 10

    mean = sustained_collective_s(q.run, any_done, seconds=0.3, chunk=8, clock=q.clock)
    assert len(votes) == 10  # stopped when the first rank said so, not at its own mark
    assert mean > 150e-6  # 80 calls span two periods: throttled, not the burst's 100 µs
    q = _Quota(100e-6, 4e-3, 10e-3)
    mean = sustained_collective_s(q.run, lambda mine: mine, seconds=0.3, chunk=8, clock=q.clock)
    assert abs(mean - 250e-6) < 10e-6  # over ~0.3 s: many quota periods
    q = _Quota(100e-6, 4e-3, 10e-3)
    assert sustained_collective_s(q.run, lambda mine: False, seconds=0.3, chunk=8, max_chunks=5, clock=q.clock) \
        == pytest.approx(100e-6)  # bounded: 5 chunks of 40 calls fit in one period's quota (the burst the old probe read)


def test_the_probe_window_follows_the_tightest_cpu_quota_on_the_cgroup_path(tmp_path):
    """The load-time probes run several quota periods under a CPU quota (their reason to be sustained)
    and a short window without one: cgroup v2's cpu.max and v1's cfs files, read from the process's
    group up to the root (a parent's quota binds a child without one)."""
    from mlxcluster.runtime.rank import PROBE_FREE_S, PROBE_S, cpu_quota, probe_window_s

    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    proc = tmp_path / "cgroup"
    # v2: the node's group limits, the rank's own group does not
    root2 = tmp_path / "v2"
    write(root2 / "node" / "cpu.max", "40000 100000\n")
    write(root2 / "node" / "rank" / "cpu.max", "max 100000\n")
    write(proc, "0::/node/rank\n")
    assert cpu_quota(str(proc), str(root2)) == (40000, 100000)
    # v1 (hybrid: a v2 line too), the controller mounted as cpu,cpuacct; the tightest of two levels
    root1 = tmp_path / "v1"
    for d, quota in (("", "-1"), ("shape", "8000"), ("shape/a", "4000")):
        write(root1 / "cpu,cpuacct" / d / "cpu.cfs_quota_us", quota + "\n")
        write(root1 / "cpu,cpuacct" / d / "cpu.cfs_period_us", "10000\n")
    write(proc, "3:cpu,cpuacct:/shape/a\n0::/\n")
    assert cpu_quota(str(proc), str(root1)) == (4000, 10000)
    assert probe_window_s(cpu_quota(str(proc), str(root1))) == PROBE_S
    # none: unlimited groups, no cgroup file at all (macOS)
    write(proc, "3:cpu,cpuacct:/\n")
    assert cpu_quota(str(proc), str(root1)) is None
    assert cpu_quota(str(tmp_path / "absent"), str(root1)) is None
    assert probe_window_s(None) == PROBE_FREE_S < PROBE_S
