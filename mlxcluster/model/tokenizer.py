"""Build a Hugging Face tokenizer from a GGUF file's tokenizer metadata.

A GGUF carries no ``tokenizer.json``; it stores the vocabulary under
llama.cpp's key names (``gguf-py/gguf/constants.py``, read by
``src/llama-vocab.cpp``):

    tokenizer.ggml.model           "gpt2" for byte-level BPE
    tokenizer.ggml.pre             pre-tokenizer name, e.g. "smollm", "llama-bpe"
    tokenizer.ggml.tokens          list[str], index = token id
    tokenizer.ggml.merges          list[str], "left right", index = merge rank
    tokenizer.ggml.token_type      int32 per token: 1 NORMAL, 2 UNKNOWN,
                                   3 CONTROL, 4 USER_DEFINED, 5 UNUSED, 6 BYTE
    tokenizer.ggml.{bos,eos,unknown,padding,eot,eom}_token_id
    tokenizer.ggml.add_bos_token / add_eos_token
    tokenizer.chat_template        jinja2 chat template

``build_tokenizer`` turns that into a ``transformers.PreTrainedTokenizerFast``
that splits text the way llama.cpp does (the per-pre-tokenizer regex lists
of ``llm_tokenizer_bpe`` in ``llama-vocab.cpp``), so the ids match what the
model was trained on.  Metadata values may be plain Python values, numpy
arrays or ``mx.array`` (as ``mx.load(path, return_metadata=True)`` gives).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from .gguf import metadata_value

__all__ = ["build_tokenizer", "eos_token_ids", "apply_chat", "apply_chat_messages", "PRE_TOKENIZER_REGEXES",
           "PRE_TOKENIZER_ALIASES", "streaming_detokenizer", "prime_detokenizer", "final_segment", "answer_tail"]

# llama.cpp token types (llama_token_type in include/llama.h).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Regex lists copied from llm_tokenizer_bpe's constructor in llama.cpp
# src/llama-vocab.cpp.  llama.cpp applies the regexes of a list one after the
# other, each splitting the pieces the previous one produced and keeping the
# unmatched text as pieces of its own -- exactly a sequence of
# ``pre_tokenizers.Split(..., behavior="isolated")``.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: llama.cpp pre-tokenizer type -> the regexes it applies, in order.
PRE_TOKENIZER_REGEXES: Dict[str, Tuple[str, ...]] = {
    # LLAMA_VOCAB_PRE_TYPE_DEFAULT (the `default:` branch)
    "default": (
        r"[\p{P}\$\+<=>\^~\|]+",
        _GPT2_REGEX,
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ),
    # LLAMA_VOCAB_PRE_TYPE_GPT2
    "gpt2": (_GPT2_REGEX,),
    # LLAMA_VOCAB_PRE_TYPE_SMOLLM (shared with STARCODER, REFACT, COMMAND_R, ...):
    # every digit on its own, then the GPT-2 regex.
    "smollm": (r"\p{N}", _GPT2_REGEX),
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3
    "llama3": (_LLAMA3_REGEX,),
    # LLAMA_VOCAB_PRE_TYPE_QWEN2
    "qwen2": (_QWEN2_REGEX,),
}

#: ``tokenizer.ggml.pre`` value -> key of PRE_TOKENIZER_REGEXES (the name
#: matching in ``llama_vocab::impl::load``; only the types supported here).
PRE_TOKENIZER_ALIASES: Dict[str, str] = {
    "default": "default",
    "gpt-2": "gpt2",
    "gpt2": "gpt2",  # not a llama.cpp name, accepted for convenience
    "phi-2": "gpt2",
    "smollm": "smollm",
    "starcoder": "smollm",
    "refact": "smollm",
    "command-r": "smollm",
    "codeshell": "smollm",
    "exaone": "smollm",
    "minerva-7b": "smollm",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "falcon3": "llama3",
    "falcon-h1": "llama3",
    "pixtral": "llama3",
    "dbrx": "llama3",
    "smaug-bpe": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "megrez": "qwen2",
    "stablelm2": "qwen2",
}

# llama.cpp sets ignore_merges (a whole pre-token that is in the vocabulary is
# emitted as one token, without running merges) and add_bos for these names.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral"}
_ADD_BOS_DEFAULT = set(_IGNORE_MERGES)

# Texts llama.cpp recognises as end-of-turn tokens (llama-vocab.cpp, EOG list).
_END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
)


def _token_id(metadata: Mapping[str, Any], key: str, n_tokens: int) -> Optional[int]:
    value = metadata_value(metadata, key)
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_tokens else None


def _pre_tokenizer(pre: str) -> Tuple[pre_tokenizers.PreTokenizer, bool]:
    kind = PRE_TOKENIZER_ALIASES.get(pre)
    if kind is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r} "
            f"(supported: {', '.join(sorted(PRE_TOKENIZER_ALIASES))})"
        )
    splits = [
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
        for regex in PRE_TOKENIZER_REGEXES[kind]
    ]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return pre_tokenizers.Sequence(splits + [byte_level]), pre in _IGNORE_MERGES


def build_tokenizer(metadata: Mapping[str, Any]):
    """Build the tokenizer a GGUF file describes.

    Args:
        metadata: GGUF metadata, e.g. the second value of
            ``mx.load(path, return_metadata=True)``.  Values may be Python
            values, numpy arrays or ``mx.array``.  Keys used are llama.cpp's
            ``tokenizer.ggml.*`` keys and ``tokenizer.chat_template``.

    Returns:
        transformers.PreTrainedTokenizerFast: a byte-level BPE tokenizer whose
        pre-tokenizer is the regex list llama.cpp uses for
        ``tokenizer.ggml.pre`` (``llm_tokenizer_bpe`` in ``src/llama-vocab.cpp``),
        with CONTROL (3) and UNKNOWN (2) tokens added as special tokens and
        USER_DEFINED (4) tokens as added tokens, so none of them is ever split;
        BOS prepended (EOS appended) only when ``tokenizer.ggml.add_bos_token``
        (``add_eos_token``) is true -- absent, llama.cpp's default for the
        pre-tokenizer is used; bos/eos/unk/pad tokens and ``chat_template``
        set.  ``save_pretrained(dir)`` writes files that
        ``transformers.AutoTokenizer`` and ``mlx_lm.utils.load_tokenizer`` read.

    Raises:
        ValueError: ``tokenizer.ggml.model`` is not ``"gpt2"`` (byte-level
            BPE); ``tokenizer.ggml.pre`` names a pre-tokenizer not supported
            here (see ``PRE_TOKENIZER_ALIASES``); tokens or merges are missing;
            the vocabulary has duplicate tokens; or BOS/EOS must be added but
            its id is missing.
    """
    from transformers import PreTrainedTokenizerFast

    model = metadata_value(metadata, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r} (supported: 'gpt2')")
    pre = metadata_value(metadata, "tokenizer.ggml.pre") or "default"  # llama.cpp: missing -> default
    pre_tokenizer, ignore_merges = _pre_tokenizer(str(pre))

    tokens = list(metadata_value(metadata, "tokenizer.ggml.tokens") or [])
    merges = list(metadata_value(metadata, "tokenizer.ggml.merges") or [])
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    if not merges:
        raise ValueError("GGUF metadata has no tokenizer.ggml.merges")
    n_tokens = len(tokens)
    token_types = list(metadata_value(metadata, "tokenizer.ggml.token_type") or [TOKEN_TYPE_NORMAL] * n_tokens)

    vocab: Dict[str, int] = {}
    for i, token in enumerate(tokens):
        token = token or f"[EMPTY_{i}]"  # as llama.cpp does
        if token in vocab:
            raise ValueError(f"duplicate token in GGUF vocabulary: {token!r} has ids {vocab[token]} and {i}")
        vocab[token] = i
        tokens[i] = token
    pairs: List[Tuple[str, str]] = []
    for merge in merges:
        cut = merge.find(" ", 1)  # llama.cpp splits at the first space after position 0
        if cut > 0:
            pairs.append((merge[:cut], merge[cut + 1 :]))

    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()

    special, user = [], []
    for token, token_type in zip(tokens, token_types):
        if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_TYPE_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(user)

    def token_of(key: str) -> Optional[str]:
        idx = _token_id(metadata, key, n_tokens)
        return None if idx is None else tokens[idx]

    bos = token_of("tokenizer.ggml.bos_token_id")
    eos = token_of("tokenizer.ggml.eos_token_id")
    unk = token_of("tokenizer.ggml.unknown_token_id")
    pad = token_of("tokenizer.ggml.padding_token_id")
    add_bos = bool(metadata_value(metadata, "tokenizer.ggml.add_bos_token", pre in _ADD_BOS_DEFAULT))
    add_eos = bool(metadata_value(metadata, "tokenizer.ggml.add_eos_token", False))
    if add_bos and bos is None:
        raise ValueError("tokenizer.ggml.add_bos_token is true, but tokenizer.ggml.bos_token_id is not set")
    if add_eos and eos is None:
        raise ValueError("tokenizer.ggml.add_eos_token is true, but tokenizer.ggml.eos_token_id is not set")

    # Post-processor: BOS / EOS per llama.cpp's add_bos / add_eos, as a
    # TemplateProcessing (the form transformers writes and reads back).
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=list(dict.fromkeys(specials))
    )

    kwargs: Dict[str, Any] = dict(
        tokenizer_object=backend,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
    )
    for name, token in (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)):
        if token is not None:
            kwargs[name] = token
    chat_template = metadata_value(metadata, "tokenizer.chat_template")
    if chat_template:
        kwargs["chat_template"] = chat_template
    tokenizer = PreTrainedTokenizerFast(**kwargs)
    if len(tokenizer) != n_tokens:  # every special/added token must be an existing id
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, GGUF vocabulary has {n_tokens}")
    return tokenizer


def eos_token_ids(metadata: Mapping[str, Any], tokenizer) -> List[int]:
    """Token ids that end generation.

    Args:
        metadata: GGUF metadata (see ``build_tokenizer``).
        tokenizer: the tokenizer ``build_tokenizer`` made from it.

    Returns:
        list[int], deduplicated, in this order: ``tokenizer.ggml.eos_token_id``;
        the end-of-turn token of the chat template (e.g. ``<|im_end|>``,
        ``<|eot_id|>``) when the template contains it and it is in the
        vocabulary; ``tokenizer.ggml.eot_token_id`` and
        ``tokenizer.ggml.eom_token_id`` when present.  Falls back to
        ``tokenizer.eos_token_id`` when the metadata has no eos id.  (llama.cpp
        finds its end-of-generation set by token text, see
        ``special_eog_ids`` in ``src/llama-vocab.cpp``; this is the subset
        a chat needs.)

    Raises:
        Nothing.
    """
    n_tokens = len(tokenizer)
    ids: List[int] = []
    eos = _token_id(metadata, "tokenizer.ggml.eos_token_id", n_tokens)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is not None:
        ids.append(int(eos))
    template = metadata_value(metadata, "tokenizer.chat_template") or getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, str):
        vocab = tokenizer.get_vocab()
        for text in _END_OF_TURN_TOKENS:
            if text in template and text in vocab:
                ids.append(int(vocab[text]))
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        idx = _token_id(metadata, key, n_tokens)
        if idx is not None:
            ids.append(idx)
    return list(dict.fromkeys(ids))


def apply_chat(tokenizer, prompt: str, system: Optional[str] = None) -> List[int]:
    """Token ids of a one-turn chat, ready for generation: the messages
    ``[{"role": "system", "content": system}]`` (when given) and
    ``{"role": "user", "content": prompt}`` through :func:`apply_chat_messages`.

    Args:
        tokenizer: a tokenizer with a chat template (``build_tokenizer``'s, or
            any ``transformers`` tokenizer).
        prompt: the user message.
        system: optional system message, sent first.

    Returns:
        list[int]: as :func:`apply_chat_messages`.

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    messages: List[Dict[str, str]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": prompt})
    return apply_chat_messages(tokenizer, messages)


def apply_chat_messages(tokenizer, messages: Sequence[Mapping[str, Any]],
                        tools: Optional[Sequence[Mapping[str, Any]]] = None, **template_kwargs: Any) -> List[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready
    for generation (the one place the chat template is applied).

    Args:
        tokenizer: a tokenizer with a chat template (``build_tokenizer``'s, or
            any ``transformers`` tokenizer).
        messages: ``{"role", "content"}`` dicts in order (roles as the template
            knows them: ``system``, ``user``, ``assistant``, ``tool``).
        tools: OpenAI function tools for a template that renders them (``None``: none).
        template_kwargs: extra variables the template reads (e.g. ``reasoning_effort``,
            ``enable_thinking``), passed to ``apply_chat_template``.

    Returns:
        list[int]: ``tokenizer.apply_chat_template(messages,
        add_generation_prompt=True)`` -- the rendered conversation ending with
        the assistant's turn opening (for SmolLM2
        ``<|im_start|>assistant\\n``).  Special tokens in the template become
        single ids.  When the tokenizer adds BOS (``add_bos_token``) the ids
        start with exactly one BOS whether or not the template writes it, as
        in llama.cpp; otherwise only what the template writes.

    Raises:
        ValueError: the tokenizer has no chat template.  The template itself may
            raise (e.g. ``jinja2`` ``TemplateError``) on messages it rejects.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template (tokenizer.chat_template is missing)")
    kw = dict(template_kwargs, tools=[dict(t) for t in tools]) if tools else dict(template_kwargs)
    text = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=False,
                                         **kw)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    # llama.cpp (common/chat.cpp) strips a BOS the template wrote and lets the
    # tokenizer add one when add_bos is set: net, exactly one leading BOS.
    # Whether it adds BOS is read off the tokenizer's behaviour, not its
    # add_bos_token attribute: transformers does not save that attribute, so a
    # tokenizer reloaded from save_pretrained() reports False yet adds BOS.
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids[:1] != [bos] and list(tokenizer.encode("", add_special_tokens=True))[:1] == [bos]:
        ids.insert(0, bos)
    return ids


