"""Quantized KV caches (``--kv-bits 4|8``, ``--kv-group-size``; ``mlxcluster/engine/kvquant.py``; issue 32
part 2), in-process: a continuous batch of quantized caches (joins into free rows and by ``extend``,
leaves, speculative rollbacks) decodes each sequence as mlx-lm's ``QuantizedKVCache`` decodes it alone;
8-bit K/V answer as full precision on the real model for a long common prefix, 4-bit runs; the prefix
cache, a ``--local-decode`` handoff, a PD stream and the disk prompt cache carry the packed K/V (fewer
bytes) and refuse another KV format; the CLI refuses bad widths and group sizes in one line.

The engines' tests run on a random tiny Llama whose ``head_dim`` is 64 (the default group size must
divide it; ``tinymodel``'s own is 16).  TP=3 against TP=1 at 8 bits, which needs rank processes, is
``tests/test_long_context.py``'s."""

from __future__ import annotations

import os
import shutil

import pytest

mx = pytest.importorskip("mlx.core")

import tinymodel  # noqa: E402
from mlx_lm.models.cache import QuantizedKVCache  # noqa: E402

from mlxcluster.engine.decode import RankEngine  # noqa: E402
from mlxcluster.engine.sampling import Sampling, greedy  # noqa: E402
from mlxcluster.engine.session import ShardSession  # noqa: E402
from mlxcluster.engine import kvquant as KQ  # noqa: E402
from mlxcluster.engine.handoff import Expected, HandoffError, KvStream, assemble, identity_of, kv_frames, \
    prompt_hash  # noqa: E402
from mlxcluster.model.layout import LayerRange  # noqa: E402

HEAD_DIM = 64
CONTEXT = 1024
#: |delta log-probability| allowed between a batched row and the sequence decoded alone (float32: other
#: matrix shapes, the same quantized K/V)
LOGPROB_TOL = 1e-4


def tiny(bits: int = 0, group_size: int = 64):
    """The tiny random Llama with ``head_dim`` 64 (float32), its caches in the given KV format."""
    from mlxcluster.model.tp import build_model

    config, weights = tinymodel.tiny_llama(seed=3, head_dim=HEAD_DIM)
    model = build_model(config, weights, None, "float32")
    KQ.set_format(model, KQ.kv_format(bits or None, group_size, HEAD_DIM))
    return model


@pytest.fixture(scope="module")
def q8():
    return tiny(8)


def prompt(n: int, seed: int = 0) -> list:
    return [(11 * i + 29 * seed + 5) % 256 for i in range(n)]


def alone(model, ids, n, bits=8, group_size=64):
    """Greedy tokens and their log-probabilities of ``ids`` decoded on mlx-lm's own ``QuantizedKVCache``."""
    cache = [QuantizedKVCache(group_size, bits) for _ in model.layers]
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    tokens, lps = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits)
        t = int(mx.argmax(logits).item())
        tokens.append(t)
        lps.append(float(lp[t].item()))
        logits = model(mx.array([[t]]), cache=cache)[0, -1]
    return tokens, lps


LOGPROBS = Sampling(logprobs=True)


def test_a_quantized_batch_decodes_each_sequence_as_mlx_lms_quantized_cache_alone(q8):
    """Continuous batching at 8 bits: two prompts prefilled together, a third joining by ``extend``, a
    leave, a fourth written into the free row, a fifth and sixth joining together: each row's greedy tokens
    and log-probabilities are those of the sequence decoded alone on mlx-lm's ``QuantizedKVCache``."""
    prompts = {u: prompt(12 + 7 * i, seed=i) for i, u in enumerate("abcdef")}
    eng = RankEngine(q8, CONTEXT)
    got = {u: ([], []) for u in prompts}

    def record(uids, tokens):
        for u, t in zip(uids, tokens):
            got[u][0].append(t)
            got[u][1].append(eng.get(u).last_logprob[0])

    def steps(n):
        for _ in range(n):
            uids = eng.batch.uids
            record(uids, eng.step())

    record("ab", eng.prefill_many([(u, prompts[u], LOGPROBS, (), 100, 0) for u in "ab"]))
    steps(3)
    record("c", [eng.prefill("c", prompts["c"], LOGPROBS, (), 100)])  # a longer prompt: extend
    steps(3)
    eng.remove("a")
    record("d", [eng.prefill("d", prompts["d"][:6], LOGPROBS, (), 100)])  # fits left of the write index
    prompts["d"] = prompts["d"][:6]
    assert eng.batch.rows_reused == 1
    steps(2)
    eng.remove("b")
    record("ef", eng.prefill_many([(u, prompts[u], LOGPROBS, (), 100, 0) for u in "ef"]))
    steps(4)
    assert all(type(c) is KQ.BatchQuantizedKVCache for c in eng.batch._cache)
    for u, (tokens, lps) in got.items():
        want, want_lps = alone(q8, prompts[u], len(tokens))
        assert tokens == want, u
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < LOGPROB_TOL, u
    for u in "cde":  # down to one: its row extracted into a cache of its own, decoding on
        eng.remove(u)
    steps(3)
    assert type(eng.batch.sessions[0].cache[0]) is KQ.SequenceQuantizedKVCache
    assert got["f"][0] == alone(q8, prompts["f"], len(got["f"][0]))[0]


