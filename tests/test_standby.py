"""Standby ranks and lean rank starts (issue 29: re-formation time).

A standby (``rank --standby``, :class:`mlxcluster.runtime.standby.Standby`) warms up, then becomes
the rank of the bootstrap line it is handed: the rank it becomes answers exactly what a fresh
rank answers.  A malformed line is one error line and exit 2; end of input is a quiet exit 0; a
standby that exited cannot be adopted.  Ranks >= 1 start without ``transformers``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from conftest import TEST_SECRET
from harness import STANDARD, answers, token_ids
from mlxcluster.runtime.launcher import free_ports
from mlxcluster.runtime.rank_config import RankConfig

pytestmark = pytest.mark.slow  # each check starts a rank process

ENV = {"MLXCLUSTER_SECRET": TEST_SECRET, "MLXCLUSTER_CLUSTER": "local"}


@pytest.fixture
def standby(real_model_path):
    from mlxcluster.runtime.standby import Standby

    made = Standby(real_model_path, ENV)
    yield made
    made.stop()


def test_an_adopted_standby_serves_what_a_fresh_rank_serves(standby, real_model_path, tls, tp1_reference):
    assert standby.ready.wait(120), standby.process.stderr_tail
    warm = next(e for e in standby.process.events if e["event"] == "standby")
    assert warm["preloaded"] is True  # the model was read ahead (it fits a quarter of the memory)
    port = free_ports(1)[0]
    events, ready = [], threading.Event()

    def on_event(event):
        events.append(event)
        if event["event"] in ("ready", "error"):
            ready.set()

    config = RankConfig(ports=(port,), model=real_model_path)
    supervisor = standby.adopt(config, {}, "rank 0", on_event, lambda proc: ready.set())
    assert standby.adopted and not standby.alive()
    assert ready.wait(120)
    assert [e["event"] for e in events][-1] == "ready", (events, standby.process.stderr_tail)
    assert supervisor.processes[0].pid == warm["pid"]  # the standby itself became the rank
    assert token_ids(answers(f"127.0.0.1:{port}", tls, STANDARD)) == tp1_reference.tokens(STANDARD)
    with pytest.raises(OSError, match="gone"):  # adopted once
        standby.adopt(config, {}, "rank 0", None, None)


def test_a_bad_bootstrap_line_is_one_error_and_end_of_input_a_quiet_exit(real_model_path):
    from mlxcluster.runtime.standby import Standby

    bad = Standby(real_model_path, ENV)
    quiet = Standby(real_model_path, ENV)
    try:
        for s in (bad, quiet):
            assert s.ready.wait(120), s.process.stderr_tail
        bad.process.send(json.dumps({"config": "--world-size 1"}))  # not an object
        quiet.process.popen.stdin.close()  # the node stopped it
        for s in (bad, quiet):
            assert s.exited.wait(60)
        assert bad.process.returncode == 2
        errors = [e["message"] for e in bad.process.events if e["event"] == "error"]
        assert errors == ['standby: the bootstrap line is not {"config": {...}, "env": {str: str}}']
        assert quiet.process.returncode == 0 and not any(e["event"] == "error" for e in quiet.process.events)
        with pytest.raises(OSError, match="gone"):
            quiet.adopt(RankConfig(ports=(1,)), {}, "rank 0", None, None)
    finally:
        bad.stop()
        quiet.stop()


def test_ranks_above_zero_start_without_transformers(real_model_path):
    """What a rank >= 1 imports and reads before it serves leaves ``transformers`` (mlx-lm's package
    ``__init__`` and the tokenizer pull it in) unimported: ``mlxcluster/__init__.py`` defers mlx-lm's
    ``__init__`` to the first name asked of the package, which then runs it as usual."""
    code = f"""
import sys
from mlxcluster.runtime import rank
import mlx.core as mx
from mlxcluster.model.loader import read_model
from mlxcluster.model.tp import build_model
import mlxcluster.control.follower
source = read_model({real_model_path!r}, tokenizer=False)
model = build_model(source.config, source.weights, source.quantization, "float32", None, consume_weights=True)
assert source.tokenizer is None
print("transformers" in sys.modules, "mlx_lm.utils" in sys.modules)
import mlx_lm
from mlx_lm import load
assert callable(load) and mlx_lm.__version__ and "transformers" in sys.modules
"""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"], out.stdout
