"""The failpoint mechanism in process (fast tier): ``MLXCLUSTER_FAILPOINTS``'s syntax, unknown
names and actions refused in one line at start-up, off by default, in-process set / scoped / remove,
every failpoint site in the package named in the registry (and every registered one used), and the
docstring naming every failpoint and action."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest

from mlxcluster import failpoints as fp
from mlxcluster.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean():
    before = fp.active()
    fp.teardown()
    yield
    fp.teardown()
    fp.setup(before)


def test_every_failpoint_is_off_by_default():
    assert fp.active() == {}
    assert all(fp.fail_point(name) is None for name in fp.FAILPOINTS)
    assert fp.fail_point("no.such.failpoint") is None


def test_the_syntax_is_fail_rs_entries_separated_by_semicolons():
    assert fp.parse("") == {} and fp.parse(" ; ") == {}
    assert fp.parse("handoff.send=hash") == {"handoff.send": "hash"}
    assert fp.parse(" handoff.send = exit ; pd.send=early_last ;") == {"handoff.send": "exit", "pd.send": "early_last"}
    assert fp.parse("pd.send=dup;pd.send=permute") == {"pd.send": "permute"}  # the later entry wins
    assert fp.parse("pd.send=off") == {"pd.send": "off"}


@pytest.mark.parametrize("spec, words", [
    ("handoff.sent=hash", "unknown failpoint 'handoff.sent' in 'handoff.sent=hash'; known failpoints: decode.token, "
                          "handoff.send, pd.send, control.send"),
    ("handoff.send=dup", "handoff.send has no action 'dup'; choose one of hash, range, epoch, weights, exit or off"),
    ("pd.send=range", "pd.send has no action 'range'"),
    ("handoff.send", "'handoff.send' is not name=action"),
    ("=hash", "is not name=action"),
    ("pd.send=", "is not name=action"),
    ("pd.send=dup(2)", "the action dup of pd.send takes no argument"),
    ("control.send=delay", "'control.send=delay': the action delay of control.send needs an argument: delay(ARG)"),
    ("control.send=delay()", "'control.send=delay()': delay takes a number of milliseconds from 0 to 10000, not ''"),
    ("control.send=delay(-1)", "delay takes a number of milliseconds from 0 to 10000, not '-1'"),
    ("control.send=delay(10001)", "not '10001'"),
    ("control.send=delay(nan)", "not 'nan'"),
    ("control.send=delay(3ms)", "not '3ms'"),
    ("control.send=delay(3", "an argument is written delay(ARG)"),
    ("control.send=sleep(3)", "control.send has no action 'sleep'; choose one of delay or off"),
    ("pd.send=dup;bogus=exit", "unknown failpoint 'bogus' in 'bogus=exit'"),
])
def test_a_bad_entry_is_one_line_naming_it(spec, words):
    with pytest.raises(ValueError) as err:
        fp.parse(spec)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_environment_is_read_with_the_configuration_and_checked_at_start_up():
    assert Config.from_env({}).failpoints == ()
    cfg = Config.from_env({"MLXCLUSTER_FAILPOINTS": "handoff.send=range;pd.send=dup"})
    assert cfg.failpoints == (("handoff.send", "range"), ("pd.send", "dup"))
    assert fp.active() == {}  # reading the configuration sets nothing: a rank's start-up does (setup)
    with pytest.raises(ValueError) as err:
        Config.from_env({"MLXCLUSTER_FAILPOINTS": "handoff.send=hash;handof.send=hash"})
    message = str(err.value)
    assert message.startswith("MLXCLUSTER_FAILPOINTS: unknown failpoint 'handof.send'") and "\n" not in message
    assert "handoff.send, pd.send, control.send" in message


def test_a_rank_process_with_an_unknown_failpoint_stops_at_start_up_with_one_line():
    env = dict(os.environ, MLXCLUSTER_FAILPOINTS="handoff.sent=hash")
    out = subprocess.run([sys.executable, "-m", "mlxcluster.runtime.rank", "--world-size", "1", "--ports", "1"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "MLXCLUSTER_FAILPOINTS: unknown failpoint 'handoff.sent' in 'handoff.sent=hash'; known failpoints: " \
           "decode.token, handoff.send, pd.send, control.send" in out.stdout, out.stdout


def test_an_action_with_an_argument_is_fail_rs_name_action_arg():
    got = fp.parse("control.send=delay(3);pd.send=dup")
    assert got == {"control.send": "delay(3)", "pd.send": "dup"}
    assert (got["control.send"].name, got["control.send"].arg) == ("delay", 3.0)
    assert (got["pd.send"].name, got["pd.send"].arg) == ("dup", None)
    assert fp.parse(" control.send = delay( 2.5 ) ")["control.send"].arg == 2.5
    assert fp.parse("control.send=delay(0)")["control.send"].arg == 0.0
    assert fp.parse("control.send=delay(10000)")["control.send"].arg == 10000.0
    assert fp.parse("control.send=delay(3);control.send=off") == {"control.send": "off"}


def test_an_argument_survives_the_configuration_and_setup():
    cfg = Config.from_env({"MLXCLUSTER_FAILPOINTS": "control.send=delay(3)"})
    assert cfg.failpoints == (("control.send", "delay(3)"),)
    fp.setup(cfg.failpoints)
    action = fp.fail_point("control.send")
    assert action == "delay(3)" and action.name == "delay" and action.arg == 3.0
    before = fp.active()
    fp.teardown()
    fp.setup(before)  # the table round-trips (the test fixture restores it so)
    assert fp.fail_point("control.send").arg == 3.0
    with fp.scoped("control.send", "delay(7)"):
        assert fp.fail_point("control.send").arg == 7.0
    assert fp.fail_point("control.send").arg == 3.0
    with pytest.raises(ValueError, match="needs an argument"):
        fp.cfg("control.send", "delay")


def test_setup_sets_what_the_environment_says():
    fp.setup(Config.from_env({"MLXCLUSTER_FAILPOINTS": "handoff.send=epoch;pd.send=off"}).failpoints)
    assert fp.fail_point("handoff.send") == "epoch" and fp.fail_point("pd.send") is None
    fp.setup("pd.send=early_end")
    assert fp.active() == {"handoff.send": "epoch", "pd.send": "early_end"}


def test_cfg_and_remove():
    fp.cfg("pd.send", "dup")
    assert fp.fail_point("pd.send") == "dup" and fp.fail_point("handoff.send") is None
    fp.cfg("pd.send", "off")
    assert fp.fail_point("pd.send") is None
    fp.cfg("handoff.send", "exit")
    fp.remove("handoff.send")
    fp.remove("handoff.send")  # unsetting an unset failpoint is nothing
    assert fp.active() == {}
    with pytest.raises(ValueError, match="unknown failpoint"):
        fp.cfg("nope", "exit")
    with pytest.raises(ValueError, match="no action"):
        fp.cfg("pd.send", "range")
    assert fp.active() == {}


def test_scoped_restores_the_table_as_it_was():
    fp.cfg("pd.send", "permute")
    with fp.scoped("handoff.send", "hash"):
        assert fp.active() == {"pd.send": "permute", "handoff.send": "hash"}
        with fp.scoped("pd.send=off;handoff.send=weights"):
            assert fp.active() == {"handoff.send": "weights"}
        assert fp.active() == {"pd.send": "permute", "handoff.send": "hash"}
    assert fp.active() == {"pd.send": "permute"}
    with pytest.raises(RuntimeError):
        with fp.scoped("handoff.send=exit"):
            raise RuntimeError("the block failed")
    assert fp.active() == {"pd.send": "permute"}  # restored after an exception too
    with pytest.raises(ValueError):
        with fp.scoped("handoff.send", "dup"):
            pass
    assert fp.active() == {"pd.send": "permute"}


def test_a_reader_on_another_thread_sees_the_setting():
    seen = []
    with fp.scoped("pd.send", "early_last"):
        t = threading.Thread(target=lambda: seen.append(fp.fail_point("pd.send")))
        t.start()
        t.join()
    assert seen == ["early_last"]


def _sites():
    """The failpoint names at ``fail_point("...")`` sites of the package (failpoints.py's own
    docstring example excluded)."""
    sites = set()
    for folder, _dirs, files in os.walk(os.path.join(ROOT, "mlxcluster")):
        for name in files:
            if name.endswith(".py") and "_pb2" not in name and name != "failpoints.py":
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    sites |= set(re.findall(r"""fail_point\(\s*["']([^"']+)["']""", f.read()))
    return sites


def test_every_site_is_a_known_failpoint_and_every_failpoint_has_a_site():
    assert _sites() == set(fp.FAILPOINTS)


def test_the_docstring_lists_every_failpoint_and_action():
    doc = fp.__doc__
    for name, actions in fp.FAILPOINTS.items():
        assert f"``{name}``" in doc
        for action in actions:
            assert f"``{action}``" in doc
