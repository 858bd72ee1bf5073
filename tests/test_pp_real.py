"""Pipeline parallelism (`--layers`) on the real model: tokens equal a single rank's.

Each split runs as a local group (ring or MPI), every rank holding whole layers
(:class:`mlxcluster.model.pp.PipelinedModel`); greedy and seeded-sampling generations and a
prompt longer than one prefill chunk must give exactly the tokens of one rank.  A middle
stage killed mid-generation ends the request with a clear error within 10 s.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from harness import answers, token_ids, until
from mlxcluster.model.topology import Topology
from mlxcluster.runtime.launcher import LocalCluster
from mlxcluster.leader.generation import ClientError, GenerationClient

pytestmark = pytest.mark.slow


def _answers(address, creds):
    """Greedy, seeded and two-prefill-chunk token ids (:data:`harness.STANDARD`)."""
    return tuple(token_ids(answers(address, creds)))


@pytest.fixture(scope="module")
def tp1(tp1_reference):
    return tuple(tp1_reference.tokens())


# Each split once, on one backend: what a stage sends its neighbour (a hidden state, point to point) is the
# same over either, and each backend runs a forward and a reverse route, 2 stages and more (a ring step
# costs ~10x an MPI one here, so the 4-stage split runs over MPI).  (ring, 15:output,0:14) last: the
# drafting check and the token-relay check below run on that same group.
@pytest.mark.parametrize("backend, layers", [("mpi", "0:14,15:output"), ("mpi", "25:output,0:9,10:17,18:24"),
                                             ("ring", "0:3,4:20,21:output"), ("ring", "15:output,0:14")])
def test_pipeline_equals_one_rank(groups, tp1, backend, layers):
    local = groups.get(len(layers.split(",")), backend, topology=Topology(layers=layers))
    got = _answers(local.address, local.credentials)
    assert got[0] == tp1[0], "greedy"
    assert got[1] == tp1[1], "seeded sampling"
    assert got[2] == tp1[2], "a prompt of two prefill chunks"


def test_each_drafter_answers_as_plain_decoding(groups, drafters):
    """Speculative decoding through a pipeline (issue 30): four chat questions (test_generate_real's
    :func:`drafting_questions`) sent together, with each drafter (``ngram``, ``model:DIR``, ``layers:6``;
    every drafter's requests in one batch), answer token for token what the same group answers without
    (``15:output,0:14`` on the ring: rank 0 verifies on the output stage's logits of every position, rank 1
    runs its layers on the same k + 1 positions and rolls its caches back at the next plan's kept counts;
    rank 0 holds layers 15.. and the head, not the first layers, so ``layers:6`` drafts with an unsharded
    copy of layers 0..5 read from the model's file); drafts were verified with each, some accepted and
    some rejected."""
    from test_generate_real import questions_with_and_without_drafting

    questions_with_and_without_drafting(groups.get(2, "ring", topology=Topology(layers="15:output,0:14")), drafters)


def test_the_token_relay_moves_hidden_states_not_logits(groups):
    """On the ring (TCP over loopback) a decode step of a reverse 2-stage pipeline moves one
    hidden state (2,304 B) and a frame with the token, not the 196,608 B of logits.

    The bytes are those the group's rank processes send on their own TCP sockets (``ss``: no other
    process's traffic counts, as the whole machine's loopback counter did: CI's other worker once
    pushed a window past the bound).  The ``all_sum`` group stays running: the next check's ring case
    runs on it."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from bench import process_tcp_bytes

    prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
    per_token = {}
    for mode in ("relay", "all_sum"):  # relay: --pp-logits's default (the pipeline check's last group)
        local = groups.get(2, "ring", topology=Topology(layers="15:output,0:14", pp_logits=mode))
        pids = sorted({e["pid"] for e in local.events if e.get("pid")})
        assert len(pids) == 2, local.events
        client = GenerationClient(local.address, local.credentials, timeout_s=300)
        sent = {}
        try:
            one = client.generate(prompt, max_tokens=1)  # the prefix cache holds the prompt from here on
            for n in (1, 33):
                before = process_tcp_bytes(pids)
                got = client.generate(prompt, max_tokens=n)
                sent[n] = process_tcp_bytes(pids) - before
                assert len(got.token_ids) == n and got.token_ids[:1] == one.token_ids
        finally:
            client.close()
        per_token[mode] = (sent[33] - sent[1]) / 32
    assert 2304 <= per_token["relay"] < 20_000, per_token
    assert per_token["all_sum"] > 196_608, per_token


# (ring, 15:output,0:14) first: the token-relay check's all_sum group, still running
@pytest.mark.parametrize("backend, layers", [("ring", "15:output,0:14"), ("mpi", "0:3,4:20,21:output")])
def test_logits_summed_to_every_rank_equal_one_rank(groups, tp1, backend, layers):
    """``--pp-logits all_sum``: every rank gets the logits and ranks N sample themselves (a reverse
    2-stage route over the ring, a forward 3-stage one over MPI)."""
    local = groups.get(len(layers.split(",")), backend, topology=Topology(layers=layers, pp_logits="all_sum"))
    assert _answers(local.address, local.credentials) == tp1


@pytest.mark.parametrize("stage_tp", ["3,1", "1,3"])
def test_tensor_parallel_stages_equal_one_rank(real_model_path, tp1, stage_tp):
    """TP x PP: 4 ranks, a TP=3 stage and a TP=1 stage (MPI: the stages are split groups).  On the
    ``1,3`` shape speculative decoding too (issue 30): four chat questions (test_generate_real's
    :func:`drafting_questions`) with n-gram drafting answer what the same group answers without, the
    drafts verified on both stages (the k + 1 positions through every rank of each, each rolling back at
    the next plan's kept counts)."""
    with LocalCluster(4, "mpi", model=real_model_path, weights="float32", start_timeout_s=300,
                      topology=Topology(layers="0:14,15:output", stage_tp=stage_tp)) as local:
        got = _answers(local.address, local.credentials)
        if stage_tp == "1,3":
            from test_generate_real import questions_with_and_without_drafting

            questions_with_and_without_drafting(local, [("ngram", 4)])
    assert got == tp1


def test_tensor_parallel_stages_need_a_backend_that_splits_groups(real_model_path):
    from mlxcluster.runtime.launcher import LaunchError

    with pytest.raises(LaunchError) as err:
        with LocalCluster(4, "ring", model=real_model_path, weights="float32", start_timeout_s=300,
                          topology=Topology(layers="0:14,15:output", stage_tp="3,1")):
            pass
    assert "tensor-parallel stages need a backend that splits groups (mpi)" in str(err.value)


def test_a_killed_middle_stage_ends_the_request_with_a_clear_error(real_model_path):
    with LocalCluster(3, "ring", model=real_model_path, weights="float32", start_timeout_s=300,
                      topology=Topology(layers="0:9,10:19,20:output")) as local:
        middle = next(p for p in local.supervisor.processes if p.name == "rank 1")
        client = GenerationClient(local.address, local.credentials)
        stream = client.stream("1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=400)  # counts on for hundreds of tokens
        next(stream)  # started
        next(stream)  # a first token
        os.kill(middle.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ClientError) as err:
            for _ in stream:
                pass
        elapsed = time.monotonic() - t0
        client.close()
    assert elapsed < 10.0, elapsed
    # rank 0 names the lost rank (its control link) or relays the backend's own report
    # ("[ring] connection to a peer was lost"), whichever comes first: one line either way
    assert "group failed" in str(err.value) and "\n" not in str(err.value), str(err.value)
    print(f"killed middle stage: client error after {elapsed:.1f} s: {err.value}")


@pytest.mark.parametrize("extra", [[], ["--local-decode"]])
def test_serve_batches_requests_across_stages(tmp_path, real_model_path, extra):
    """`serve --layers`: two concurrent completions (decoded together in one batch through every
    stage, or with --local-decode on rank 0 after their handoffs) equal the same requests run alone."""
    import json
    import subprocess
    import sys
    import threading
    import urllib.request

    from mlxcluster.runtime.launcher import free_ports

    port = free_ports(1)[0]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlxcluster", "serve", "--layers", "15:output,0:14", "--backend",
                             "mpi", "--weights", "float32", "--port", str(port), "--model", real_model_path,
                             "--model-name", "m", *extra],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0)
    url = f"http://127.0.0.1:{port}"

    def complete(prompt):
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())["choices"][0]["text"]

    try:
        def up():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
                    return resp.status == 200
            except OSError:
                return False

        until(up, 240, lambda: "serve to come up: " + (tmp_path / "serve.log").read_text()[-2000:], interval_s=0.5)
        prompts = ["The capital of France is", "Once upon a time, in a small village,"]
        alone = [complete(p) for p in prompts]
        together = [None, None]
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, complete(prompts[i])))
                   for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert together == alone and all(alone), (alone, together)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
