"""Speculative decoding at one rank (issue 30, phase 1): the pure acceptance rules, the n-gram drafter,
the draft-length controller, the distribution of speculative sampling (a chi-square test), and
:meth:`RankEngine.verify` in-process on the tiny random Llama -- greedy output equal to plain
:meth:`RankEngine.step` decoding token for token, lone and batched, with drafts partly right (so every
row's rollback is exercised), a frame-driven rank's verify + commit, and the refusal of a model whose
caches cannot roll back.  Fast tier: no rank processes."""

import os
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

sys.path.insert(0, os.path.dirname(__file__))

import tinymodel  # noqa: E402
from mlxcluster.engine import batch as batch_mod  # noqa: E402
from mlxcluster.engine import speculative as spec  # noqa: E402
from mlxcluster.engine.decode import RankEngine  # noqa: E402
from mlxcluster.engine.sampling import Sampling  # noqa: E402

VOCAB = tinymodel.TINY_CONFIG["vocab_size"]
CONTEXT = 96
PROMPTS = [[1, 5, 200, 17, 3, 99, 42], [7, 7, 8, 100, 31], [250, 4, 4, 4, 60, 61, 62, 63, 9]]
MAX_TOKENS = [22, 27, 33]


# --------------------------------------------------------------------------- pure acceptance
def test_greedy_accept_takes_the_matching_prefix_and_the_target_token():
    assert spec.greedy_accept([5, 6, 7], [5, 6, 9, 1]) == (2, [5, 6, 9])
    assert spec.greedy_accept([5, 6, 7], [4, 6, 7, 1]) == (0, [4])
    assert spec.greedy_accept([5, 6, 7], [5, 6, 7, 1]) == (3, [5, 6, 7, 1])  # all accepted: the bonus token
    assert spec.greedy_accept([], [3]) == (0, [3])
    with pytest.raises(ValueError):
        spec.greedy_accept([1, 2], [1, 2])


def test_rejection_accept_follows_the_uniforms_and_the_residual():
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]])
    drawn = []

    def draw(j, dist):
        drawn.append((j, None if dist is None else dist.tolist()))
        return 2

    # token 1 at position 0 has p 0.3: u 0.29 accepts it, u 0.31 rejects it
    assert spec.rejection_accept([1, 2], p, None, [0.29, 0.79], draw) == (2, [1, 2, 2])
    assert drawn[-1] == (2, None)  # all accepted: the bonus from p[2] itself
    assert spec.rejection_accept([1, 2], p, None, [0.31, 0.0], draw) == (0, [2])
    j, dist = drawn[-1]
    assert j == 0 and np.allclose(dist, [0.5 / 0.7, 0.0, 0.2 / 0.7])  # p without the rejected token
    # a drafter's probabilities q: accept with p/q, residual max(0, p - q) normalised
    q = np.array([[0.1, 0.6, 0.3], [0.3, 0.3, 0.4]])
    assert spec.rejection_accept([1, 2], p, q, [0.49, 0.0], draw)[0] == 2  # 0.3/0.6 = 0.5 > 0.49
    assert spec.rejection_accept([1, 2], p, q, [0.51, 0.0], draw) == (0, [2])
    assert np.allclose(drawn[-1][1], np.array([0.4, 0.0, 0.0]) / 0.4)
    with pytest.raises(ValueError):
        spec.rejection_accept([1], p, None, [0.5], draw)


# --------------------------------------------------------------------------- the chi-square test
#: upper 0.1 % points of the chi-square distribution (Abramowitz & Stegun, table 26.8; scipy is not
#: installed here: ``scipy.stats.chi2.ppf(0.999, df)``)
CHI2_999 = {5: 20.515, 7: 24.322}


def _chi2(counts, probs):
    counts, expected = np.asarray(counts, dtype=float), np.asarray(probs, dtype=float) * np.sum(counts)
    return float(np.sum((counts - expected) ** 2 / expected))


