"""Batched prefill and prefix caching on the real model (SmolLM2-135M, float32) at TP=3 (MPI where
OpenMPI is installed: batching does not depend on the backend, and a ring TP=3 step costs ~5x an MPI one
here; the ring's TP=3 is checked by test_generate_real): prompts that arrive together are prefilled as one group on every rank
(``promptTokens.prefill_group``), starting from the system prompt's blocks in every rank's prefix
cache (``promptTokens.cached_prefix``), and each answer equals the same prompt's lone greedy answer
at TP=1 (prefilled from scratch)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxcluster.engine.prefix_cache import PREFIX_MIN_TOKENS
from mlxcluster.leader.generation import GenerationClient

pytestmark = pytest.mark.slow

QUESTIONS = ["Why is the sky blue?", "Name three rivers in Europe.", "Write a haiku about autumn.",
             "What is the capital of Japan?", "Describe a cat in two sentences.", "Explain what a tensor is.",
             "Give me a tip for learning to cook.", "Tell me a short story about a lighthouse."]
MAX_TOKENS = 16


def _lone_tp1(model_path, prompts):
    """Each prompt's greedy answer alone, in this process at TP=1."""
    from mlxcluster.engine.decode import RankEngine
    from mlxcluster.engine.sampling import Sampling
    from mlxcluster.model.loader import load_tokenizer, read_model
    from mlxcluster.model.tp import build_model

    src = read_model(model_path)
    model = build_model(src.config, src.weights, src.quantization, "float32")
    _, eos = load_tokenizer(model_path)
    out = []
    for prompt in prompts:
        engine = RankEngine(model, 2048)
        tokens = [engine.prefill("lone", prompt, Sampling(), eos, MAX_TOKENS)]
        while not engine.get("lone").reason:
            tokens += engine.step()
        out.append(tokens)
    return out


def test_prompts_arriving_together_are_prefilled_as_one_group_and_equal_tp1(tp3_group, real_model_path):
    """On the session's TP=3 group (its counters read before and after: other modules may have used it)."""
    client = GenerationClient(tp3_group.address, tp3_group.credentials)
    try:
        before = client.info()
        # a first request leaves the chat template's system prompt in every rank's prefix cache
        warm = client.generate("Hello!", chat=True, max_tokens=2)
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            results = list(pool.map(lambda q: client.generate(q, chat=True, max_tokens=MAX_TOKENS), QUESTIONS))
        info = client.info()
    finally:
        client.close()
    # the first request may be prefilled alone; the others queued meanwhile and went as groups
    assert info.batched_prompts - before.batched_prompts >= 2
    assert info.generated_tokens - before.generated_tokens == \
        len(warm.token_ids) + sum(len(r.token_ids) for r in results)
    # ... and each of the eight took at least the system prompt from there (rank N in step, or it refuses)
    assert info.cached_prompt_tokens - before.cached_prompt_tokens >= len(QUESTIONS) * PREFIX_MIN_TOKENS
    assert [r.token_ids for r in results] == _lone_tp1(real_model_path, [r.prompt_ids for r in results])
