"""``serve`` with several models (issue 45): the registry's one-line errors at start (in-process), and one
``serve`` of three models at TP=1 driven through the official ``openai`` and ``ollama`` clients (slow)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from datetime import datetime, timezone

import httpx
import pytest

from harness import Reference, assert_one_line_error, cli, descendants, until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "The capital of France is"
N = 8


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A random-weight qwen3 mlx-lm directory (written by the test: no hub)."""
    from mlxcluster.model.synthetic import write_model

    return write_model("qwen3", str(tmp_path_factory.mktemp("models") / "qwen3"))


def models_file(tmp_path, text: str) -> str:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, needles", [
    ("[[model]]\npath = 'x'\ncolour = 'red'\n", ["[[model]] #1", "unknown field 'colour'"]),
    ("[[model]]\npath = 'x'\nref = 'y'\n", ["give path or ref, not both"]),
    ("[[model]]\npath = 'x'\npinned = 'yes'\n", ["pinned must be true or false"]),
    ("[[model]]\npath = 'x'\n[[model]]\npath = 'y'\nkeep_alive = 'soon'\n", ["[[model]] #2: keep_alive 'soon'"]),
    ("[[model]]\npath = 'x'\nworld_size = 0\n", ["world_size must be a whole number"]),
    ("[[model]]\npath = 'x'\nttl = 5\nkeep_alive = 5\n", ["keep_alive or ttl, not both"]),
    ("[[models]]\npath = 'x'\n", ["unknown key 'models'"]),
    ("model = 3\n", ["no [[model]] table"]),
    ("[[model]\n", ["not TOML"]),
])
def test_a_models_file_with_an_error_is_one_line_at_start(tmp_path, text, needles):
    proc = cli("serve", "--models-file", models_file(tmp_path, text), "--port", "0")
    assert proc.returncode == 2
    assert_one_line_error(proc, "--models-file", *needles)


def test_registry_errors_are_one_line_before_any_rank_starts(tmp_path, qwen_dir, real_model_path):
    proc = cli("serve", "--models-file", str(tmp_path / "missing.toml"))
    assert proc.returncode == 2 and "No such file" in assert_one_line_error(proc, "--models-file")
    proc = cli("serve", "--model", qwen_dir, "--model", qwen_dir, "--port", "0")
    assert proc.returncode == 2
    assert_one_line_error(proc, "model name 'qwen3' is given to 2 models", "--model-name")
    proc = cli("serve", "--model", qwen_dir, "--model-name", "a", "--model-name", "b", "--model-name", "c")
    assert proc.returncode == 2 and assert_one_line_error(proc, "3 --model-name for 1 --model")
    proc = cli("serve", "--model", real_model_path, "--model", qwen_dir, "--weights", "float32",
               "--memory-budget", "100MB", "--port", "0")
    assert proc.returncode == 2
    assert_one_line_error(proc, "model 'SmolLM2-135M-Instruct.Q4_1' needs", "the memory budget is 0.1 GiB",
                          "can never be loaded here")
    pinned = models_file(tmp_path, f"[[model]]\nname = 'a'\npath = '{real_model_path}'\npinned = true\n"
                                   f"[[model]]\nname = 'b'\npath = '{real_model_path}'\npinned = true\n")
    proc = cli("serve", "--models-file", pinned, "--weights", "float32", "--memory-budget", "1GB", "--port", "0")
    assert proc.returncode == 2
    assert_one_line_error(proc, "the pinned models (a, b) need 1.5 GiB together but the memory budget is 0.9 GiB")
    proc = cli("serve", "--models-file", pinned, "--weights", "float32", "--max-loaded-models", "1", "--port", "0")
    assert proc.returncode == 2 and assert_one_line_error(proc, "2 pinned models (a, b) are more than "
                                                                "--max-loaded-models 1")
    for args, needle in ((["--max-loaded-models", "0"], "--max-loaded-models must be at least 1"),
                         (["--keep-alive", "soon"], "--keep-alive 'soon'"),
                         (["--memory-budget", "lots"], "--memory-budget 'lots'"),
                         (["--cluster", "c"], "need local ranks"),
                         (["--router", "https://r", "--router-token", "t"], "--router offers one model"),
                         (["--layers", "auto"], "--layers sets one model's topology"),
                         (["--draft", "model:/x"], "only ngram")):
        proc = cli("serve", "--model", qwen_dir, "--model", real_model_path, "--model-name", "q", *args,
                   "--port", "0")
        assert proc.returncode == 2, (args, proc.stderr)
        assert_one_line_error(proc, needle)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.slow