def _speculative_samples(p, q, n, draft_of):
    """``n`` steps of speculative sampling with the engine's keyed draws (seed = draw number, token index
    0): the first two tokens emitted (the second None where the step emitted one)."""
    logp = np.log(p).astype(np.float32)
    out = []
    for seed in range(n):
        draft = draft_of(seed)

        def draw(j, dist, seed=seed):
            return spec.keyed_categorical(logp[j] if dist is None else np.log(np.maximum(dist, 1e-300)).astype(
                np.float32), seed, j)

        uniforms = [spec.keyed_uniform(seed, j) for j in range(len(draft))]
        _, tokens = spec.rejection_accept(draft, p[:len(draft) + 1], q, uniforms, draw)
        out.append((tokens[0], tokens[1] if len(tokens) > 1 else None))
    return out


P = np.array([[0.30, 0.25, 0.15, 0.12, 0.10, 0.08],   # position 0: after the context
              [0.05, 0.10, 0.40, 0.20, 0.15, 0.10]])  # position 1: after the context and draft token 0


def test_speculative_sampling_follows_the_target_distribution():
    """A deterministic drafter always proposes token 0 (p 0.3): the first token emitted must follow
    p[0] and, where the draft was accepted, the second p[1] (Leviathan et al. 2023, Theorem 3.5);
    chi-square at the 0.1 % level over 3000 steps.  Breaking the residual (drawing from p instead of
    p without the rejected token) over-represents token 0 (0.3 -> 0.51) and fails this."""
    samples = _speculative_samples(P, None, 3000, lambda seed: [0])
    first = np.bincount([a for a, _ in samples], minlength=6)
    assert _chi2(first, P[0]) < CHI2_999[5], first
    second = np.bincount([b for a, b in samples if a == 0], minlength=6)
    assert second.sum() > 700
    assert _chi2(second, P[1]) < CHI2_999[5], second


def test_speculative_sampling_with_draft_probabilities_follows_the_target():
    """A sampling drafter (q, a draft model's case): its token drawn from q, accepted with p/q."""
    q = np.array([[0.10, 0.10, 0.40, 0.10, 0.20, 0.10]])
    cdf = np.cumsum(q[0])
    rng = np.random.default_rng(7)
    drafts = [int(np.searchsorted(cdf, rng.random(), side="right")) for _ in range(3000)]
    samples = _speculative_samples(P, q, 3000, lambda seed: [min(drafts[seed], 5)])
    first = np.bincount([a for a, _ in samples], minlength=6)
    assert _chi2(first, P[0]) < CHI2_999[5], first


# --------------------------------------------------------------------------- drafters and k
def test_ngram_drafter_proposes_what_followed_the_most_recent_match():
    d = spec.NgramDrafter(max_n=3, min_n=1)
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    assert d.propose(ctx, 2) == [4, 5]  # the trigram "1 2 3" first
    bigram = spec.NgramDrafter(max_n=2, min_n=1)
    assert bigram.propose(ctx, 2) == [7, 8]  # "2 3": its most recent earlier occurrence, followed by 7 8
    # past the end of the context the copy goes on copying itself: "7 8 1 2 3" repeats with its period
    assert bigram.propose(ctx, 10) == [7, 8, 1, 2, 3, 7, 8, 1, 2, 3]
    assert bigram.propose([4, 9, 9, 9], 3) == [9, 9, 9]  # a run of one token: period 1
    assert d.propose([5, 6, 7, 6], 3) == [7, 6, 7]  # only the unigram matches (then its copy repeats)
    assert spec.NgramDrafter(max_n=3, min_n=2).propose([5, 6, 7, 6], 3) == []
    assert d.propose([1, 2, 3], 3) == [] and d.propose([4], 3) == [] and d.propose(ctx, 0) == []
    # the longest n first: "9 2 3" (followed by 4) beats the more recent bigram "2 3" (followed by 5)
    assert spec.NgramDrafter(max_n=3, min_n=2).propose([9, 2, 3, 4, 1, 2, 3, 5, 9, 2, 3], 1) == [4]
    assert isinstance(spec.make_drafter("ngram"), spec.NgramDrafter)
    assert (lambda x: (x.min_n, x.max_n))(spec.make_drafter("ngram:1-5")) == (1, 5)
    for bad in ("model:/x", "layers:4", "other"):
        with pytest.raises(ValueError):
            spec.make_drafter(bad)