# -- streamed text: mlx-lm's streaming detokenizer, as rank 0 drives it ---------------------------
def streaming_detokenizer(tokenizer, tokens: Sequence[int] = ()):
    """A fresh mlx-lm ``NaiveStreamingDetokenizer`` over ``tokenizer`` (rank 0 uses one per
    request: ``TokenizerWrapper`` would also infer thinking/tool markers, ~60 ms), primed with an
    answer's first ``tokens`` (:func:`prime_detokenizer`)."""
    from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

    detok = NaiveStreamingDetokenizer(tokenizer)
    prime_detokenizer(detok, tokens)
    return detok


def prime_detokenizer(detok, tokens: Sequence[int]) -> None:
    """Feed a streaming detokenizer (mlx-lm's ``StreamingDetokenizer``) the answer's first ``tokens``
    (int ids, a resumed request's, none an EOS) exactly as rank 0's ``Generate`` fed them when they
    were generated (``add_token``, then ``last_segment``, per token), dropping their text: its
    state is then the unbroken run's, so the next segments continue that text."""
    for token in tokens:
        detok.add_token(int(token))
        detok.last_segment  # noqa: B018 -- reading it advances the detokenizer's offset


def final_segment(detok, ended_by_eos: bool) -> str:
    """The text a streaming detokenizer still holds at the end of an answer (``GenerateDone.text_tail``):
    ``finalize()`` then ``last_segment``.  An answer cut short (``ended_by_eos`` False: max_tokens,
    the context, a cancel) may end mid-character; the incomplete UTF-8 sequence decodes to U+FFFD,
    which the model did not produce, and is left out (mlx-lm's streaming text does the same)."""
    detok.finalize()
    tail = detok.last_segment
    return tail if ended_by_eos else tail.rstrip("\ufffd")


def answer_tail(tokenizer, tokens: Sequence[int], ended_by_eos: bool = False) -> str:
    """What rank 0's ``done.text_tail`` is for an answer of exactly ``tokens`` (int ids, no EOS) cut
    at max_tokens, or ended by an EOS after them (``ended_by_eos``): the front end's own copy, for
    an answer whose every token arrived but whose ``done`` event was lost with its group.  Decodes
    the answer once (O(len(tokens)) tokenizer calls): run it off the event loop."""
    return final_segment(streaming_detokenizer(tokenizer, tokens), ended_by_eos)
