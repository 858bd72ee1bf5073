"""End to end on the real model (SmolLM2-135M-Instruct Q4_1 GGUF).

Tensor-parallel greedy tokens at TP=3 (MPI and ring) equal TP=1 tokens, and
TP=1 equals plain mlx-lm generation on the very same weights (the GGUF
exported as an mlx-lm directory and run through mlx-lm's own loader and
``generate_step`` in a separate process).
"""

import contextlib
import json
import os
import subprocess
import sys

import pytest

from mlxcluster.leader.generation import GenerationClient
from mlxcluster.runtime.blas import rank_environment
from mlxcluster.runtime.launcher import LocalCluster, mpirun_path

pytestmark = pytest.mark.slow

N_TOKENS = 16
# (prompt, chat): prompts whose greedy answers run past N_TOKENS without EOS.
PROMPTS = [
    ("Here is a list of the planets in the solar system, with one fact about each:", False),
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False),
    ("Write a short story about a robot who learns to paint.", True),
]


def _run_all(cluster, prompts=PROMPTS, max_tokens=N_TOKENS):
    client = GenerationClient(cluster.address, cluster.credentials)
    try:
        return [client.generate(p, chat=chat, max_tokens=max_tokens) for p, chat in prompts]
    finally:
        client.close()


def _together(client, prompts=PROMPTS, max_tokens=N_TOKENS, **kw):
    """Each of ``prompts`` sent at once (decoded as one batch), its ``GenerationResult``, in order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda pc: client.generate(pc[0], chat=pc[1], max_tokens=max_tokens, **kw), prompts))


@pytest.fixture(scope="module")
def tp1(tp1_reference):
    return tp1_reference.results([dict(prompt=p, chat=chat, max_tokens=N_TOKENS) for p, chat in PROMPTS])


def test_tp1_generates_sensible_text(tp1, real_model_path):
    for (prompt, _), result in zip(PROMPTS, tp1):
        assert len(result.token_ids) == N_TOKENS, (prompt, result.text)
        assert result.reason == "MAX_TOKENS"
        assert result.text.strip(), prompt
        assert result.ttft_s > 0 and result.decode_tokens_per_s > 0
        assert len(result.peak_memory_bytes_per_rank) == 1 and result.peak_memory_bytes_per_rank[0] > 0
    # The chat prompt went through the template: <|im_start|>assistant\n ends it.
    chat = tp1[2]
    import mlx.core as mx
    from mlxcluster.model.tokenizer import build_tokenizer

    _, metadata = mx.load(real_model_path, return_metadata=True)
    rendered = build_tokenizer(metadata).decode(chat.prompt_ids)
    assert rendered.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWrite a short story" in rendered
    assert rendered.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "paint" in chat.text.lower() or "robot" in chat.text.lower()


@pytest.mark.skipif(mpirun_path() is None, reason="OpenMPI mpirun not installed")
def test_tp3_mpi_equals_tp1(tp3_group, tp1):
    """The three prompts and a seeded top-p request sent together (one batch: 24 steps, not 48 + 24;
    batched decode equals lone decode, test_batched_prefill_real); seeded top-p sampling is reproducible
    across requests (the batched one equals the same request alone after it: rank 0 samples, ranks N
    follow its frames), and a request cancelled mid-decode leaves the group usable."""
    from concurrent.futures import ThreadPoolExecutor

    with contextlib.nullcontext(tp3_group) as cluster:  # the session's plain TP=3 group (MPI), left usable
        client = GenerationClient(cluster.address, cluster.credentials)
        try:
            kw = dict(prompt_ids=tp1[0].prompt_ids, max_tokens=24, temperature=0.8, top_p=0.9, seed=11)
            with ThreadPoolExecutor(1) as pool:
                seeded = pool.submit(client.generate, **kw)
                results = _together(client)
                a = seeded.result()
            b = client.generate(**kw)
            events = client.stream(prompt_ids=tp1[0].prompt_ids, max_tokens=64)
            got = [e for _, e in zip(range(6), events)]  # started + 5 tokens, then cancel
            events.close()
            again = client.generate(prompt_ids=tp1[0].prompt_ids, max_tokens=N_TOKENS)
        finally:
            client.close()
    for ref, got_ in zip(tp1, results):
        assert got_.prompt_ids == ref.prompt_ids
        assert got_.token_ids == ref.token_ids
        assert len(got_.peak_memory_bytes_per_rank) == 3 and min(got_.peak_memory_bytes_per_rank) > 0
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24 and a.token_ids[:N_TOKENS] != tp1[0].token_ids
    assert len(got) == 6
    assert again.token_ids == tp1[0].token_ids


def test_tp3_ring_equals_tp1(groups, tp1):
    """The three prompts sent together (decoded as one batch: 16 ring steps, not 48 -- ring TP=3 decodes
    ~2 steps/s on 2 shared cores); each answer equals its lone TP=1 answer (batched decode equals lone
    decode: test_batched_prefill_real, test_architectures).  The module's ring group (``groups``): the
    drafting check below runs on it too."""
    cluster = groups.get(3, "ring")
    # ranks stay in this session (one scheduler autogroup), each in its own process group
    for proc in cluster.procs:
        assert os.getsid(proc.pid) == os.getsid(0) and os.getpgid(proc.pid) == proc.pid
    client = GenerationClient(cluster.address, cluster.credentials)
    try:
        before = client.info().generated_tokens
        results = _together(client)
        info = client.info()
    finally:
        client.close()
    assert info.generated_tokens - before == len(PROMPTS) * N_TOKENS
    for ref, got in zip(tp1, results):
        assert got.prompt_ids == ref.prompt_ids
        assert got.token_ids == ref.token_ids


def test_a_drafter_answers_as_plain_decoding_at_tp3_on_the_ring(groups, tp1):
    """As at TP=1 and TP=3 over MPI (test_each_drafter_answers_as_plain_decoding_at_tp1_and_tp3, every
    drafter): a TP=3 group over MLX's TCP ring -- the module's, whose plain answers to the three prompts
    the check above found equal to TP=1's -- answers them with drafting (sent together: each verify step
    verifies several sequences' drafts in one forward pass) token for token as TP=1 answers them plainly;
    drafts were verified (rank 0's count grew by what the answers report, > 0) and some were rejected
    (the ranks rolled back to the kept counts).  One drafter, ``layers:6`` (rank 0's unsharded copy of the
    first layers beside its shard): what a drafter drafts and how the k + 1 positions are verified does
    not depend on the backend, and each ring step costs ~10x an MPI one here, so the other two are
    checked over MPI only."""
    cluster = groups.get(3, "ring")
    client = GenerationClient(cluster.address, cluster.credentials, timeout_s=600)
    try:
        before = client.info().spec_drafted_tokens
        got = _together(client, speculative=("layers:6", 4))
        drafted = client.info().spec_drafted_tokens - before
    finally:
        client.close()
    groups.evict()  # the module's last check on the ring
    assert [r.token_ids for r in got] == [r.token_ids for r in tp1]
    accepted = sum(r.spec_accepted_tokens for r in got)
    print(f"ring TP=3, layers:6: {drafted} tokens drafted, {accepted} accepted")
    assert drafted > 0 and sum(r.spec_drafted_tokens for r in got) == drafted, drafted
    assert accepted < drafted, (accepted, drafted)


def test_generate_sampling_flags_top_k_1_is_greedy_and_seeded_sampling_is_the_same_at_tp3(
        real_model_path, tp1, tp1_group, tp3_group):
    """``mlxcluster generate`` (its own TP=1 group, the prompt from standard input) with ``--top-k 1``
    at temperature 0.9 answers the greedy tokens; a seeded sample through every sampler option
    (top_p, top_k, min_p, repetition penalty) is the same at TP=1 and TP=3 (rank 0 samples, token i
    with the key of (seed, i)), reproducible, and not the greedy answer."""
    prompt, _ = PROMPTS[0]
    proc = subprocess.run([sys.executable, "-m", "mlxcluster", "generate", "-", "--model", real_model_path,
                           "--weights", "float32", "--max-tokens", str(N_TOKENS), "--json", "--temperature", "0.9",
                           "--top-k", "1", "--seed", "5"], input=prompt, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["prompt_ids"] == tp1[0].prompt_ids and out["seed"] == 5
    assert out["token_ids"] == tp1[0].token_ids
    kw = dict(prompt_ids=tp1[0].prompt_ids, max_tokens=24, temperature=0.9, top_p=0.95, top_k=40, min_p=0.02,
              repetition_penalty=1.3, seed=11)
    answers = []
    for group in (tp1_group, tp1_group, tp3_group):
        client = GenerationClient(group.address, group.credentials)
        try:
            answers.append(client.generate(**kw).token_ids)
        finally:
            client.close()
    assert answers[0] == answers[1] == answers[2]
    assert len(answers[0]) == 24 and answers[0] != tp1[0].token_ids[:24]


def _mlx_lm_reference(model_dir, prompts, max_tokens, tmp_path):
    """Greedy tokens from plain mlx-lm (its loader + generate_step), in a fresh process."""
    script = tmp_path / "ref.py"
    script.write_text(
        "import json, sys\n"
        "import mlx.core as mx\n"
        "from mlx_lm import load\n"
        "from mlx_lm.generate import generate_step\n"
        "model, tok = load(sys.argv[1])\n"
        "out = []\n"
        "for ids in json.loads(sys.argv[2]):\n"
        "    toks = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=int(sys.argv[3]))]\n"
        "    out.append(toks)\n"
        "print(json.dumps(out))\n")
    env = dict(os.environ, **rank_environment(1))
    proc = subprocess.run([sys.executable, str(script), str(model_dir), json.dumps(prompts), str(max_tokens)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tp1_float32_equals_mlx_lm(real_model_path, tp1, tmp_path):
    from mlxcluster.model.export import export_mlx

    out = export_mlx(real_model_path, str(tmp_path / "smollm2-f32"), dequantize=True)
    ref = _mlx_lm_reference(out, [r.prompt_ids for r in tp1], N_TOKENS, tmp_path)
    for got, want in zip(tp1, ref):
        assert got.token_ids == want


def test_tp1_quantized_equals_mlx_lm(real_model_path, tmp_path):
    from mlxcluster.model.export import export_mlx

    out = export_mlx(real_model_path, str(tmp_path / "smollm2-q4"))
    with LocalCluster(1, model=real_model_path, weights="quantized") as cluster:
        (result,) = _run_all(cluster, PROMPTS[:1], max_tokens=16)
    ref = _mlx_lm_reference(out, [result.prompt_ids], 16, tmp_path)
    assert result.token_ids == ref[0]
    # And an mlx-lm directory loads back into mlxcluster itself.
    with LocalCluster(1, model=out, weights="quantized") as cluster:
        (again,) = _run_all(cluster, PROMPTS[:1], max_tokens=16)
    assert again.token_ids == result.token_ids


def test_ranks_exit_when_their_launcher_is_killed(real_model_path, tmp_path):
    """A launcher (here a plain Python process holding a TP=1 group)
    killed with SIGKILL leaves no rank process behind: each rank notices it was
    re-parented and exits within about a second."""
    import signal

    script = tmp_path / "launch.py"
    script.write_text(
        "import sys, threading\n"
        "from mlxcluster.runtime.launcher import LocalCluster\n"
        "c = LocalCluster(1, model=sys.argv[1], weights='float32').start()\n"
        "print(' '.join(str(p.pid) for p in c.procs), flush=True)\n"
        "threading.Event().wait(120)  # until this test kills it\n")
    launcher = subprocess.Popen([sys.executable, str(script), real_model_path], stdout=subprocess.PIPE,
                                text=True)
    try:
        pids = [int(p) for p in launcher.stdout.readline().split()]
        assert pids
        for pid in pids:
            os.kill(pid, 0)  # running
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        alive = [pid for pid in pids if not _exits_within(pid, 15.0)]
        assert not alive, f"rank processes {alive} outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def _exits_within(pid: int, timeout_s: float) -> bool:
    """Wait (on a pidfd: readable once the process has exited) for a process
    that is not our child; True if it exited within ``timeout_s``."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def test_a_port_taken_before_the_rank_binds_it_is_retried(real_model_path, monkeypatch):
    """free_ports picks ports that another process may take before the rank
    binds them: that start is retried with fresh ports."""
    import socket

    from mlxcluster.runtime import launcher

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    picks = []
    real = launcher.free_ports

    def first_taken(n, host="127.0.0.1"):
        picks.append(n)
        return [held.getsockname()[1]] * n if len(picks) == 1 else real(n, host)

    monkeypatch.setattr(launcher, "free_ports", first_taken)
    cluster = LocalCluster(1, model=real_model_path, weights="float32", start_timeout_s=120)
    try:
        cluster.start()
        assert len(picks) == 2 and cluster.address.rsplit(":", 1)[1] != str(held.getsockname()[1])
    finally:
        cluster.stop()
        held.close()


def test_each_drafter_answers_as_plain_decoding_at_tp1_and_tp3(tp1_group, tp3_group, drafters):
    """Speculative decoding (issue 30): four chat questions (:func:`drafting_questions`), sent with each
    drafter per request -- ``ngram``, ``model:DIR`` (a second model with the target's tokenizer, loaded by
    rank 0) and ``layers:6`` (at TP=1 a view of rank 0's own modules; at TP=3, where rank 0 holds a shard,
    an unsharded copy of the first 6 layers read from the model's file), every drafter's requests together
    (one batch: every verify step verifies several sequences' drafts in one forward pass) -- answer token
    for token what the same group answers without, on the session's TP=1 group and its TP=3 group over
    MPI (ranks N follow the verify steps' plans and kept counts, or refuse them); drafts were verified
    with each drafter on both, some accepted and some rejected."""
    for group in (tp1_group, tp3_group):
        questions_with_and_without_drafting(group, drafters)


#: a request whose answer copies its prompt: n-gram lookup finds its drafts there (in open chat it
#: finds few), some accepted, some not
COPY_QUESTION = ("Copy this text exactly: The quick brown fox jumps over the lazy dog. The quick brown fox jumps "
                 "over the lazy dog.")


def drafting_questions():
    """The chat questions the drafting checks send: three of test_batched_prefill_real's eight (rivers,
    Japan, tensor: open answers, where a draft model's drafts are mostly rejected) and
    :data:`COPY_QUESTION`."""
    from test_batched_prefill_real import QUESTIONS

    return QUESTIONS[1:6:2] + [COPY_QUESTION]


def questions_with_and_without_drafting(group, drafters, max_tokens: int = 16, questions=None):
    """Chat questions (``questions``, default :func:`drafting_questions`), sent together to ``group`` (a
    running ``LocalCluster``, or anything with ``address`` and ``credentials``) without drafting, then
    once with each drafter of ``drafters`` (each a request's ``speculative``, ``(draft, draft_tokens)``;
    conftest's :func:`drafters`), every drafter's requests together in one batch (each verify step
    verifies several sequences' drafts, of several drafters, in one forward pass).  Checks that each
    drafter's answers equal the plain ones token for token, that drafts were verified with each (> 0;
    rank 0's count of draft tokens grew by what the answers report) and that, over all the drafters,
    some drafts were accepted and some rejected (0 < accepted < drafted: the ranks kept verified
    positions and rolled back others).  Returns ``(plain, {draft: answers})``: each answer's
    ``GenerationResult``, in question order."""
    from concurrent.futures import ThreadPoolExecutor

    questions = drafting_questions() if questions is None else questions
    client = GenerationClient(group.address, group.credentials, timeout_s=600)
    try:
        def run(requests):
            with ThreadPoolExecutor(len(requests)) as pool:
                return list(pool.map(lambda qs: client.generate(qs[0], chat=True, max_tokens=max_tokens,
                                                                speculative=qs[1]), requests))

        plain = run([(q, ("off", 0)) for q in questions])
        assert all(r.spec_drafted_tokens == 0 for r in plain)
        before = client.info().spec_drafted_tokens
        got = run([(q, d) for d in drafters for q in questions])
        drafted_all = client.info().spec_drafted_tokens - before
        spec = {d[0]: got[i * len(questions):(i + 1) * len(questions)] for i, d in enumerate(drafters)}
        for speculative in drafters:
            answers = spec[speculative[0]]
            drafted = sum(r.spec_drafted_tokens for r in answers)
            accepted = sum(r.spec_accepted_tokens for r in answers)
            print(f"{speculative[0]} at {group.world_size} ranks: {drafted} drafted, {accepted} accepted")
            assert [r.token_ids for r in answers] == [r.token_ids for r in plain], (speculative, group.world_size)
            assert drafted > 0, speculative
        assert sum(r.spec_drafted_tokens for r in got) == drafted_all
        accepted_all = sum(r.spec_accepted_tokens for r in got)
        assert 0 < accepted_all < drafted_all, (accepted_all, drafted_all)
        return plain, spec
    finally:
        client.close()