def test_adaptive_k_follows_the_acceptance_rate():
    assert spec.expected_tokens(0.0, 4) == 1.0 and spec.expected_tokens(1.0, 4) == 5.0
    assert abs(spec.expected_tokens(0.5, 2) - 1.75) < 1e-12
    k = spec.AdaptiveK(6, cost=0.1)
    for _ in range(30):
        k.update(6, 6)
    assert k.alpha > 0.9 and k.next_k() == 6
    for _ in range(60):
        k.update(k.next_k() or 1, 0)
    assert k.alpha < 0.1 and k.best_k() == 0
    probes = [k.next_k() for _ in range(16)]
    assert probes.count(1) == 2 and set(probes) == {0, 1}  # every 8th step drafts one token again
    assert spec.AdaptiveK(0).next_k() == 0


def test_stats_count_tokens_per_step():
    s = spec.SpecStats()
    s.add(spec.Verified([1, 2, 3], 4, 2))
    s.add(spec.Verified([5], 0, 0))
    assert (s.steps, s.drafted, s.accepted, s.tokens) == (2, 4, 2, 4)
    assert s.acceptance_rate == 0.5 and s.tokens_per_step == 2.0


# --------------------------------------------------------------------------- the engine
def _decode(model, prompts, max_tokens, sampling=None, drafters=None, engine=None):
    """The batch decoded together, a sequence leaving when it stops: plain steps (RankEngine.step, no
    lookahead), or with ``drafters`` (uid -> drafter) verify steps; returns ``(tokens by uid, engine)``."""
    engine = engine or RankEngine(model, CONTEXT)
    out = {}
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        out[f"s{i}"] = [engine.prefill(f"s{i}", p, sampling or Sampling(), (), n)]
    while engine.batch.uids:
        for uid in [u for u in engine.batch.uids if engine.get(u).reason]:
            engine.remove(uid)
        if not engine.batch.uids:
            break
        if drafters is None:
            for uid, t in zip(engine.batch.uids, engine.step()):
                out[uid].append(t)
            continue
        drafts = [drafters[uid].propose(len(out[uid])) for uid in engine.batch.uids]
        for uid, v in zip(engine.batch.uids, engine.verify(drafts)):
            out[uid] += v.tokens
    return out, engine


def _plain(model, prompts, max_tokens, sampling=None):
    """Plain decoding's tokens by uid (:func:`_decode` without drafters)."""
    return _decode(model, prompts, max_tokens, sampling)[0]


class Oracle:
    """Proposes the reference continuation with one token made wrong at a place that moves every call
    (so acceptance varies from 0 to all and every row's rollback differs), or nothing every 5th call."""

    def __init__(self, reference, k, salt):
        self.reference, self.k, self.salt, self.calls = reference, k, salt, 0

    def propose(self, done, k=None):
        self.calls += 1
        if (self.calls + self.salt) % 5 == 0:
            return []
        draft = list(self.reference[done:done + (k or self.k)])
        wrong = (self.calls * 3 + self.salt) % (self.k + 2)
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % VOCAB
        return draft


def _speculative(model, prompts, max_tokens, drafters, sampling=None, engine=None):
    """Verify-step decoding with ``drafters``: ``(tokens by uid, engine)`` (:func:`_decode`)."""
    return _decode(model, prompts, max_tokens, sampling, drafters, engine)


@pytest.mark.parametrize("penalty", [0.0, 2.0])
@pytest.mark.parametrize("n", [1, 3])
def test_greedy_verify_equals_plain_decoding(model, n, penalty):
    """Lone (its own KVCache, trimmed) and a batch of 3 (BatchKVCache rows rolled back per row, a free
    row after the first leaves): every token equal to plain one-token steps, every sequence stopping at
    its max_tokens, drafts accepted in part.  Greedy plain, and greedy under a frequency penalty (whose
    counts must see exactly the verified tokens; it also keeps the tiny model from repeating itself)."""
    prompts, limits = PROMPTS[:n], MAX_TOKENS[:n]
    s = Sampling(frequency_penalty=penalty)
    plain = _plain(model, prompts, limits, s)
    drafters = {uid: Oracle(ref, 4, i) for i, (uid, ref) in enumerate(plain.items())}
    got, engine = _speculative(model, prompts, limits, drafters, s)
    assert got == plain
    assert [len(v) for v in got.values()] == limits
    st = engine.spec_stats
    assert 0 < st.accepted < st.drafted and st.tokens_per_step > 1.5, st.as_dict()
    assert st.tokens == sum(limits) - n  # the first tokens came from the prefills


