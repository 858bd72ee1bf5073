"""Distributed prefill, local decode (`--layers K:output,... --local-decode`) on the real model.

The prompt is prefilled through the pipeline; every other stage then hands its layers' K/V
to rank 0, which decodes alone.  Tokens must equal one rank's (greedy, seeded, a 600-token prompt
prefilled in chunks across plans before its handoff) with 2 stages (MPI) and 3 (the ring); a handoff
whose header is wrong is refused and the answer still equals one rank's (rank 0 computes every layer
itself, the one fallback rule) -- each header field's fault is checked in-process against the one
receiver (tests/test_handoff.py), one end to end here; a stage that dies mid-handoff ends the request
with one clear line, never tokens decoded from partial K/V.
"""

from __future__ import annotations

import pytest

from harness import GREEDY, PROMPT, SEEDED, answers, token_ids
from mlxcluster.model.topology import Topology
from mlxcluster.runtime.launcher import LocalCluster
from mlxcluster.leader.generation import ClientError, GenerationClient

pytestmark = pytest.mark.slow

KV_BYTES_PER_POSITION_LAYER = 2 * 3 * 64 * 4  # keys + values, 3 KV heads x 64, float32


@pytest.fixture(scope="module")
def tp1(tp1_reference):
    return tp1_reference.tokens()


# Each route once, on one backend: the prefill's stage-to-stage sends and the K/V handoff to rank 0 are the
# same over either, and rank 0 then decodes alone (2 stages over MPI, 3 over the ring; the refused and the
# dying handoff below run 2 stages over MPI and the ring).
@pytest.mark.parametrize("layers, backend", [("15:output,0:14", "mpi"), ("20:output,0:9,10:19", "ring")])
def test_local_decode_equals_one_rank(real_model_path, tp1, backend, layers):
    n = len(layers.split(","))
    with LocalCluster(n, backend, model=real_model_path, weights="float32", start_timeout_s=300,
                      topology=Topology(layers=layers, local_decode=True)) as local:
        got = answers(local.address, local.credentials)
    assert token_ids(got) == tp1
    moved = int(layers.split(",")[0].split(":")[0])  # layers 0 .. K-1 travel to rank 0
    for r in got:
        assert r.handoff_fallback == ""
        assert r.handoff_bytes == moved * len(r.prompt_ids) * KV_BYTES_PER_POSITION_LAYER
    assert got[2].handoff_bytes == 20 * 600 * 1536 if n == 3 else 15 * 600 * 1536


def test_a_refused_handoff_falls_back_to_the_one_rank_answer(real_model_path, tp1, monkeypatch):
    fault, words = "hash", "other token ids"  # range, epoch, weights: tests/test_handoff.py, in-process
    monkeypatch.setenv("MLXCLUSTER_FAILPOINTS", f"handoff.send={fault}")  # applied by the sending stage
    with LocalCluster(2, "mpi", model=real_model_path, weights="float32", start_timeout_s=300,
                      topology=Topology(layers="15:output,0:14", local_decode=True)) as local:
        got = answers(local.address, local.credentials, [GREEDY, SEEDED])
    assert token_ids(got) == tp1[:2]
    for r in got:
        assert words in r.handoff_fallback and "\n" not in r.handoff_fallback


def test_a_stage_dying_mid_handoff_is_a_clear_error_never_partial_state(real_model_path, tp1, monkeypatch):
    monkeypatch.setenv("MLXCLUSTER_FAILPOINTS", "handoff.send=exit")  # the sender exits after its first K/V frame
    with LocalCluster(2, "ring", model=real_model_path, weights="float32", start_timeout_s=300,
                      topology=Topology(layers="15:output,0:14", local_decode=True)) as local:
        client = GenerationClient(local.address, local.credentials, timeout_s=60)
        try:
            result = client.generate(PROMPT, max_tokens=16)
        except ClientError as exc:
            message = str(exc)
            assert "\n" not in message and "rank 1" in message, message
        else:  # only an answer equal to one rank's is acceptable
            assert result.token_ids == tp1[0] and result.handoff_fallback
        finally:
            client.close()


def test_local_decode_refuses_routes_it_cannot_run():
    from harness import cli  # in process: each route is refused before any rank starts

    for args, words in [(["--layers", "0:14,15:output"], "needs rank 0 to own K:output"),
                        (["--layers", "15:output,0:14", "--stage-tp", "1,3", "--backend", "mpi"],
                         "single-rank stages"),
                        ([], "--local-decode needs --layers")]:
        r = cli("generate", *args, "--local-decode", "hi")
        assert r.returncode == 2, r.stderr
        assert words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