@pytest.mark.parametrize("bits", [8, 4])
def test_speculative_rollbacks_of_a_quantized_batch_keep_the_greedy_tokens(bits):
    """Verify steps over a quantized batch (drafts partly wrong: rows roll their rejected positions into
    their left padding) give the plain greedy tokens of each sequence."""
    model = tiny(bits)
    prompts = [prompt(20, seed=7), prompt(9, seed=8)]
    plain = RankEngine(model, CONTEXT)
    want = {u: [t] for u, t in zip("xy", plain.prefill_many([(u, p, Sampling(), (), 100, 0)
                                                              for u, p in zip("xy", prompts)]))}
    for _ in range(12):
        for u, t in zip(plain.batch.uids, plain.step()):
            want[u].append(t)
    eng = RankEngine(model, CONTEXT)
    assert eng.speculative_error is None
    got = {u: [t] for u, t in zip("xy", eng.prefill_many([(u, p, Sampling(), (), 100, 0)
                                                          for u, p in zip("xy", prompts)]))}
    for i in range(10):  # bounded: each verify step emits at least one token per row
        if min(len(v) for v in got.values()) >= 10:
            break
        drafts = []
        for u in eng.batch.uids:
            n = len(got[u])
            right = want[u][n:n + 3]
            drafts.append(right[:1 + i % 2] + [(right[-1] + 1) % 256] if right else [])  # then one wrong token
        for u, r in zip(eng.batch.uids, eng.verify(drafts)):
            got[u] += r.tokens
    for u in "xy":
        n = min(len(got[u]), len(want[u]))
        assert n >= 10 and got[u][:n] == want[u][:n]


def test_the_prefix_cache_holds_and_gives_quantized_kv(q8):
    """A second prompt sharing 40 positions with the first takes them from the prefix cache (packed
    triples) and decodes as a cold prefill; so do two prompts prefilled together, one with a prefix."""
    base = prompt(48, seed=1)
    later = base[:40] + prompt(10, seed=2)
    cold = RankEngine(q8, CONTEXT)
    want = [cold.prefill("cold", later, Sampling(), (), 100)] + [cold.step()[0] for _ in range(6)]
    eng = RankEngine(q8, CONTEXT)
    eng.prefill("a", base, Sampling(), (), 100)
    eng.remove("a")
    (held,) = eng.prefix.entries.values()
    assert KQ.quantized(held[0][0]) and held[0][0][0].dtype == mx.uint32
    assert eng.prefix_match(later) == 40
    got = [eng.prefill("b", later, Sampling(), (), 100, cached=40)] + [eng.step()[0] for _ in range(6)]
    assert got == want and eng.prefix.hit_positions == 40
    eng.remove("b")
    other = prompt(17, seed=4)
    firsts = eng.prefill_many([("c", later, Sampling(), (), 100, eng.prefix_match(later)),
                               ("d", other, Sampling(), (), 100, 0)])
    assert eng.prefix.hit_positions > 40 and firsts[0] == want[0]


def _cache_of(model, ids):
    """A session of ``model`` holding the K/V of ``ids`` (a stage's cache before its handoff)."""
    session = ShardSession(model, "s")
    session.prefill(ids)
    return session


def _identity(bits=0, group_size=0, heads=3):
    return identity_of("sha256:tiny", "float32", heads, HEAD_DIM, "float32", bits, group_size)