def test_verify_rolls_back_every_row_to_what_plain_decoding_holds(model):
    """After a verify step with different acceptances per row, each row's K/V (its own positions, read
    through its left padding) equals plain decoding's, and the RoPE offsets agree."""
    plain_engine, spec_engine = RankEngine(model, CONTEXT), RankEngine(model, CONTEXT)
    for e in (plain_engine, spec_engine):
        for i, p in enumerate(PROMPTS):
            e.prefill(f"s{i}", p, Sampling(), (), 40)
    ref = {u: [] for u in plain_engine.batch.uids}
    for _ in range(5):
        for u, t in zip(plain_engine.batch.uids, plain_engine.step()):
            ref[u].append(t)
    first = {u: spec_engine.get(u).token for u in spec_engine.batch.uids}
    drafts = [ref["s0"][:4], ref["s1"][:1] + [(ref["s1"][1] + 1) % VOCAB, 3, 4], []]
    res = spec_engine.verify(drafts)
    assert [len(r.tokens) for r in res] == [5, 2, 1] and [r.accepted for r in res] == [4, 1, 0]
    # bring the plain engine to the same lengths: s0 +0, s1 and s2 behind by 3 and 4 -> compare prefixes
    for u, r in zip(spec_engine.batch.uids, res):
        assert r.tokens == ref[u][:len(r.tokens)], u
        assert first[u] is not None
    sc, pc = spec_engine.batch._cache[0], plain_engine.batch._cache[0]
    mx.eval(sc.keys, pc.keys, sc.left_padding, pc.left_padding, sc.offset, pc.offset)
    for row, (u, r) in enumerate(zip(spec_engine.batch.uids, res)):
        n = spec_engine.get(u).session.position
        assert n == len(PROMPTS[row]) + len(r.tokens)
        assert int(sc.offset[row].item()) == n
        sp, pp = int(sc.left_padding[row].item()), int(pc.left_padding[row].item())
        got = sc.keys[row, :, sp:sp + n]
        want = pc.keys[row, :, pp:pp + n]
        assert mx.allclose(got, want, atol=1e-5).item(), u


def test_frame_driven_rank_verifies_and_commits_the_same_rollback(model):
    """A rank N (no sampling) runs the same (B, L) forward on the plan's tokens and drafts, waits for the
    kept counts, and then holds exactly rank 0's K/V; nothing else runs in between."""
    rank0, rankn = RankEngine(model, CONTEXT), RankEngine(model, CONTEXT, compute_logits=False)
    firsts = []
    for i, p in enumerate(PROMPTS):
        firsts.append(rank0.prefill(f"s{i}", p, Sampling(), (), 40))
        rankn.prefill(f"s{i}", p)
    drafts = [[firsts[0], 5], [9], []]
    drafts = [rank0.clamp_draft(u, d) for u, d in zip(rank0.batch.uids, drafts)]
    res = rank0.verify(drafts)
    assert rankn.verify(drafts, tokens=firsts) is None
    with pytest.raises(ValueError, match="commit"):
        rankn.step([1, 2, 3])
    with pytest.raises(ValueError, match="commit"):
        rankn.remove("s0")
    rankn.commit([len(r.tokens) for r in res])
    for u in rank0.batch.uids:
        assert rank0.get(u).session.position == rankn.get(u).session.position
    a, b = rank0.batch._cache[1], rankn.batch._cache[1]
    mx.eval(a.keys, b.keys, a.left_padding, b.left_padding)
    assert a.left_padding.tolist() == b.left_padding.tolist() and a._idx == b._idx
    assert mx.allclose(a.keys[..., :a._idx, :], b.keys[..., :b._idx, :]).item()
    with pytest.raises(ValueError, match="no verify step"):
        rankn.commit([1, 1, 1])


def test_verify_applies_the_requests_sampling_distribution(model):
    """Sampled verification draws from the sampler's own distribution: with top_k 1 it is one-hot at the
    processed argmax, so speculative sampling must give greedy decoding's tokens under the same logit
    bias -- which it would not if the filters or the processors were skipped (the bias pushes token 3
    near the top; drafts propose the unbiased greedy tokens, partly)."""
    bias = Sampling(temperature=0.0, logit_bias=((3, 2.0), (77, 1.5)))
    sampled = Sampling(temperature=0.8, top_k=1, seed=5, logit_bias=((3, 2.0), (77, 1.5)))
    plain = _plain(model, PROMPTS, MAX_TOKENS, bias)
    unbiased = _plain(model, PROMPTS, MAX_TOKENS)
    assert plain != unbiased
    drafters = {uid: Oracle(unbiased[uid], 3, i) for i, uid in enumerate(plain)}
    got, _ = _speculative(model, PROMPTS, MAX_TOKENS, drafters, sampled)
    assert got == plain


