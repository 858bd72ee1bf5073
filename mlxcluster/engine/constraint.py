"""Constrained decoding: a grammar's token mask on one sequence's logits.

The grammar library is llguidance (github.com/guidance-ai/llguidance, the
engine behind vLLM's and SGLang's ``guidance`` backend): a grammar is compiled
lazily while decoding (no per-schema index to build first), it handles
byte-level BPE vocabularies through its Hugging Face tokenizer adapter, and its
mask costs ~0.03 ms per token for a 49152-token vocabulary here (BENCHMARKS.md,
"Issue 15").  outlines-core was measured too (a DFA index built per schema
before the first token); xgrammar needs PyTorch and Triton on Linux.

* :func:`json_grammar` -- OpenAI's ``response_format`` as an llguidance grammar
  (a JSON string, carried in ``Sampling.grammar``);
* :func:`check_grammar` -- validate one against a tokenizer (the provider: 400 on error);
* :class:`Constraint` -- one sequence's matcher on rank 0: masks the logits of
  the next token, consumes the token drawn.

A constrained sequence (like every sequence) is sampled by rank 0 only and
decodes without lookahead: its next mask depends on the token just
drawn, which must be on the host first.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

__all__ = ["Constraint", "GrammarError", "check_grammar", "check_resume", "json_grammar", "ll_tokenizer"]

#: compact JSON (no free whitespace): a greedy model cannot loop on blanks
_JSON_DEFAULTS = {"whitespace_flexible": False}

_TOKENIZERS: Dict[Tuple[int, int, Tuple[int, ...]], Any] = {}


class GrammarError(ValueError):
    """A grammar (a JSON schema) llguidance cannot compile; the message is one line."""


def json_grammar(schema: Optional[Dict[str, Any]] = None) -> str:
    """The llguidance grammar of JSON text: any JSON object (``schema`` ``None``: OpenAI's
    ``json_object`` mode) or a value valid against the JSON Schema ``schema`` (``json_schema``
    mode).

    Returns:
        The grammar as a JSON string (llguidance's ``TopLevelGrammar``).

    Raises:
        GrammarError: ``schema`` is not a JSON Schema llguidance supports.
    """
    import llguidance

    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                            defaults=_JSON_DEFAULTS)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise GrammarError(f"invalid JSON schema: {str(exc).splitlines()[0][:300]}") from None


def ll_tokenizer(tokenizer, n_vocab: int, eos_token_ids: Iterable[int]):
    """llguidance's view of a Hugging Face ``tokenizer`` for logits of ``n_vocab`` tokens ending
    with any of ``eos_token_ids`` (built once per tokenizer: ~0.3 s for 49152 tokens)."""
    import llguidance.hf

    eos = tuple(sorted(int(t) for t in eos_token_ids))
    key = (id(tokenizer), int(n_vocab), eos)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=int(n_vocab),
                                                        eos_token=list(eos) if eos else None)
    return _TOKENIZERS[key]


def check_grammar(grammar: str, tokenizer, n_vocab: int, eos_token_ids: Iterable[int]) -> None:
    """Raises GrammarError unless llguidance accepts ``grammar`` for this tokenizer."""
    import llguidance

    try:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, ll_tokenizer(tokenizer, n_vocab, eos_token_ids))
    except (ValueError, TypeError, RuntimeError) as exc:
        is_error, messages = True, [str(exc)]
    if is_error:
        message = messages[0] if messages else ""
        raise GrammarError(f"invalid grammar: {message.splitlines()[0][:300] if message else 'rejected'}")


def check_resume(grammar: str, tokenizer, n_vocab: int, eos_token_ids: Iterable[int], tokens) -> None:
    """Check that an answer may start with ``tokens`` (int ids: a resumed request's) under
    ``grammar`` for logits of ``n_vocab`` tokens (a matcher consumes them; ~ms).

    Raises:
        GrammarError: the grammar does not compile, or refuses one of ``tokens`` (one line).
    """
    Constraint(tokenizer, grammar, eos_token_ids).resume(tokens, n_vocab)


class Constraint:
    """One sequence's grammar matcher (llguidance ``LLMatcher``).

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        grammar: an llguidance grammar (:func:`json_grammar`).
        eos_token_ids: the tokens that end the sequence; once the grammar is complete only
            these are allowed.

    Use: ``logits = constraint(logits)`` before sampling, ``constraint.consume(token)`` once
    the drawn token is known.
    """

    def __init__(self, tokenizer, grammar: str, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.eos = tuple(eos_token_ids)
        self.matcher = None
        self._bitmask = None
        self._resumed: list = []  # a resumed answer's tokens, consumed once the matcher starts (resume)

    def _start(self, n_vocab: int) -> None:
        import llguidance
        import llguidance.numpy as lnp

        self.matcher = llguidance.LLMatcher(ll_tokenizer(self.tokenizer, n_vocab, self.eos), self.grammar)
        if self.matcher.is_error():
            raise GrammarError(f"invalid grammar: {self.matcher.get_error()}")
        self._bitmask = lnp.allocate_token_bitmask(1, n_vocab)
        resumed, self._resumed = self._resumed, []
        self._consume_resumed(resumed)

    def _consume_resumed(self, tokens) -> None:
        for i, token in enumerate(tokens):
            if self.matcher.is_stopped() or not self.matcher.consume_token(int(token)):
                raise GrammarError(f"resume_token_ids[{i}] (token {int(token)}) does not follow the grammar")

    def resume(self, tokens, n_vocab: int = 0) -> None:
        """Lossless failover: the answer starts with ``tokens`` (int ids, sampled by an earlier
        group): the matcher consumes them before the first mask -- now where ``n_vocab`` (the
        logits' width) is given, else when the first logits come (:meth:`allowed`).

        Raises:
            GrammarError: (``n_vocab`` given) a token the grammar does not allow there, or a token
                after the grammar completed; one line naming its index.
        """
        self._resumed = [int(t) for t in tokens]
        if n_vocab > 0:
            self._start(n_vocab)

    def allowed(self, n_vocab: int):
        """The tokens the grammar allows next: a numpy bool ``(n_vocab,)`` array."""
        import numpy as np
        import llguidance.numpy as lnp

        if self.matcher is None:
            self._start(n_vocab)
        lnp.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        # bit j of 32-bit word i is token 32 i + j (little-endian words)
        return np.unpackbits(self._bitmask[0].view(np.uint8), bitorder="little")[:n_vocab].astype(bool)

    def __call__(self, logits):
        """``logits`` ``(vocab,)`` with every token the grammar forbids set to ``-inf``."""
        import mlx.core as mx

        allowed = mx.array(self.allowed(logits.shape[-1]))
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))

    def consume(self, token: int) -> None:
        """Advance past the drawn ``token`` (an EOS after the grammar completed included)."""
        if self.matcher is not None and not self.matcher.is_stopped():
            self.matcher.consume_token(int(token))
