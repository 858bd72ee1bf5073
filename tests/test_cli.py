"""The command line: `generate` output formats, and one-line errors of every command."""

import json
import os
import socket
import subprocess
import sys

import mlx.core as mx
import pytest

from harness import assert_one_line_error, cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True, scope="module")
def one_click_command():
    """typer's CliRunner (:func:`harness.cli`) converts the app into a click command at every call,
    ~16 ms of the ~20 ms of a refused command line, ~200 calls here: the same app is converted once
    for the module (one click command, invoked again and again, as click's own runner does)."""
    import typer.testing

    convert, converted = typer.testing._get_command, {}

    def once(app):
        if app not in converted:
            converted[app] = convert(app)
        return converted[app]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(typer.testing, "_get_command", once)
        yield


def run_cli(*args, env=None, timeout=300):
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "mlxcluster.cli", *args], capture_output=True,
                          text=True, env=full_env, timeout=timeout, stdin=subprocess.DEVNULL)


def test_missing_model_file(tmp_path):
    proc = cli("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert_one_line_error(proc, "model not found", "nope.gguf")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(2000))
    proc = cli("generate", "hi", "--model", str(bad))
    assert_one_line_error(proc, "corrupt.gguf")


def test_truncated_real_gguf(tmp_path, real_model_path):
    bad = tmp_path / "truncated.gguf"
    with open(real_model_path, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    proc = cli("generate", "hi", "--model", str(bad))
    assert_one_line_error(proc, "truncated.gguf")


def test_non_llama_gguf(tmp_path):
    path = tmp_path / "gpt2.gguf"
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((8, 4))},
                 {"general.architecture": "gpt2", "gpt2.block_count": mx.array(1, dtype=mx.uint32)})
    proc = cli("generate", "hi", "--model", str(path))
    assert_one_line_error(proc, "unsupported GGUF architecture 'gpt2'")


def test_world_size_that_does_not_divide(real_model_path):
    proc = cli("generate", "hi", "--world-size", "2")
    assert_one_line_error(proc, "world size 2", "valid world sizes are 1, 3")


def test_unknown_backend_and_bad_options():
    assert_one_line_error(cli("generate", "hi", "--backend", "carrier-pigeon"), "unknown backend")
    assert_one_line_error(cli("generate", "hi", "--max-tokens", "0"), "--max-tokens")
    assert_one_line_error(cli("generate", "hi", "--weights", "int3"), "unknown weight format")


@pytest.fixture
def secret_file(tmp_path):
    """A cluster secret file ``join`` accepts (long enough, mode 0600)."""
    path = tmp_path / "s"
    path.write_text("a-secret-of-enough-length-0123")
    os.chmod(path, 0o600)
    return str(path)


def test_join_fetch_model_excludes_a_model_of_its_own(secret_file):
    for extra in (["--model", "x.gguf"], ["--layers", "0:9"], ["--role", "prefill"]):
        proc = cli("join", "--fetch-model", "--secret-file", secret_file, *extra)
        assert_one_line_error(proc, "--fetch-model takes the model from a peer")
        assert proc.returncode == 2


def test_join_exact_world_size_needs_a_world_size_and_both_are_in_the_help(secret_file):
    proc = cli("join", "--exact-world-size", "--secret-file", secret_file)
    assert_one_line_error(proc, "--exact-world-size needs --world-size N")
    assert proc.returncode == 2
    text = " ".join(cli("join", "--help").stdout.replace("│", " ").split())
    assert "re-form at once at the largest size the model splits into" in text  # issue 48: the rule, said
    assert "exact world size N requested, M live" in text


def test_join_memory_is_checked_before_the_node_starts(secret_file):
    proc = cli("join", "--memory", "lots", "--secret-file", secret_file)
    assert_one_line_error(proc, "--memory 'lots': a size such as 8GiB, 800MB or a number of bytes")
    assert proc.returncode == 2