def test_engine_speculative_sampling_follows_the_requests_distribution(model):
    """The engine's own path (RankEngine.verify, every row of a batch of 96 seeded sequences, 4
    batches): the first token of a step whose draft is the likeliest token follows the request's
    distribution -- temperature 1.5 and top_k 6 (mlx-lm's filter: 6 tokens remain, chi-square with 5
    degrees of freedom at the 0.1 % level) after a logit bias, computed independently here from one
    forward pass.  Skipping the filters, the processors or the residual fails it: 384 draws are
    enough (chi-square 3.1 here; ~65 without the residual or without the bias, against 20.5; tokens
    outside the 6 without top_k), and each batch of 96 costs ~0.17 s."""
    context = PROMPTS[0] + [11]
    logits = model(mx.array([context], dtype=mx.int32))[0, -1].astype(mx.float32)
    biased = int(mx.argsort(-logits)[3].item())  # the 4th likeliest becomes the likeliest
    sampling = dict(temperature=1.5, top_k=6, logit_bias=((biased, 1.5),))
    logits = logits + mx.zeros((VOCAB,)).at[mx.array([biased])].add(mx.array([1.5]))
    top = mx.argsort(-logits)[:6]
    p = mx.softmax(logits[top] / 1.5).tolist()
    support = [int(t) for t in top.tolist()]
    draft = support[0]
    firsts = []
    for r in range(4):
        engine = RankEngine(model, CONTEXT)
        engine.prefill_many([(f"r{r}s{i}", PROMPTS[0], Sampling(seed=1000 * r + i, **sampling), (), 8, 0)
                             for i in range(96)])
        res = engine.verify([[draft]] * 96, tokens=[11] * 96)
        firsts += [v.tokens[0] for v in res]
    assert set(firsts) <= set(support), set(firsts) - set(support)
    counts = [firsts.count(t) for t in support]
    assert _chi2(counts, p) < CHI2_999[5], (counts, p)
    assert support[0] == biased and 0.2 < counts[0] / len(firsts) < 0.95  # the draft accepted and rejected


def test_penalties_and_logprobs_see_exactly_the_verified_tokens(model):
    """Frequency/presence penalties count only emitted tokens (the draft's rejected tail never), and each
    emitted token's log-probability is the one plain decoding reports for it."""
    s = Sampling(frequency_penalty=0.7, presence_penalty=0.3, logprobs=True, top_logprobs=2)
    plain_engine = RankEngine(model, CONTEXT)
    plain_engine.prefill("s0", PROMPTS[0], s, (), 20)
    tokens, logprobs = [], []
    for _ in range(12):
        tokens += plain_engine.step()
        logprobs.append(plain_engine.get("s0").last_logprob)
    engine = RankEngine(model, CONTEXT)
    engine.prefill("s0", PROMPTS[0], s, (), 20)
    oracle, got, got_lp = Oracle(tokens, 3, 1), [], []
    while len(got) < 12:
        draft = oracle.propose(len(got))
        seq = engine.get("s0")
        seen = []
        orig = seq.recorded

        def spy(token, orig=orig, seq=seq):
            orig(token)
            seen.append(seq.last_logprob)
        seq.recorded = spy
        (v,) = engine.verify([draft])
        seq.recorded = orig
        got += v.tokens
        got_lp += seen
    assert got[:12] == tokens
    for (a, top_a), (b, top_b) in zip(got_lp[:12], logprobs):
        assert abs(a - b) < 1e-4 and [t for t, _ in top_a] == [t for t, _ in top_b]
    counts = engine.get("s0").processor.counts
    assert counts.sum().item() == len(got) + 1  # the prefill's first token + every emitted one


