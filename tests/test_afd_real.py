"""Attention–FFN disaggregation (`--afd 1:1`, `--afd 2:1`, `--afd-microbatches 2`) on the real model.

Attention ranks hold the embedding, attention, KV cache and head, the FFN rank every layer's MLP;
per layer the normalised residual goes to the FFN rank and its MLP output comes back.  Tokens
must equal one rank's (greedy, seeded, a prompt of two prefill chunks) on MPI and the ring; with
two micro-batches, two concurrent requests must equal their lone runs; a killed FFN rank must end
an in-flight request with one clear line within 10 s.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from harness import PROMPT, answers, token_ids
from mlxcluster.leader.generation import ClientError, GenerationClient
from mlxcluster.model.topology import Topology

pytestmark = pytest.mark.slow


def _afd(groups, spec, backend, microbatches=1):
    """The module's running AFD group of ``spec`` on ``backend`` (started once, :class:`harness.Groups`)."""
    return groups.get(int(spec.split(":")[0]) + 1, backend,
                      topology=Topology(afd=spec, afd_microbatches=microbatches))


@pytest.fixture(scope="module")
def tp1(tp1_reference):
    return tp1_reference.tokens()


# Each split once, on one backend: what goes between the attention ranks and the FFN rank per layer is the
# same over either (2:1 over MPI, 1:1 over the ring; both over MPI with two micro-batches below).  (ring,
# 1:1) last: the killed-FFN-rank check below runs on that same group, then stops it.
@pytest.mark.parametrize("spec, backend", [("2:1", "mpi"), ("1:1", "ring")])
def test_afd_equals_one_rank(groups, tp1, spec, backend):
    local = _afd(groups, spec, backend)
    assert token_ids(answers(local.address, local.credentials)) == tp1


def test_a_killed_ffn_rank_ends_the_request_with_a_clear_error(groups):
    local = _afd(groups, "1:1", "ring")
    try:
        ffn = next(p for p in local.supervisor.processes if p.name == "rank 1")
        client = GenerationClient(local.address, local.credentials)
        stream = client.stream("1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=400)
        next(stream)  # started
        next(stream)  # a first token
        os.kill(ffn.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ClientError) as err:
            for _ in stream:
                pass
        elapsed = time.monotonic() - t0
        client.close()
    finally:
        groups.evict()
    assert elapsed < 10.0, elapsed
    assert "group failed" in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("spec", ["1:1", "2:1"])
def test_two_microbatches_two_concurrent_requests_equal_their_lone_runs(groups, tp1, spec):
    local = _afd(groups, spec, "mpi", microbatches=2)
    out, started = {}, threading.Barrier(2, timeout=60)

    def run(name, **kw):
        client = GenerationClient(local.address, local.credentials, timeout_s=300)
        try:
            started.wait()
            out[name] = client.generate(**kw).token_ids
        finally:
            client.close()

    threads = [threading.Thread(target=run, args=("greedy",), kwargs=dict(prompt=PROMPT, max_tokens=24)),
               threading.Thread(target=run, args=("seeded",), kwargs=dict(prompt=PROMPT, max_tokens=16,
                                                                           temperature=0.8, top_p=0.95, seed=11))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    lone = GenerationClient(local.address, local.credentials, timeout_s=300)
    try:
        assert lone.generate(PROMPT, max_tokens=24).token_ids == out["greedy"]
    finally:
        lone.close()
    assert out["greedy"][:16] == tp1[0] and out["seeded"] == tp1[1]