def test_join_dashboard_options_and_models_cluster_are_checked(secret_file):
    proc = cli("join", "--dashboard-port", "70000", "--secret-file", secret_file)
    assert_one_line_error(proc, "--dashboard-port must be in 0..65535, got 70000")
    assert proc.returncode == 2
    with socket.socket() as taken:  # an explicit port that is taken: one line, before the node joins
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = cli("join", "--dashboard-port", str(port), "--secret-file", secret_file)
    assert_one_line_error(proc, f"cannot listen on 127.0.0.1:{port} for the dashboard")
    assert proc.returncode == 1
    proc = cli("models", "--cluster", "c", "some/path")
    assert_one_line_error(proc, "--cluster lists the nodes' models: it takes no PATHS")
    assert proc.returncode == 2


def test_every_command_checks_log_level_backend_and_weights_alike():
    for command in (["join"], ["router", "--provider-token", "t"], ["serve"]):
        proc = cli(*command, "--log-level", "LOUD")
        assert_one_line_error(proc, "unknown log level 'LOUD'", "DEBUG, INFO, WARNING, ERROR")
        assert proc.returncode == 2, command
    for command in (["join"], ["serve"]):
        proc = cli(*command, "--backend", "carrier-pigeon")
        assert_one_line_error(proc, "unknown backend 'carrier-pigeon'")
        assert proc.returncode == 2, command
        proc = cli(*command, "--weights", "int3")
        assert_one_line_error(proc, "unknown weight format 'int3'")
        assert proc.returncode == 2, command


def test_rank_that_fails_to_start(tmp_path, real_model_path):
    # A model directory whose config is fine but whose weights are garbage:
    # the up-front check passes, the rank fails while loading its shard.
    d = tmp_path / "broken-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "vocab_size": 49152}))
    (d / "model.safetensors").write_bytes(os.urandom(4096))
    proc = cli("generate", "hi", "--model", str(d), "--start-timeout", "120")  # the rank is a process
    assert_one_line_error(proc, "a rank failed to start", "rank 0")


@pytest.mark.slow
def test_prompt_longer_than_context(real_model_path):
    # SmolLM2's context is 8192 tokens; "hello " is one token each.
    proc = run_cli("generate", "hello " * 9000, "--max-tokens", "4")
    assert_one_line_error(proc, "longer than the context", "8192")