def test_a_stop_inside_the_accepted_run_ends_the_sequence_there(model):
    s = Sampling(frequency_penalty=2.0)
    plain = _plain(model, PROMPTS[:1], [30], s)["s0"]
    at = next(j for j in range(3, 8) if plain[j] not in plain[1:j])  # a token new at position `at`
    eos = plain[at]
    engine = RankEngine(model, CONTEXT)
    engine.prefill("s0", PROMPTS[0], s, (eos,), 30)
    (v,) = engine.verify([plain[1:8]])  # all seven right
    assert v.tokens == plain[1:at + 1] and v.accepted == 7
    seq = engine.get("s0")
    assert seq.reason and seq.session.position == len(PROMPTS[0]) + at
    # max_tokens: the draft is clamped so no token is emitted past it
    engine = RankEngine(model, CONTEXT)
    engine.prefill("s0", PROMPTS[0], s, (), 3)
    assert engine.clamp_draft("s0", plain[1:8]) == plain[1:2]
    (v,) = engine.verify([plain[1:8]])
    assert v.tokens == plain[1:3] and engine.get("s0").reason


def test_a_batch_compacts_the_left_padding_rollbacks_leave(model, monkeypatch):
    """Rows that take turns rejecting a whole draft both gather left padding (3 positions a step): the
    cache is compacted once every row holds PAD_SLACK (here 4) and a quarter of the write
    index, and decoding goes on equal to plain decoding."""
    monkeypatch.setattr(batch_mod, "PAD_SLACK", 4)
    s = Sampling(frequency_penalty=2.0)
    plain = _plain(model, PROMPTS[:2], [40, 40], s)
    engine = RankEngine(model, CONTEXT)
    for i, p in enumerate(PROMPTS[:2]):
        engine.prefill(f"s{i}", p, s, (), 40)
    got = {u: [plain[u][0]] for u in ("s0", "s1")}
    for step in range(8):
        drafts = []
        for i, u in enumerate(("s0", "s1")):
            n = len(got[u])
            right = plain[u][n:n + 3]
            drafts.append(right if (step + i) % 2 else [(t + 1) % VOCAB for t in right])
        for u, v in zip(engine.batch.uids, engine.verify(drafts)):
            got[u] += v.tokens
        c = engine.batch._cache[0]
        assert min(c.left_padding.tolist()) < max(4, c._idx // 4), step  # the rule holds after every step
    assert engine.batch.compactions >= 1
    for u in got:
        assert got[u] == plain[u][:len(got[u])]


def test_a_model_whose_caches_cannot_roll_back_is_refused_in_one_line():
    from mlx_lm.models import gpt_oss

    from mlxcluster.model.synthetic import TINY

    m = gpt_oss.Model(gpt_oss.ModelArgs.from_dict(TINY["gpt_oss"]))
    engine = RankEngine(m, CONTEXT)
    assert engine.speculative_error and "\n" not in engine.speculative_error
    assert "RotatingKVCache" in engine.speculative_error
    with pytest.raises(ValueError, match="RotatingKVCache cannot"):
        engine.verify([])


def test_verify_between_lookahead_and_compiled_steps_equals_plain_decoding(model):
    """World size 1's shape: a lone greedy sequence decoding by compiled lookahead steps, a verify step
    in between now and then (the queued lookahead step withdrawn first, the compiled step's static
    buffers handed back and taken again): the tokens are plain decoding's."""
    plain = _plain(model, PROMPTS[:1], [30])["s0"]
    engine = RankEngine(model, CONTEXT, compile_decode=True)
    got = [engine.prefill("s0", PROMPTS[0], Sampling(), (), 30)]
    oracle = Oracle(plain, 3, 2)
    while not engine.get("s0").reason:
        if len(got) % 3:
            got += engine.step(lookahead=True)
        else:
            (v,) = engine.verify([oracle.propose(len(got))])
            got += v.tokens
    engine.settle()
    assert got == plain and engine._compiled is not None


# --------------------------------------------------------------------------- a rank N, through frames
def test_a_follower_verifies_drafts_from_plans_in_lockstep_with_rank_0(model):
    """Rank 0 verifies (clamped drafts, the stop rule) and sends each step as a plan: decode entries with
    their drafts, the next plan the kept counts (and the leaves of stopped sequences).  The follower
    (rank N, no sampling) holds exactly rank 0's KV caches after every plan; bad plans are refused
    whole: no kept counts after a verify step, counts without one, a draft past the context."""
    from mlxcluster.control.follower import Follower, PlanRejected
    from mlxcluster.protocol import frames as fr

    s = Sampling(frequency_penalty=2.0)
    plain = _plain(model, PROMPTS, MAX_TOKENS, s)
    rank0 = RankEngine(model, CONTEXT)
    follower = Follower(model, rank=1, vocab_size=VOCAB, context_length=CONTEXT)
    joins = [fr.prompt_tokens(f"s{i}", p, n) for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))]
    got = {f"s{i}": [rank0.prefill(f"s{i}", p, s, (), n)] for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))}
    list(follower.run(fr.step_plan(joins=joins)))
    drafters = {u: Oracle(plain[u], 4, i) for i, u in enumerate(plain)}
    kept, plans = [], 0
    while rank0.batch.uids or kept:
        leaves = [u for u in rank0.batch.uids if rank0.get(u).reason]
        for u in leaves:
            rank0.remove(u)
        uids = rank0.batch.uids
        drafts = [rank0.clamp_draft(u, drafters[u].propose(len(got[u]))) for u in uids]
        decode = [(u, rank0.get(u).session.position, rank0.get(u).token, d) for u, d in zip(uids, drafts)]
        frame = fr.step_plan(leaves=[fr.session_stop(u) for u in leaves], decode=decode, kept=kept)
        if kept:
            bare = fr.step_plan(leaves=[fr.session_stop(u) for u in leaves], decode=decode)
            with pytest.raises(PlanRejected, match="kept counts"):
                follower.check(bare)
        replies = list(follower.run(frame))
        assert all(r.ok for r in replies), replies
        plans += 1
        if not uids:
            break
        res = rank0.verify(drafts)
        for u, v in zip(uids, res):
            got[u] += v.tokens
        kept = [len(v.tokens) for v in res] if any(drafts) else []  # no drafts: a plain step there
        if kept:
            follower.check(fr.step_plan(kept=kept))  # the counts fit the step it ran
    assert got == plain and plans > 5
    assert follower.engine.sequences == {} and rank0.sequences == {}