def test_a_handoff_carries_the_packed_kv_and_refuses_another_kv_format(q8):
    """``--local-decode``'s handoff of a quantized cache: the packed triples travel (8 bits: under 0.35x the
    float32 bytes), install into a fresh session, and decode as the sender would; a receiver of another KV
    format refuses it in one line naming the flags."""
    ids = prompt(70, seed=3)
    layers = LayerRange(0, len(q8.layers) - 1, output=True)
    frames8 = list(kv_frames(_cache_of(q8, ids).cache, layers, ids, _identity(8, 64), "e"))
    full = tiny(0)
    frames32 = list(kv_frames(_cache_of(full, ids).cache, layers, ids, _identity(), "e"))
    bytes8, bytes32 = frames8[-1].total_bytes, frames32[-1].total_bytes
    assert bytes32 == len(q8.layers) * 2 * 3 * HEAD_DIM * 4 * len(ids)
    assert bytes8 == len(q8.layers) * 2 * 3 * (HEAD_DIM + 2 * 4) * len(ids)  # codes + a scale and a bias per group
    assert bytes8 < 0.35 * bytes32
    assert KQ.bytes_per_token(q8, HEAD_DIM, 4) * len(ids) == bytes8  # what the loaded event reports

    want = Expected(1, layers, len(ids), prompt_hash(ids), _identity(8, 64), "e")
    kv = assemble(frames8, want)
    receiver = ShardSession(q8, "r")
    receiver.position = len(ids)
    receiver.install(kv)
    sender = _cache_of(q8, ids)
    for a, b in zip(receiver.cache, sender.cache):
        for x, y in zip(a.keys_and_values()[0], b.keys_and_values()[0]):
            assert mx.array_equal(x, y)
    x = mx.array([[ids[-1]]], dtype=mx.int32)
    assert mx.array_equal(receiver.forward(x), sender.forward(x))

    for frames, mine, words in ((frames8, _identity(), "8-bit K/V in groups of 64"),
                                (frames8, _identity(4, 64), "8-bit"), (frames8, _identity(8, 32), "groups of 64"),
                                (frames32, _identity(8, 64), "full-precision")):
        with pytest.raises(HandoffError, match="--kv-bits") as err:
            assemble(frames, Expected(1, layers, len(ids), prompt_hash(ids), mine, "e"))
        assert words in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError):  # and the one install refuses K/V of another format outright
        s = ShardSession(full, "f")
        s.position = len(ids)
        s.install(kv)


def test_a_pd_stream_of_quantized_kv_installs_and_decodes_as_a_local_prefill():
    """The prefill group's layer-by-layer stream (``engine/pd.py``) at 8 bits, to two subscribers of a
    decode group of 3 KV heads split 2 + 1 (each gets its heads' packed K/V) -- equal to what one rank
    quantizes for those heads -- and a full-precision subscriber refuses it."""
    from mlxcluster.engine.pd import prefill_stream

    model = tiny(8)
    ids = prompt(40, seed=5)
    subs = [(0, 2), (2, 1)]
    streams = [KvStream("u", Expected(0, LayerRange(0, len(model.layers) - 1, output=True), len(ids),
                                      prompt_hash(ids), _identity(8, 64, heads=n), ""), head0=h0)
               for h0, n in subs]
    refusing = KvStream("u", Expected(0, LayerRange(0, len(model.layers) - 1, output=True), len(ids),
                                      prompt_hash(ids), _identity(0, 0, heads=1), ""), head0=2)

    def emit(s, frame):
        streams[s].offer(frame)
        if s == 1:
            refusing.offer(frame)

    def identity(n):
        return _identity(8, 64, heads=n)

    first = prefill_stream(model, ids, greedy, subs, identity, emit, "u")
    local = _cache_of(model, ids)
    for (h0, n), stream in zip(subs, streams):
        kv, token = stream.result()
        assert token == first
        for layer, (k, v) in kv.items():
            mine = local.cache[layer].keys_and_values()
            for got, own in ((k, mine[0]), (v, mine[1])):
                for a, b in zip(got, own):
                    assert mx.array_equal(a, b[:, h0:h0 + n])
    with pytest.raises(HandoffError, match="kv-bits"):
        refusing.result()