@pytest.mark.slow
def test_json_output_and_streaming(real_model_path):
    proc = run_cli("generate", "The capital of France is", "--max-tokens", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("prompt_ids", "token_ids", "text", "world_size", "backend", "ttft_s",
                "prefill_tokens_per_s", "decode_tokens_per_s", "peak_memory_bytes_per_rank"):
        assert key in out
    assert out["world_size"] == 1 and len(out["token_ids"]) <= 8
    assert "Paris" in out["text"]
    assert out["prompt_ids"] and out["ttft_s"] > 0 and out["peak_memory_bytes_per_rank"][0] > 0
    # Streaming mode prints the same text, and timings on stderr.
    proc2 = run_cli("generate", "The capital of France is", "--max-tokens", "8")
    assert proc2.returncode == 0, proc2.stderr
    assert proc2.stdout.strip() == out["text"].strip()
    assert "tok/s" in proc2.stderr


@pytest.mark.parametrize("args, needles", [
    (["--pd", "2:1"], ["--pd", "one rank"]),
    (["--pd", "1:2"], ["KV heads do not split over 2"]),
    (["--pd", "x"], ["prefill ranks:decode ranks"]),
    (["--pd", "1:1", "--layers", "0:14,15:output"], ["excludes"]),
    (["--afd", "3:1"], ["1:1 and 2:1"]),
    (["--afd", "1:2"], ["1:1 and 2:1"]),
    (["--afd", "a:b"], ["attention ranks:FFN ranks"]),
    (["--afd", "1:1", "--layers", "0:14,15:output"], ["excludes"]),
    (["--afd-microbatches", "2"], ["needs --afd"]),
    (["--afd", "1:1", "--afd-microbatches", "0"], ["at least 1"]),
])
def test_disaggregation_options_are_checked_before_any_rank_starts(real_model_path, args, needles):
    assert_one_line_error(cli("generate", "hi", "--model", real_model_path, *args), *needles)


@pytest.mark.parametrize("command", [["generate", "hi", "--pd", "1:1"], ["serve", "--prefill-peer", "h:1"], ["join"]])
def test_pd_fallback_is_gone(command):
    # one fallback rule: a refused prefill-group stream is prefilled by the decode group itself
    proc = cli(*command, "--pd-fallback", "local")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "No such option: --pd-fallback" in proc.stderr, proc.stderr


@pytest.mark.parametrize("argv, expected", [
    (["generate", "--bogus"], "mlxcluster: error: No such option: --bogus (see mlxcluster generate --help)"),
    (["bogus"], "mlxcluster: error: No such command 'bogus'. (see mlxcluster --help)"),
    (["generate", "--max-tokens", "abc", "hi"], "mlxcluster: error: Invalid value for '--max-tokens': "),
])
def test_a_usage_error_is_one_line_and_exit_2(monkeypatch, capsys, argv, expected):
    """An unknown option or command, or an option that does not parse, is one line on stderr and
    exit status 2 (cli.main), not click's boxed multi-line message."""
    from mlxcluster import cli

    monkeypatch.setattr(sys, "argv", ["mlxcluster", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(expected) and err.count("\n") == 1, err


def _config_variables():
    """Every ``MLXCLUSTER_*`` name config.py's source mentions (its table, its reads, its tuples)."""
    import inspect
    import re

    from mlxcluster import config as config_module

    return sorted(set(re.findall(r"MLXCLUSTER_[A-Z0-9_]*[A-Z0-9]\b", inspect.getsource(config_module))))


def test_config_py_names_every_variable_the_package_reads():
    """config.py is the one list: every MLXCLUSTER_* name in the package is there, and each is a
    setting (with its allowed values) or read by typer."""
    import re

    from mlxcluster.config import SETTINGS, TYPER_VARIABLES

    names = set(_config_variables())
    assert names == set(SETTINGS) | set(TYPER_VARIABLES)
    package = os.path.join(ROOT, "mlxcluster")
    for folder, _dirs, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name)) as f:
                    used = set(re.findall(r"MLXCLUSTER_[A-Z0-9_]*[A-Z0-9]\b", f.read()))
                assert used <= names, (name, used - names)


def _bad_settings():
    """``(variable, allowed values)`` of every setting config.py checks (derived from config.py)."""
    from mlxcluster.config import SETTINGS, TYPER_VARIABLES

    out = []
    for name in _config_variables():
        if name in TYPER_VARIABLES or not SETTINGS[name]:  # any text (a secret, a name, a path)
            continue
        out.append((name, SETTINGS[name]))
    return out


def _commands():
    """Every command of the CLI, with values for its required parameters (from the app itself)."""
    import typer.main

    from mlxcluster.cli import app

    out = []
    for name, command in typer.main.get_command(app).commands.items():
        args = [name]
        for param in command.params:
            if param.required:
                args += ["1"] if param.param_type_name == "argument" else [param.opts[0], "1"]
        out.append(args)
    return out


@pytest.mark.parametrize("name, allowed", _bad_settings())
def test_a_bad_setting_is_one_line_and_exit_2_on_every_command(name, allowed):
    """A value a setting does not allow ("bogus" is one for each checked setting) is one line naming
    the variable and the allowed values, exit status 2, on every command -- before it does anything."""
    from mlxcluster.config import Config

    with pytest.raises(ValueError):
        Config.from_env({name: "bogus"})
    commands = _commands()
    assert len(commands) >= 12 and ["serve"] in commands and ["join"] in commands
    for args in commands:
        proc = cli(*args, env={name: "bogus"})
        assert_one_line_error(proc, f"{name}='bogus'" if name != "MLXCLUSTER_FAILPOINTS" else name, allowed)
        assert proc.returncode == 2, args
        assert proc.stdout == "", args


def test_a_bad_setting_through_the_entry_point(monkeypatch, capsys):
    """The program's own entry point (cli.main, which typer's runner bypasses): one line, exit 2
    (it used to end in an AttributeError on ``cx.Abort``)."""
    from mlxcluster import cli
    from mlxcluster.config import config

    monkeypatch.setattr(sys, "argv", ["mlxcluster", "generate", "--world-size", "1", "Hi"])
    monkeypatch.setenv("MLXCLUSTER_FAILPOINTS", "control.sent=x")
    config.cache_clear()
    try:
        with pytest.raises(SystemExit) as exit_:
            cli.main()
    finally:
        config.cache_clear()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("mlxcluster: error: MLXCLUSTER_FAILPOINTS: unknown failpoint 'control.sent'")
    assert "known failpoints: decode.token, handoff.send, pd.send, control.send" in err


def test_an_abort_through_the_entry_point_is_one_line(monkeypatch, capsys):
    """End of input inside a command (typer turns EOFError into its Abort): one line, exit 130."""
    from mlxcluster import cli

    def eof(_model):
        raise EOFError

    monkeypatch.setattr(sys, "argv", ["mlxcluster", "generate", "Hi"])
    monkeypatch.setattr(cli, "_model_info", eof)
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 130 and err.strip().splitlines()[-1] == "mlxcluster: aborted", err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", [["serve"], ["chat"], ["generate", "hi"], ["join"]])
def test_a_ctrl_c_the_command_does_not_handle_is_one_line(monkeypatch, command):
    """A KeyboardInterrupt before a command's own handler (here: while it inspects the model) is one
    line, exit 130 (cli._Command) -- typer alone ends it silently."""
    from mlxcluster import cli as cli_module

    def interrupted(_model):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "_model_info", interrupted)
    proc = cli(*command, env={"MLXCLUSTER_SECRET": "a-secret-of-enough-length-0123"})
    assert_one_line_error(proc, "interrupted")
    assert proc.returncode == 130