def test_three_models_on_one_serve_through_the_openai_and_ollama_clients(tmp_path, qwen_dir, real_model_path,
                                                                          tp1_reference):
    """One serve of SmolLM2 (the default, loaded at start), a random-weight qwen3 and the same qwen3 under
    another name, at most 2 loaded: each answers with its own tokens, equal to that model alone at TP=1;
    the second loads on its first request; /api/ps shows both with sizes and expiry; the third evicts the
    least recently used idle one; generate(keep_alive=0) unloads; an unknown model is 404 to each client."""
    import ollama
    import openai

    file = models_file(tmp_path, f"[[model]]\nname = 'smol'\npath = '{real_model_path}'\n"
                                 f"[[model]]\nname = 'qwen'\npath = '{qwen_dir}'\n"
                                 f"[[model]]\nname = 'qwen-b'\nref = '{qwen_dir}'\nkeep_alive = '1h'\n")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MLXCLUSTER_SECRET", None)
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mlxcluster", "serve", "--models-file", file, "--world-size", "1",
                             "--backend", "ring", "--weights", "float32", "--port", str(port), "--max-loaded-models",
                             "2", "--log-level", "warning"], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    qwen_alone = Reference(qwen_dir)
    try:
        expected = {"smol": tp1_reference.generate(prompt=PROMPT, max_tokens=N).text,
                    "qwen": qwen_alone.generate(prompt=PROMPT, max_tokens=N).text}
        qwen_alone.close()
        assert expected["smol"] != expected["qwen"]

        def up():
            assert proc.poll() is None, open(tmp_path / "serve.log").read()[-3000:]
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        until(up, 120, "serve to come up", interval_s=0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        olla = ollama.Client(host=url)

        def complete(model):
            return client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0).choices[0].text

        def ps():
            return {m.model: m for m in olla.ps().models}

        assert [m.id for m in client.models.list().data] == ["smol", "qwen", "qwen-b"]
        assert [m.model for m in olla.list().models] == ["smol:latest", "qwen:latest", "qwen-b:latest"]
        assert list(ps()) == ["smol:latest"]
        assert complete("smol") == expected["smol"]
        assert complete("qwen") == expected["qwen"]  # loaded by this request
        raw = olla.generate(model="qwen", prompt=PROMPT, raw=True, options={"temperature": 0, "num_predict": N})
        assert raw.response == expected["qwen"]
        loaded = ps()
        assert sorted(loaded) == ["qwen:latest", "smol:latest"]
        now = datetime.now(timezone.utc)
        for m in loaded.values():
            assert m.size > 0 and m.details.family and 240 < (m.expires_at - now).total_seconds() <= 300
        assert loaded["smol:latest"].size > 4 * loaded["qwen:latest"].size
        # a third model: the least recently used idle one (smol) makes room
        assert len(rank_processes(proc.pid)) == 2
        seen = set(descendants(proc.pid))
        assert complete("qwen-b") == expected["qwen"]
        assert sorted(ps()) == ["qwen-b:latest", "qwen:latest"]
        assert len(rank_processes(proc.pid)) == 2  # smol's rank stopped before qwen-b's started
        assert 3500 < (ps()["qwen-b:latest"].expires_at - datetime.now(timezone.utc)).total_seconds() <= 3600
        unloaded = olla.generate(model="qwen", keep_alive=0)
        assert unloaded.done and unloaded.done_reason == "unload"
        until(lambda: list(ps()) == ["qwen-b:latest"], 30, "qwen unloaded")
        until(lambda: len(rank_processes(proc.pid)) == 1, 30, "qwen's rank stopped")
        seen |= set(descendants(proc.pid))
        with pytest.raises(openai.NotFoundError):
            complete("nope")
        with pytest.raises(ollama.ResponseError) as err:
            olla.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 404 and "'nope' does not exist" in err.value.error
        metrics = httpx.get(url + "/metrics").text
        assert 'mlxcluster_model_unloads_total{model="smol",reason="evicted"} 1.0' in metrics
        assert 'mlxcluster_model_loaded{model="qwen-b"} 1.0' in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        until(lambda: not [pid for pid in seen if alive(pid)], 15, "no process of serve left")
    finally:
        qwen_alone.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def rank_processes(parent: int):
    """The rank processes below ``parent`` (one per loaded model at TP=1)."""
    out = []
    for pid in descendants(parent):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"mlxcluster.runtime.rank" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False
