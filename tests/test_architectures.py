"""Every architecture mlx-lm 0.32 can shard, end to end (random-weight models the tests write).

For each architecture in :data:`mlxcluster.model.synthetic.TINY` (dense and MoE, GQA and
MLA, sliding-window and recurrent layers): a random-weight mlx-lm directory (float32 and
4-bit quantised, tokenizer included) runs through the launcher and the Generation RPC
(what ``mlxcluster generate`` runs): TP=2 greedy tokens equal TP=1 tokens, and TP=1 equals
mlx-lm's own ``load`` + ``generate_step`` on the same directory.  TP=1 here is this project's own
load and engine (``read_model`` + ``build_model`` + ``RankEngine``, what a TP=1 rank runs) in one
separate process beside mlx-lm's, for every directory (no rank group per directory: the launcher and
the RPC are each directory's TP=2 run's); TP=1 groups run where a check needs a group's answer (text,
the CLI, TP=4).  One MLA model also runs at TP=4.
"""

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import answers, until
from mlxcluster.model.synthetic import TINY, write_model
from mlxcluster.runtime.blas import rank_environment
from mlxcluster.runtime.launcher import LocalCluster, mpirun_path
from mlxcluster.leader.generation import GenerationClient

pytestmark = pytest.mark.slow

ARCHS = sorted(TINY)
PROMPTS = ["Hello there, how are you today?", "The capital of France is"]
N_TOKENS = 12
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND = "mpi" if mpirun_path() else "ring"
Q4 = {"group_size": 32, "bits": 4}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    out = {}
    for arch in ARCHS:
        out[arch, "float32"] = write_model(arch, str(root / f"{arch}-f32"))
        out[arch, "quantized"] = write_model(arch, str(root / f"{arch}-q4"), quantize=Q4)
    return out


_ANSWERS = {}  # (model_dir, n, weights) -> the answers: one group per model and size in this module
_STOPPING = []  # threads stopping this module's groups (an MPI group takes ~1 s to stop: the next one starts)


def _stop_in_background(cluster):
    t = threading.Thread(target=cluster.stop, daemon=True)
    t.start()
    _STOPPING.append(t)


@pytest.fixture(scope="module", autouse=True)
def _all_stopped():
    """Every group of this module has stopped when the module ends (none left running)."""
    yield
    for t in _STOPPING:
        t.join(60)
    assert not any(t.is_alive() for t in _STOPPING), "a group did not stop"


def _generate(model_dir, n, weights):
    """The greedy answers to :data:`PROMPTS` of a fresh TP=``n`` group of ``model_dir``, one after
    another; a second call for the same group gets the first call's answers (no second group)."""
    key = (model_dir, n, weights)
    if key not in _ANSWERS:
        cluster = LocalCluster(n, BACKEND if n > 1 else "ring", model=model_dir, weights=weights).start()
        try:
            _ANSWERS[key] = answers(cluster.address, cluster.credentials,
                                    [dict(prompt=p, chat=False, max_tokens=N_TOKENS) for p in PROMPTS])
        finally:
            _stop_in_background(cluster)
    return _ANSWERS[key]