@pytest.mark.slow
def test_ctrl_c_on_serve_chat_and_join_is_one_line(tmp_path):
    """SIGINT to the whole process group (what a terminal's Ctrl-C does), once each command is past
    its start (serve, chat: a rank is loading; join: the node has joined): one line and no traceback
    from the command or its rank processes.  The three run side by side."""
    import signal

    secret = tmp_path / "secret"
    secret.write_text("a-secret-of-enough-length-0123\n")
    os.chmod(secret, 0o600)
    runs = {  # argv -> (the line to wait for, the last line, exit status)
        ("serve", "--port", "0", "--world-size", "1"): ("ranks:", "mlxcluster: error: interrupted", 130),
        ("chat", "--world-size", "1"): ("ranks:", "mlxcluster: error: interrupted", 130),
        ("join", "--cluster", f"sigint-{os.getpid()}", "--interface", "127.0.0.1", "--port", "0", "--world-size",
         "3", "--no-dashboard", "--no-standby", "--weights", "float32", "--secret-file", str(secret)):
            ("joined cluster", "mlxcluster: node stopped (SIGINT)", 0),
    }
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    def default_sigint():  # as a terminal's shell gives it (a background job's parent may ignore SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    procs = {argv: subprocess.Popen([sys.executable, "-m", "mlxcluster", *argv], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.PIPE, text=True, env=env,
                                    process_group=0, preexec_fn=default_sigint) for argv in runs}
    try:
        for argv, proc in procs.items():
            seen = []
            for line in proc.stdout:  # ends at EOF: a command that exits early fails below
                seen.append(line)
                if runs[argv][0] in line:
                    break
            assert runs[argv][0] in "".join(seen), (argv, "".join(seen))
            os.killpg(proc.pid, signal.SIGINT)
            rest, _ = proc.communicate(timeout=180)  # ranks stopping under the full suite's load
            out = "".join(seen) + rest
            assert "Traceback" not in out, (argv, out)
            assert out.strip().splitlines()[-1] == runs[argv][1], (argv, out)
            assert proc.returncode == runs[argv][2], (argv, out)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
