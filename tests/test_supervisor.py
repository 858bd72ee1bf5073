"""The rank-process supervisor (mlxcluster.runtime.supervisor) with tiny Python
children instead of ranks: the progress-event protocol, waiting for ``ready``,
one-line failures, timeouts, and stopping a whole process group."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from mlxcluster.config import Config
from mlxcluster.runtime.supervisor import (
    PACKAGE_ROOT, LaunchError, Supervisor, emit, parse_event, rank_command, rank_env)
from mlxcluster.runtime.rank_config import RankConfig

BLOCK = "import threading; threading.Event().wait()\n"  # a child that runs until it is stopped


def child(code: str):
    return [sys.executable, "-c", textwrap.dedent(code)]


def event(kind: str, **fields) -> str:
    import json

    return "print('@@mlxcluster ' + %r, flush=True)\n" % json.dumps(dict(fields, event=kind))


@pytest.fixture
def sup():
    s = Supervisor()
    yield s
    s.stop(timeout_s=1.0)


def test_parse_event_reads_only_protocol_lines():
    assert parse_event('@@mlxcluster {"event": "ready", "rank": 2}\n') == {"event": "ready", "rank": 2}
    assert parse_event('noise before @@mlxcluster {"event": "loading"}') == {"event": "loading"}
    for line in ("plain output", '@@mlxcluster {"event": ', "@@mlxcluster [1, 2]",
                 '@@mlxcluster {"rank": 0}', '@@bench {"event": "ready"}'):
        assert parse_event(line) is None, line


def test_emit_writes_a_line_parse_event_reads(capsys):
    emit("loaded", rank=1, seconds=0.5)
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1
    ev = parse_event(out)
    assert ev["event"] == "loaded" and ev["rank"] == 1 and ev["seconds"] == 0.5 and ev["t"] > 0


def test_ready_events_of_several_ranks():
    seen = []
    sup = Supervisor(on_event=seen.append)
    try:
        # one process carrying three ranks (as mpirun does) and one ring-style rank process
        sup.spawn(child(event("loading", rank=0) + "".join(event("ready", rank=r) for r in range(3)) + BLOCK),
                  rank_env(1), "mpirun")
        sup.spawn(child(event("ready", rank=3) + BLOCK), rank_env(1), "rank 3")
        sup.wait_ready(4, timeout_s=60)
        assert sup.states == {0: "ready", 1: "ready", 2: "ready", 3: "ready"}
        assert sup.failure is None
        assert sorted(e["rank"] for e in seen if e["event"] == "ready") == [0, 1, 2, 3]
        assert [e["event"] for e in sup.events][:2] == ["loading", "ready"]
    finally:
        sup.stop(timeout_s=1.0)
    assert sup.failure is None  # exits caused by stop() are not failures


def test_error_event_is_the_one_line_failure(sup):
    sup.spawn(child(event("loading", rank=1) + event("error", rank=1, message="cannot load shard") +
                    "raise SystemExit(1)\n"), rank_env(1), "rank 1")
    with pytest.raises(LaunchError) as info:
        sup.wait_ready(1, timeout_s=60)
    assert str(info.value) == "rank 1: cannot load shard"


def test_nonzero_exit_names_the_process_and_its_last_stderr_line():
    exits = []
    sup = Supervisor(on_exit=exits.append)
    sup.spawn(child("import sys\nsys.stderr.write('warming up\\nfatal: out of memory\\n')\nraise SystemExit(3)\n"),
              rank_env(1), "rank 2")
    with pytest.raises(LaunchError) as info:
        sup.wait_ready(1, timeout_s=60)
    assert str(info.value) == "rank 2 exited with code 3: fatal: out of memory"
    assert [p.returncode for p in exits] == [3]


def test_exit_after_ready_is_a_failure(sup):
    proc = sup.spawn(child(event("ready", rank=0) + BLOCK), rank_env(1), "rank 0")
    sup.wait_ready(1, timeout_s=60)
    assert sup.failure is None
    proc.popen.kill()  # not through stop(): an unexpected death
    assert sup.wait_for(lambda: proc.returncode is not None, 30)
    assert sup.failure == "rank 0 exited with code -9"


def test_never_ready_times_out_with_the_states(sup):
    proc = sup.spawn(child(event("loading", rank=0) + BLOCK), rank_env(1), "rank 0")
    with pytest.raises(LaunchError) as info:
        sup.wait_ready(2, timeout_s=0.3)
    # (the message gives whole seconds)
    assert str(info.value) == "ranks did not become ready within 0 s (states: rank 0: loading, rank 1: starting)"
    assert proc.returncode is not None  # the group was stopped before raising


def test_stop_kills_the_process_group(sup):
    # The child starts a grandchild (same process group, holding the stdout pipe) and
    # ignores SIGTERM, so stop() must escalate to SIGKILL for the whole group.
    code = (
        "import signal, subprocess, sys\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import threading; threading.Event().wait()'])\n"
        "print('@@mlxcluster {\"event\": \"ready\", \"rank\": 0, \"grandchild\": %d}' % g.pid, flush=True)\n"
        + BLOCK)
    proc = sup.spawn(child(code), rank_env(1), "rank 0")
    sup.wait_ready(1, timeout_s=60)
    grandchild = sup.events[0]["grandchild"]
    # own process group, in this session (one scheduler autogroup)
    assert os.getpgid(proc.pid) == proc.pid == os.getpgid(grandchild)
    assert os.getsid(proc.pid) == os.getsid(0)
    sup.stop(timeout_s=0.2)
    assert proc.returncode == -9  # SIGTERM ignored, then SIGKILL
    # its stdout reached end of file, so the grandchild (which shared it) is gone too
    try:
        with open(f"/proc/{grandchild}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X"), state


def test_stop_kills_a_frozen_descendant_in_another_process_group(sup):
    """mpirun puts each rank in a process group of its own: a rank frozen with SIGSTOP (the chaos
    test's fault) is not reached by signalling the supervised process's group, and was left behind
    stopped when mpirun exited.  stop() also ends every descendant."""
    import signal

    code = (
        "import subprocess, sys\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import threading; threading.Event().wait()'],\n"
        "                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print('@@mlxcluster {\"event\": \"ready\", \"rank\": 0, \"grandchild\": %d}' % g.pid, flush=True)\n"
        + BLOCK)
    proc = sup.spawn(child(code), rank_env(1), "mpirun")
    sup.wait_ready(1, timeout_s=60)
    grandchild = sup.events[0]["grandchild"]
    assert os.getpgid(grandchild) != os.getpgid(proc.pid)
    os.kill(grandchild, signal.SIGSTOP)
    sup.stop(timeout_s=0.5)
    assert proc.returncode is not None
    try:
        with open(f"/proc/{grandchild}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z", "X"), state


def test_wait_exit(sup):
    sup.spawn(child(event("result", rank=0, value=1)), rank_env(2), "rank 0")
    sup.spawn(child(event("result", rank=1, value=2)), rank_env(2), "rank 1")
    assert sup.wait_exit(60) is None
    assert sorted(e["value"] for e in sup.events) == [1, 2]

    failing = Supervisor()
    stuck = failing.spawn(child(BLOCK), rank_env(2), "rank 0")  # e.g. waiting in a collective
    failing.spawn(child(event("error", rank=1, message="boom") + "raise SystemExit(1)\n"), rank_env(2), "rank 1")
    assert failing.wait_exit(60, grace_s=0.05) == "rank 1: boom"
    assert stuck.returncode is not None  # stopped once the grace passed

    slow = Supervisor()
    slow.spawn(child(BLOCK), rank_env(1), "worker")
    assert slow.wait_exit(0.3) == "timed out after 0 s"  # (whole seconds)
    assert slow.processes[0].returncode is not None


def test_wait_for_wakes_on_an_event(sup):
    sup.spawn(child(event("port", port=1234) + BLOCK), rank_env(1), "echo")
    assert sup.wait_for(lambda: any(e["event"] == "port" for e in sup.processes[0].events), 60)
    assert not sup.wait_for(lambda: False, 0.05)


def test_rank_env_and_command(monkeypatch):
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    env = rank_env(3, extra={"MLX_RANK": "2", "PYTHONUNBUFFERED": "0"})
    assert env["PYTHONPATH"].split(os.pathsep)[0] == PACKAGE_ROOT
    assert env["PYTHONPATH"].split(os.pathsep).count(PACKAGE_ROOT) == 1
    assert env["MLX_RANK"] == "2" and env["PYTHONUNBUFFERED"] == "0"  # extra wins
    assert int(env["OPENBLAS_NUM_THREADS"]) >= 1
    assert rank_env(1)["PYTHONUNBUFFERED"] == "1"
    cmd = rank_command(RankConfig(ports=(5000,), model="/m.gguf", max_queue=7))
    assert cmd[:4] == [sys.executable, "-m", "mlxcluster.runtime.rank", "--config"]
    sent = RankConfig.from_json(cmd[4])
    assert sent.backend == "any"  # world size 1 needs no backend
    assert (sent.max_queue, sent.model) == (7, "/m.gguf")
    hosts = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    sent = RankConfig.from_json(rank_command(RankConfig(3, (1, 2, 3), hosts, backend="mpi"))[4])
    assert (sent.backend, sent.ports, sent.hosts) == ("mpi", (1, 2, 3), hosts)


def test_config_from_env():
    cfg = Config.from_env({"MLXCLUSTER_SECRET": "s", "MLXCLUSTER_LOG": "debug", "MLXCLUSTER_MAX_BATCH": "4",
                           "MLXCLUSTER_MAX_QUEUE": "0", "MLXCLUSTER_WEIGHTS": "float16"})
    assert cfg == Config(secret="s", log_level="DEBUG", weights="float16", max_batch=4, max_queue=0)
    assert Config.from_env({}) == Config()
    with pytest.raises(ValueError, match=r"^MLXCLUSTER_MAX_BATCH='eight': not an integer; allowed: an integer, at "
                                         r"least 1$"):
        Config.from_env({"MLXCLUSTER_MAX_BATCH": "eight"})
    with pytest.raises(ValueError, match="MLXCLUSTER_MAX_QUEUE='-1': below 0; allowed: an integer, at least 0"):
        Config.from_env({"MLXCLUSTER_MAX_QUEUE": "-1"})
    with pytest.raises(ValueError, match="MLXCLUSTER_LOG='chatty': one of DEBUG, INFO"):
        Config.from_env({"MLXCLUSTER_LOG": "chatty"})
    with pytest.raises(ValueError, match="MLXCLUSTER_WEIGHTS='int3': one of quantized, float32"):
        Config.from_env({"MLXCLUSTER_WEIGHTS": "int3"})
    with pytest.raises(ValueError, match="MLXCLUSTER_PROMPT_CACHE_SIZE='lots': a size such as 4GiB"):
        Config.from_env({"MLXCLUSTER_PROMPT_CACHE_SIZE": "lots"})
    assert Config.from_env({"MLXCLUSTER_CA_SEED": "ab" * 32, "MLXCLUSTER_BLAS": "/opt/libblas.so",
                            "MLXCLUSTER_PROMPT_CACHE_SIZE": "1GiB"}).ca_seed == "ab" * 32


def test_rank_with_a_bad_setting_reports_one_error_event(sup):
    cmd = rank_command(RankConfig(ports=(1,)))
    sup.spawn(cmd, rank_env(1, extra={"MLXCLUSTER_MAX_BATCH": "x"}), "rank 0")
    assert sup.wait_exit(120) == "rank 0: MLXCLUSTER_MAX_BATCH='x': not an integer; allowed: an integer, at least 1"
    assert sup.processes[0].returncode == 2


def test_on_event_errors_do_not_stop_the_reader():
    calls = []

    def bad(ev):
        calls.append(ev)
        raise RuntimeError("display bug")

    s = Supervisor(on_event=bad)
    try:
        s.spawn(child(event("loading", rank=0) + event("ready", rank=0) + BLOCK), rank_env(1), "rank 0")
        s.wait_ready(1, timeout_s=60)
        assert len(calls) == 2
    finally:
        s.stop(timeout_s=1.0)
    assert s.processes[0].join(0)  # its reader threads ended with it


def test_local_processes_ring_and_mpi(tmp_path, monkeypatch):
    import json

    from mlxcluster.runtime import launcher

    cmd = ["python", "-m", "mlxcluster.runtime.rank"]
    (one,) = launcher.local_processes(1, "mpi", cmd, {"A": "1"}, str(tmp_path))
    assert one == ("rank 0", cmd, {"A": "1"})  # world size 1: no backend, no mpirun

    ring = launcher.local_processes(3, "ring", cmd, {"A": "1"}, str(tmp_path))
    assert [name for name, _, _ in ring] == ["rank 0", "rank 1", "rank 2"]
    assert [env["MLX_RANK"] for _, _, env in ring] == ["0", "1", "2"]
    hostfile = ring[0][2]["MLX_HOSTFILE"]
    with open(hostfile) as f:
        entries = json.load(f)
    assert len(entries) == 3 and all(e[0].startswith("127.0.0.1:") for e in entries)
    assert all(argv == cmd and env["A"] == "1" and env["MLX_HOSTFILE"] == hostfile for _, argv, env in ring)

    monkeypatch.setattr(launcher, "mpirun_path", lambda: "/usr/bin/mpirun")
    env = {"PYTHONPATH": "/x", "MLXCLUSTER_SECRET": "s", "UNRELATED": "1"}
    ((name, argv, menv),) = launcher.local_processes(3, "mpi", cmd, env, str(tmp_path))
    assert name == "mpirun" and argv[0] == "/usr/bin/mpirun" and argv[-len(cmd):] == cmd
    assert argv[argv.index("-np") + 1] == "3" and "--oversubscribe" in argv
    exported = [argv[i + 1] for i, a in enumerate(argv) if a == "-x"]
    assert "PYTHONPATH" in exported and "MLXCLUSTER_SECRET" in exported and "UNRELATED" not in exported
    assert menv["OMPI_MCA_mpi_yield_when_idle"] == "1"
    with open(argv[argv.index("--hostfile") + 1]) as f:
        assert f.read().split() == ["127.0.0.1", "slots=3"]

    monkeypatch.setattr(launcher, "mpirun_path", lambda: None)
    with pytest.raises(LaunchError, match="needs OpenMPI's mpirun"):
        launcher.local_processes(3, "mpi", cmd, env, str(tmp_path))
    with pytest.raises(LaunchError, match="unknown backend"):
        launcher.local_processes(3, "pigeon", cmd, env, str(tmp_path))


def test_a_killed_process_left_a_zombie_counts_as_exited():
    """Supervisor.stop waits for mpirun's ranks to exit; one killed but not yet reaped (a zombie:
    an orphan waits for PID 1, which in a container may reap it seconds later) has released all
    it held and counts as exited -- else every teardown waited for the reaping (1.5 s here)."""
    import psutil

    from mlxcluster.runtime.supervisor import exited, wait_exited

    child = subprocess.Popen(["sleep", "30"])
    try:
        proc = psutil.Process(child.pid)
        assert not exited(proc) and wait_exited([proc], 0.0) == [proc]
        proc.kill()
        assert wait_exited([proc], 10.0) == []  # a zombie until we reap it below
        assert proc.status() == psutil.STATUS_ZOMBIE and exited(proc)
    finally:
        child.kill()
        child.wait()
    assert exited(proc)  # gone


def test_wait_exited_is_woken_by_the_exits_without_polling(monkeypatch):
    """wait_exited blocks on the processes' pidfds (Linux): woken by each exit, no sleep loop of our
    own; a process killed meanwhile, one gone before the call and one that stays running are told
    apart, within the timeout."""
    import psutil

    from mlxcluster.runtime import supervisor

    def no_sleep(_s):
        raise AssertionError("wait_exited polled (time.sleep)")

    monkeypatch.setattr(supervisor.time, "sleep", no_sleep)
    children = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        procs = [psutil.Process(c.pid) for c in children]
        children[0].kill()
        children[0].wait()  # gone (reaped) before the call
        killer = threading.Timer(0.05, children[1].kill)  # exits while wait_exited waits (or before: the same)
        killer.start()
        assert supervisor.wait_exited(procs, 0.0) in ([procs[1], procs[2]], [procs[2]])
        assert supervisor.wait_exited(procs[:2], 10.0) == []  # children[1]: woken by its exit
        killer.join()
        assert supervisor.wait_exited(procs, 0.05) == [procs[2]]  # still running at the timeout
    finally:
        for c in children:
            c.kill()
            c.wait()


def test_wait_parent_exit_returns_when_the_parent_dies():
    """A rank exits with the process that started it (rank._exit_with_parent): a grandchild blocked in
    wait_parent_exit returns once its parent exits.  The parent starts it, reads its "waiting" line
    (so the wait has begun), prints its pid and exits; the grandchild then writes to the stderr it
    shares with us and ends.  A wait that never returns is ended by the grandchild's own alarm."""
    grandchild = ("import os, signal, sys; signal.alarm(60); from mlxcluster.runtime.supervisor import "
                  "wait_parent_exit; ppid = os.getppid(); print('waiting', flush=True); wait_parent_exit(); "
                  "sys.stderr.write('parent gone' if os.getppid() != ppid else 'returned while the parent ran')")
    code = (f"import subprocess, sys; g = subprocess.Popen([sys.executable, '-c', {grandchild!r}], "
            "stdout=subprocess.PIPE, text=True); assert g.stdout.readline() == 'waiting\\n'; print(g.pid)")
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
    out, err = parent.communicate(timeout=90)  # the grandchild ends itself after 60 s (SIGALRM)
    assert parent.returncode == 0 and out.strip().isdigit(), (out, err)
    assert err == "parent gone", err


def test_free_ports_are_outside_the_ephemeral_range_distinct_and_free():
    """free_ports picks below the OS's ephemeral range, where no outgoing connection (nor a
    bind(0)) takes a port between the pick and the rank's bind."""
    import socket

    from mlxcluster.runtime.launcher import LOW_PORT, ephemeral_range, free_ports

    low, _high = ephemeral_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(LOW_PORT <= p < low for p in ports), (ports, low)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    with pytest.raises(OSError):
        free_ports(1, "192.0.2.1")  # not a local address: refused, not bound to 0 elsewhere