@pytest.fixture(scope="module")
def mlx_lm_tokens(dirs, tmp_path_factory):
    """``{(arch, weights): ([[token ids] per prompt] from plain mlx-lm, the same from this project's TP=1
    load and engine)}``, one fresh process (greedy, :data:`N_TOKENS` each)."""
    script = tmp_path_factory.mktemp("ref") / "ref.py"
    script.write_text(
        "import json, sys\n"
        "import mlx.core as mx\n"
        "from mlx_lm import load\n"
        "from mlx_lm.generate import generate_step\n"
        "from mlxcluster.engine.decode import RankEngine\n"
        "from mlxcluster.engine.sampling import Sampling\n"
        "from mlxcluster.model.loader import read_model\n"
        "from mlxcluster.model.tp import build_model\n"
        "jobs, prompts, n = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])\n"
        "\n"
        "def tp1(path, weights):\n"
        "    src = read_model(path)\n"
        "    engine = RankEngine(build_model(src.config, src.weights, src.quantization, weights), 512)\n"
        "    answers = []\n"
        "    for i, p in enumerate(prompts):\n"
        "        out = [engine.prefill(str(i), list(src.tokenizer.encode(p, add_special_tokens=True)), Sampling(),\n"
        "                              [], n)]\n"
        "        while len(out) < n:\n"
        "            out += engine.step()\n"
        "        engine.remove(str(i))\n"
        "        answers.append([int(t) for t in out])\n"
        "    return answers\n"
        "\n"
        "out = {}\n"
        "for key, path in jobs.items():\n"
        "    model, tok = load(path)\n"
        "    out[key] = ([[int(t) for t, _ in generate_step(mx.array(tok.encode(p)), model, max_tokens=n)]\n"
        "                 for p in prompts], tp1(path, key.split('|')[1]))\n"
        "print(json.dumps(out))\n")
    jobs = {f"{a}|{w}": d for (a, w), d in dirs.items()}
    proc = subprocess.run([sys.executable, str(script), json.dumps(jobs), json.dumps(PROMPTS), str(N_TOKENS)],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, **rank_environment(1),
                                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {tuple(k.split("|")): v for k, v in got.items()}


@pytest.mark.parametrize("weights", ["float32", "quantized"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_equals_tp1_equals_mlx_lm(arch, weights, dirs, mlx_lm_tokens):
    reference, tp1 = mlx_lm_tokens[arch, weights]
    assert tp1 == reference, f"{arch} TP=1 differs from mlx-lm"
    tp2 = _generate(dirs[arch, weights], 2, weights)
    for one, two in zip(tp1, tp2, strict=True):
        assert len(one) == N_TOKENS
        assert two.token_ids == one, f"{arch} TP=2 differs from TP=1"


def test_mla_tp4_equals_tp1(dirs):
    model_dir = dirs["deepseek_v3", "float32"]
    assert [r.token_ids for r in _generate(model_dir, 4, "float32")] == \
        [r.token_ids for r in _generate(model_dir, 1, "float32")]


def test_generate_cli_runs_a_moe_directory_at_tp2(dirs):
    """``mlxcluster generate --model DIR --world-size 2`` on a MoE model, as a user types it."""
    proc = subprocess.run([sys.executable, "-m", "mlxcluster", "generate", "--model", dirs["qwen3_moe", "float32"],
                           "--world-size", "2", "--max-tokens", str(N_TOKENS), "--json", PROMPTS[1]],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["world_size"] == 2 and len(out["token_ids"]) == N_TOKENS
    tp1 = _generate(dirs["qwen3_moe", "float32"], 1, "float32")
    assert out["token_ids"] == tp1[1].token_ids


@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v3", "qwen3_5", "qwen3_moe"])
def test_concurrent_requests_batch_to_their_lone_answers(arch, dirs):
    """Continuous batching merges each cache kind (sliding-window RotatingKVCache, MLA latent
    KVCache, qwen3_5's recurrent ArraysCache, MoE): two requests decoded together at TP=2
    equal their lone answers."""
    model_dir = dirs[arch, "float32"]
    lone = _generate(model_dir, 2, "float32")
    cluster = LocalCluster(2, BACKEND, model=model_dir, weights="float32").start()
    clients = [GenerationClient(cluster.address, cluster.credentials) for _ in PROMPTS]
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            together = list(pool.map(lambda cp: cp[0].generate(cp[1], chat=False, max_tokens=N_TOKENS),
                                     zip(clients, PROMPTS)))
    finally:
        for c in clients:
            c.close()
        _stop_in_background(cluster)
    assert [r.token_ids for r in together] == [r.token_ids for r in lone]


def test_serve_a_repo_id_from_the_hub_cache_at_tp2(dirs, tmp_path):
    """``mlxcluster serve --model OWNER/NAME --world-size 2`` on a MoE model found in a Hugging Face
    cache (laid out as huggingface_hub lays it out, offline): the official openai client's chat
    completion uses the model's chat template, and a greedy completion equals TP=1's tokens."""
    import shutil
    import signal
    import socket

    import httpx
    import openai

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-moe"
    shutil.copytree(dirs["qwen3_moe", "float32"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "mlxcluster", "serve", "--model", "acme/tiny-moe", "--world-size",
                             "2", "--port", str(port), "--weights", "float32", "--log-level", "warning"],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        def up():
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        until(up, 180, "serve to come up", interval_s=0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == ["acme/tiny-moe"]
        chat = client.chat.completions.create(model="acme/tiny-moe", max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": "Hi"}])
        # the ChatML template from tokenizer_config.json: 3 special tokens + one byte token per character
        assert chat.usage.prompt_tokens == 3 + len("user\nHi" + "\n" + "assistant\n")
        done = client.completions.create(model="acme/tiny-moe", prompt=PROMPTS[1], max_tokens=N_TOKENS, temperature=0)
        tp1 = _generate(dirs["qwen3_moe", "float32"], 1, "float32")[1]
        assert done.choices[0].text == tp1.text
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