def _disk(root, bits, group_size=0, min_tokens=32):
    from mlxcluster.engine.prompt_disk import DiskPrompts, Identity

    ident = Identity(model_digest="sha256:tiny", weights="float32", rank=0, world_size=1, topology="",
                     n_layers=2, n_kv_heads=3, head_dim=HEAD_DIM, kv_dtype="float32", kv_bits=bits,
                     kv_group_size=group_size)
    return DiskPrompts(str(root), 2**30, ident, min_tokens=min_tokens)


def _run(eng, uid, ids, n=6):
    out = [eng.prefill(uid, ids, Sampling(), (), 100, eng.prefix_match(ids))] + [eng.step()[0] for _ in range(n - 1)]
    eng.remove(uid)
    return out


@pytest.mark.parametrize("written,read", [(8, 0), (0, 8), (8, 4)])
def test_a_disk_prompt_cache_of_another_kv_format_is_refused(q8, tmp_path, written, read):
    """A prompt written at one KV format is taken from disk at that format (packed arrays, the same tokens as
    a cold prefill) and refused at another -- never loaded, not even from this rank's own directory."""
    base = prompt(60, seed=6)
    later = base[:50] + prompt(8, seed=9)
    writer = tiny(written)
    disk = _disk(tmp_path, written, 64 if written else 0)
    eng = RankEngine(writer, CONTEXT)
    eng.attach_disk(disk)
    _run(eng, "a", base)
    (name,) = [n for n in os.listdir(disk.dir) if n.endswith(".safetensors")]
    again = RankEngine(writer, CONTEXT)
    again.attach_disk(_disk(tmp_path, written, 64 if written else 0))
    assert _run(again, "b", later) == _run(RankEngine(writer, CONTEXT), "cold", later)
    assert again.prefix.disk_hit_positions == 50

    mine = _disk(tmp_path, read, 64 if read else 0)
    assert mine.keys() == [] and mine.dir != disk.dir  # another identity: another directory
    shutil.copy(os.path.join(disk.dir, name), os.path.join(mine.dir, name))
    mine = _disk(tmp_path, read, 64 if read else 0)
    assert mine.refused == 1 and mine.keys() == []
    assert os.path.exists(os.path.join(mine.dir, name))  # another identity's file is never deleted
    reader = RankEngine(tiny(read), CONTEXT)
    reader.attach_disk(mine)
    assert reader.prefix_match(later) == 0


@pytest.mark.slow  # 6 s of real-model steps: the fast tier keeps the tiny model's checks
def test_eight_bit_kv_answers_as_full_precision_on_the_real_model(real_model_path):
    """SmolLM2-135M, greedy, two prompts decoded as one batch for 12 tokens: 8-bit K/V keep a long common
    prefix with full-precision K/V; 4-bit K/V run (their agreement is the benchmark's to
    measure: ``benchmarks/bench_kv_quant.py``).  Short: a real-model step is ~0.1 s on this machine."""
    from mlxcluster.model.loader import read_model, tokenizer_of
    from mlxcluster.model.tp import build_model

    source = read_model(real_model_path)
    tokenizer, _ = tokenizer_of(source)
    model = build_model(source.config, dict(source.weights), source.quantization, "float32")
    ids = [list(tokenizer.encode(t)) for t in ("The capital of France is", "def fibonacci(n):")]

    def answers(bits, n):
        KQ.set_format(model, KQ.kv_format(bits or None, 64, 64))
        eng = RankEngine(model, CONTEXT)
        out = {str(i): [t] for i, t in enumerate(eng.prefill_many([(str(i), p, Sampling(), (), 100, 0)
                                                                     for i, p in enumerate(ids)]))}
        for _ in range(n - 1):
            for u, t in zip(eng.batch.uids, eng.step()):
                out[u].append(t)
        return [out[str(i)] for i in range(len(ids))]

    full, eight, four = answers(0, 12), answers(8, 12), answers(4, 2)
    for f, e in zip(full, eight):
        common = next((i for i, (a, b) in enumerate(zip(f, e)) if a != b), len(f))
        assert common >= 10, (common, tokenizer.decode(f), tokenizer.decode(e))
    assert all(len(a) == 2 for a in four)