def test_a_follower_keeps_rank_0s_kv_after_a_commit(model):
    """After a verify plan and the kept counts, the follower's batch cache is rank 0's (rows, padding,
    write index, K/V); counts without a verify step and a draft past the context are refused."""
    from mlxcluster.control.follower import Follower, PlanRejected
    from mlxcluster.protocol import frames as fr

    rank0 = RankEngine(model, CONTEXT)
    follower = Follower(model, rank=1, vocab_size=VOCAB, context_length=CONTEXT)
    firsts = [rank0.prefill(f"s{i}", p, Sampling(), (), 40) for i, p in enumerate(PROMPTS)]
    list(follower.run(fr.step_plan(joins=[fr.prompt_tokens(f"s{i}", p, 40) for i, p in enumerate(PROMPTS)])))
    drafts = [[firsts[0], 9, 9], [], [5]]
    decode = [(u, rank0.get(u).session.position, t, d) for u, t, d in zip(rank0.batch.uids, firsts, drafts)]
    with pytest.raises(PlanRejected, match="no verify step awaits"):  # counts without a verify step
        follower.check(fr.step_plan(kept=[1, 1, 1]))
    e = decode[0]
    with pytest.raises(PlanRejected, match="past the context"):
        follower.check(fr.step_plan(decode=[(e[0], e[1], e[2], [1] * (CONTEXT - e[1] - 1))] + decode[1:]))
    follower.check(fr.step_plan(decode=[(e[0], e[1], e[2], [1] * (CONTEXT - e[1] - 2))] + decode[1:]))
    res = rank0.verify(drafts)
    list(follower.run(fr.step_plan(decode=decode)))
    assert follower.engine.uncommitted == 4
    list(follower.run(fr.step_plan(kept=[len(v.tokens) for v in res])))
    a, b = rank0.batch._cache[0], follower.engine.batch._cache[0]
    mx.eval(a.keys, b.keys, a.left_padding, b.left_padding)
    assert a.left_padding.tolist() == b.left_padding.tolist() and a._idx == b._idx
    assert mx.allclose(a.keys[..., :a._idx, :], b.keys[..., :b._idx, :]).item()
    assert [s.position for s in rank0.batch.sessions] == [s.position for s in follower.batch.sessions]
