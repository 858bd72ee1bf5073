"""Prefill/decode disaggregation (`--pd 1:1`, `--pd 1:3`) on the real model.

A prefill group (`--role prefill`, one rank) streams each prompt's K/V per (chunk, layer) to a
decode group (`--prefill-peer`), every decode rank receiving its own KV heads.  Tokens of
concurrent requests must equal one rank's lone runs (greedy, seeded, a 512-token prompt and a
1,100-token one: three prefill chunks); the first K/V frame must arrive before the prefill's
compute ends (the K/V streams).  Every fault of the stream (duplicated, permuted,
early end, early LAST_PREFILL, wrong prompt hash or weight format) is checked in-process against
the one receiver (tests/test_pd.py); end to end, one per mechanism: permuted frames still give one
rank's tokens (the receiver reorders), a refused stream and a prefill group that dies mid-stream
are computed by the decode group instead (the one fallback rule) -- one rank's tokens, the refusal
reported.
"""

from __future__ import annotations

import pytest

from harness import GREEDY, SEEDED, answers
from mlxcluster.model.topology import Topology
from mlxcluster.runtime.launcher import LocalCluster
from mlxcluster.security import new_secret

pytestmark = pytest.mark.slow

IDS_512 = [(i * 37) % 40000 + 100 for i in range(512)]
IDS_1100 = [(i * 53) % 40000 + 100 for i in range(1100)]
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # 46,080: layers x KV heads x head_dim x (K, V) x float32


REQUESTS = (GREEDY, SEEDED, dict(prompt_ids=IDS_512, max_tokens=6), dict(prompt_ids=IDS_1100, max_tokens=6))


def _results(address, creds, long=True):
    return answers(address, creds, REQUESTS if long else REQUESTS[:2])


def _together(address, creds):
    """The result of each of :data:`REQUESTS`, the four sent at once (each its own client)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(lambda r: answers(address, creds, [r])[0], REQUESTS))


@pytest.fixture(scope="module")
def tp1(tp1_reference):
    return tp1_reference.tokens(REQUESTS)


class _Pd:
    """A prefill group and a decode group sharing one secret (what `generate --pd` starts)."""

    def __init__(self, model, decode_ranks, backend="mpi", prefill_env=None, monkeypatch=None):
        self.secret = new_secret()
        if prefill_env:
            for k, v in prefill_env.items():
                monkeypatch.setenv(k, v)
        self.prefill = LocalCluster(1, model=model, weights="float32", topology=Topology(role="prefill"),
                                    secret=self.secret).start()
        if prefill_env:
            for k in prefill_env:
                monkeypatch.delenv(k)
        try:
            self.decode = LocalCluster(decode_ranks, backend, model=model, weights="float32", secret=self.secret,
                                       start_timeout_s=300, topology=Topology(tp=decode_ranks, prefill_peer=self.prefill.address)
                                       ).start()
        except BaseException:
            self.prefill.stop()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self.decode.stop()
        self.prefill.stop()

    @property
    def failure(self):
        """Either group's failure (``None`` while both are sound): :meth:`harness.Groups.hold` reuses the pair."""
        return self.decode.failure or self.prefill.failure


def _pair(groups, model, decode_ranks, backend):
    """The module's running plain pair (prefill group + decode group of ``decode_ranks`` on ``backend``)."""
    return groups.hold(f"pd {decode_ranks} {backend}", lambda: _Pd(model, decode_ranks, backend))


def test_each_drafter_answers_as_plain_decoding(groups, real_model_path, drafters):
    """Speculative decoding in a PD decode group (issue 30; ``--pd 1:1``, the pair the next check starts
    with): each of four chat questions (test_generate_real's :func:`drafting_questions`), sent together,
    gets its K/V from the prefill group, then the decode group drafts on its rank 0 -- with each drafter
    (``ngram``, ``model:DIR``, ``layers:6``; every drafter's requests in one batch) -- and verifies; the
    answers equal the same pair's without drafting, every K/V streamed (no fallback); drafts were verified
    with each drafter, some accepted and some rejected."""
    from test_generate_real import questions_with_and_without_drafting

    pd = _pair(groups, real_model_path, 1, "ring")
    plain, spec = questions_with_and_without_drafting(pd.decode, drafters)
    for r in plain + [r for got in spec.values() for r in got]:
        assert r.handoff_fallback == "" and r.handoff_bytes > 0, r.handoff_fallback


# Each decode group once, on one backend: the K/V streams from the prefill group over gRPC, whichever
# backend the decode group's ranks sum over (a ring step costs ~10x an MPI one here).
@pytest.mark.parametrize("decode_ranks, backend", [(1, "ring"), (3, "mpi")])
def test_pd_equals_one_rank(groups, real_model_path, tp1, decode_ranks, backend):
    """The four requests sent together (the short prompts' K/V arrive and they decode while the long
    prompts' K/V still stream; decoded as one batch): each answer equals one rank's lone answer, each
    prompt's whole K/V streamed from the prefill group (no fallback, none held from before), and the
    three-chunk prompt's first (chunk, layer) frame arrived while the prefill still computed.  (The
    pair's last check: the rest of the module starts pairs of its own.)"""
    pd = _pair(groups, real_model_path, decode_ranks, backend)
    try:
        got = _together(pd.decode.address, pd.decode.credentials)
    finally:
        groups.evict()
    assert [r.token_ids for r in got] == tp1
    for r in got:
        assert r.handoff_fallback == "" and r.handoff_bytes == KV_BYTES_PER_TOKEN * len(r.prompt_ids)
    assert got[3].pd_streamed_s > 0 and got[3].pd_prefill_s > got[3].pd_streamed_s


def test_permuted_frames_still_equal_one_rank(real_model_path, tp1, monkeypatch):
    env = {"MLXCLUSTER_FAILPOINTS": "pd.send=permute"}
    with _Pd(real_model_path, 3, "mpi", prefill_env=env, monkeypatch=monkeypatch) as pd:
        got = _results(pd.decode.address, pd.decode.credentials, long=False)
    assert [r.token_ids for r in got] == tp1[:2]
    assert all(r.handoff_fallback == "" for r in got)


@pytest.mark.parametrize("fault, words, decode_ranks, backend", [("hash", "other token ids", 3, "mpi"),
                                                                 ("exit", "prefill group at", 1, "ring")])
def test_a_refused_stream_is_computed_by_the_decode_group(real_model_path, tp1, monkeypatch, fault, words,
                                                          decode_ranks, backend):
    """Every decode rank refuses the stream (a wrong prompt hash), or the prefill group dies
    mid-stream: the request leaves every rank and joins again with its K/V computed by the decode
    group -- never decoded from partial state, never failed; the group stays whole."""
    env = {"MLXCLUSTER_FAILPOINTS": f"pd.send={fault}"}
    with _Pd(real_model_path, decode_ranks, backend, prefill_env=env, monkeypatch=monkeypatch) as pd:
        got = _results(pd.decode.address, pd.decode.credentials, long=False)
        assert pd.decode.failure is None  # the decode group is intact
    assert [r.token_ids for r in got] == tp1[:2]
    assert words in got[0].handoff_fallback and "\n" not in got[0].handoff_fallback, got[0].handoff_fallback