def test_kv_format_rules_and_bytes():
    assert KQ.kv_format(None) == KQ.FULL and KQ.kv_format(8) == KQ.KvFormat(8, 64)
    assert str(KQ.kv_format(4, 32, 64)) == "4-bit K/V in groups of 32"
    for bits, group, dim, words in ((3, 64, 64, "--kv-bits 3"), (8, 48, 64, "--kv-group-size 48"),
                                    (8, 128, 64, "does not divide")):
        with pytest.raises(ValueError, match=words):
            KQ.kv_format(bits, group, dim)
    # SmolLM2's 3 KV heads of 64, float32: 768 B of keys per position, 216 at 8 bits, 120 at 4
    assert [KQ.kv_format(b).position_bytes(3, 64, 4) for b in (None, 8, 4)] == [768, 216, 120]


def test_cli_refuses_bad_kv_options_in_one_line(real_model_path):
    from typer.testing import CliRunner

    from mlxcluster.cli import app

    def exit_of(*args):
        result = CliRunner().invoke(app, list(args))
        return result.exit_code, (result.output or "").strip().splitlines()

    for command in (["generate", "hi"], ["serve"], ["join"]):
        code, lines = exit_of(*command, "--kv-bits", "3")
        assert code == 2 and len(lines) == 1 and "--kv-bits 3" in lines[0], (command, lines)
    code, lines = exit_of("generate", "hi", "--kv-group-size", "32")
    assert code == 2 and len(lines) == 1 and "needs --kv-bits" in lines[0]
    # SmolLM2's head_dim is 64: a group of 128 does not divide it (checked before any rank starts)
    code, lines = exit_of("generate", "hi", "--model", real_model_path, "--kv-bits", "8", "--kv-group-size", "128")
    assert code == 2 and len(lines) == 1 and "does not divide" in lines[0] and "64" in lines[0]


def test_a_join_formation_carries_its_coordinators_kv_format_to_every_rank():
    """``join --kv-bits``: the coordinator's format travels in ``Bootstrap`` (fields 18, 19) and becomes
    every rank's ``--kv-bits`` / ``--kv-group-size``."""
    from mlxcluster.cluster.membership import Formation, Member

    members = tuple(Member(r, f"n{r}", "127.0.0.1", 7000 + r, 8000 + r) for r in range(3))
    f = Formation("fid", "n0", "ring", members, kv_bits=8, kv_group_size=32)
    back = Formation.from_bootstrap(f.to_bootstrap(2))
    assert back == f and (back.kv_bits, back.kv_group_size) == (8, 32)
    assert Formation.from_bootstrap(Formation("fid", "n0", "ring", members).to_bootstrap(1)).kv_bits == 0


@pytest.mark.parametrize("bits", [0, 8])
def test_kv_bytes_per_position_is_per_position_not_per_growth_step(bits):
    """Admission's KV bytes per position (``RankEngine.kv_bytes_per_position``: what ``kv_refusal`` and the
    batch's KV budget multiply by) after a 5-token prompt is one position's keys and values over every
    layer -- not the 256-position growth step's bytes over 5 positions (~51x: a "Hi" as the first request
    made every 4K-token prompt after it "need 11,542 MiB"); the same alone and in a batch."""
    from mlxcluster.engine.decode import RankEngine
    from mlxcluster.engine.sampling import Sampling

    model = tiny(bits)
    c = tinymodel.TINY_CONFIG
    layers, heads = c["num_hidden_layers"], c["num_key_value_heads"]
    want = 2 * layers * KQ.kv_format(bits or None, 64, HEAD_DIM).position_bytes(heads, HEAD_DIM, 4)
    eng = RankEngine(model, CONTEXT)
    assert eng.kv_bytes_per_position() == 0.0  # nothing allocated yet
    eng.prefill("a", prompt(5), Sampling(), (), 100)
    assert eng.kv_bytes_per_position() == pytest.approx(want)
    eng.prefill("b", prompt(300, seed=1), Sampling(), (), 100)  # a batch of two rows
    eng.step()
    assert eng.kv_bytes_per_position() == pytest.approx(want)


def test_head_dim_of_a_config_reads_a_multimodal_text_config():
    """The KV format is checked against head_dim read from config.json -- a multimodal model's lives in
    ``text_config`` (Kimi K2.5, Qwen3.5: a rank of theirs failed with KeyError 'hidden_size' before)."""
    assert KQ.config_head_dim({"text_config": {"hidden_size": 128, "num_attention_heads": 4}}) == 32
    assert KQ.config_head_dim({"head_dim": 64, "hidden_size": 576, "num_attention_heads": 9}) == 64
    assert KQ.config_head_dim({}) == 0
