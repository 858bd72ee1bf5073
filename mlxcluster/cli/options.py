"""The ``mlxcluster`` commands' shared options, each declared once, and their help text reflowed.

Every option that more than one command takes is one factory here: its flags, its default and the
help text its commands share.  A command passes only what its own context adds (``before``: what the
option is for in this command, e.g. ``"With --cluster: "``; ``after``: a note of its own; or a whole
``help`` where the commands mean different things by it), so a flag's name, default and type cannot
drift apart between commands.  Each factory returns typer's ``OptionInfo`` (``typer.Option(...)``), the
parameter default of a command function.
"""

from __future__ import annotations

import re
from typing import Optional

import typer


def reflow(doc: Optional[str]) -> str:
    """A docstring as help text: dedented, each paragraph (blank-line separated) joined into one
    line, so that typer/rich wrap it to the terminal instead of keeping the source's line breaks
    (typer >= 0.24 keeps single newlines after the first paragraph and in the command list)."""
    import inspect

    text = inspect.cleandoc(doc or "")
    return "\n\n".join(re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text) if p.strip())


# ---- the formed cluster: --cluster, --interface, --timeout, --secret-file ----

SECRET_FILE_HELP = ("File whose first line is the cluster secret (mode 600); or set MLXCLUSTER_SECRET. "
                    "Never on the command line: argv is visible in ps.")
#: generate's and chat's --secret-file context
SECRET_FILE_CLIENT = ("With --cluster, or --draft remote:HOST:PORT (the draft group's secret, which the local ranks "
                      "then share): ")
WITH_CLUSTER = "With --cluster: "
BROWSE_HELP = "interface name or IPv4 address to browse on (repeatable)."


def cluster(help: str, default: Optional[str] = None):
    """``--cluster NAME``: a formed cluster's name (``default``: ``None``, local ranks)."""
    return typer.Option(default, "--cluster", help=help)


def interface(help: str = WITH_CLUSTER + BROWSE_HELP):
    """``--interface`` (repeatable): where mDNS browses (and, for ``join``, the data plane)."""
    return typer.Option([], "--interface", help=help)


def timeout(help: str = WITH_CLUSTER + "seconds to browse for nodes."):
    """``--timeout``: seconds of mDNS browsing (3)."""
    return typer.Option(3.0, "--timeout", help=help)


def secret_file(before: str = "", after: str = ""):
    """``--secret-file``: the cluster secret's file (:data:`SECRET_FILE_HELP`)."""
    return typer.Option(None, "--secret-file", help=before + SECRET_FILE_HELP + after)


# ---- the model and the local ranks ----

MODEL_HELP = "A .gguf file or mlx-lm model directory (default: embedded SmolLM2-135M-Instruct)."
WEIGHTS_HELP = "quantized, float32, float16 or bfloat16 (default: fastest measured for this platform)."
BACKEND_HELP = "ring (MLX TCP ring), mpi (OpenMPI), or auto (mpi when mpirun is installed, else ring)."


def model(help: str = MODEL_HELP):
    """``--model``: a model reference (``None``: the embedded model)."""
    return typer.Option(None, "--model", help=help)


def weights(help: str = WEIGHTS_HELP):
    """``--weights``: the weight format (``None``: the fastest measured for this platform)."""
    return typer.Option(None, "--weights", help=help)


def world_size(help: str = "Number of tensor-parallel ranks.", default: Optional[int] = 1):
    """``--world-size`` / ``-n``: ranks."""
    return typer.Option(default, "--world-size", "-n", help=help)


def backend(help: str = BACKEND_HELP):
    """``--backend`` (``auto``)."""
    return typer.Option("auto", "--backend", help=help)


def start_timeout():
    """``--start-timeout``: seconds to wait for local ranks to load (300)."""
    return typer.Option(300.0, "--start-timeout", help="Seconds to wait for ranks to load.")


def as_json(help: str = "Print JSON."):
    """``--json``: print JSON instead of text."""
    return typer.Option(False, "--json", help=help)


def log_level():
    """``--log-level`` (``INFO``; :data:`mlxcluster.config.LOG_LEVELS`)."""
    return typer.Option("INFO", "--log-level", help="DEBUG, INFO, WARNING, ERROR or CRITICAL.")


# ---- KV format and the disk prompt cache ----

KV_BITS_HELP = ("Quantize the KV caches of every rank to 4 or 8 bits (mlx-lm's QuantizedKVCache: affine, in groups "
                "along head_dim; 8-bit K/V take ~0.28x the memory of float32 and answer nearly as full precision, "
                "4-bit ~0.16x; K/V handoffs and the disk prompt cache carry them packed). Default: full precision.")
KV_GROUP_SIZE_HELP = ("With --kv-bits: elements per quantization group along head_dim: 32, 64 (default) or 128; it "
                      "must divide the model's head_dim.")
PROMPT_CACHE_DIR_HELP = ("Keep long prompts' K/V (256 tokens or more) in this directory too, one safetensors file "
                         "per prompt under the model's and layout's identity: a later process over the same "
                         "directory takes a long shared prefix from disk instead of prefilling it (tensor "
                         "parallelism and pipelines: each rank keeps its shard, and a prompt is taken as far as "
                         "every rank holds it; not with --local-decode, --afd or --role).")
PROMPT_CACHE_SIZE_HELP = ("With --prompt-cache-dir: the most bytes of files kept, e.g. 4GiB or 800MB (default "
                          "4GiB; least recently used deleted first).")


def kv_bits(before: str = "", after: str = "", help: Optional[str] = None):
    """``--kv-bits 4|8`` (``None``: full precision)."""
    return typer.Option(None, "--kv-bits", help=help if help is not None else before + KV_BITS_HELP + after)


def kv_group_size():
    """``--kv-group-size`` (``None``: 64 with ``--kv-bits``)."""
    return typer.Option(None, "--kv-group-size", help=KV_GROUP_SIZE_HELP)


def prompt_cache_dir(before: str = "", after: str = ""):
    """``--prompt-cache-dir``: the prefix cache's disk tier."""
    return typer.Option(None, "--prompt-cache-dir", help=before + PROMPT_CACHE_DIR_HELP + after)


def prompt_cache_size():
    """``--prompt-cache-size``: the disk tier's bound."""
    return typer.Option(None, "--prompt-cache-size", help=PROMPT_CACHE_SIZE_HELP)


# ---- topology of local ranks (model/topology.py's fields) ----

def layers(help: str):
    """``--layers``: pipeline stages' layer ranges."""
    return typer.Option(None, "--layers", help=help)


def stage_tp(help: str):
    """``--stage-tp``: ranks per pipeline stage."""
    return typer.Option(None, "--stage-tp", help=help)


def local_decode(help: str):
    """``--local-decode``: rank 0 decodes alone after a pipelined prefill."""
    return typer.Option(False, "--local-decode", help=help)


def afd(help: str):
    """``--afd A:1``: attention-FFN disaggregation."""
    return typer.Option(None, "--afd", help=help)


def afd_microbatches(help: str):
    """``--afd-microbatches`` (1)."""
    return typer.Option(1, "--afd-microbatches", help=help)


def role(help: str):
    """``--role`` (``tp``)."""
    return typer.Option("tp", "--role", help=help)


# ---- one generation: prompt, sampling, speculative decoding ----

DRAFT_HELP = ("Speculative decoding (draft tokens verified several per step; greedy answers are unchanged): ngram or "
              "ngram:MIN-MAX (prompt lookup: tokens copied from the prompt and answer so far), model:PATH (a draft "
              "model with the same tokenizer, an mlx-lm directory or GGUF file, run by rank 0), layers:N "
              "(self-speculative: the model's first N layers with its norm and head draft, 1 <= N < its layer "
              "count) or remote:HOST:PORT (a draft node's group, serve/join --role draft: one call per step for the "
              "whole batch; a draft node that is slow or gone costs plain steps, never an error).")
DRAFT_TOKENS_HELP = "With --draft: the most draft tokens verified per step, 1..16 (default 4"


def max_tokens(default: int, help: str):
    """``--max-tokens``."""
    return typer.Option(default, "--max-tokens", help=help)


def system(help: str):
    """``--system``: the system message."""
    return typer.Option(None, "--system", help=help)


def temperature():
    """``--temperature`` / ``--temp`` (0: greedy)."""
    return typer.Option(0.0, "--temperature", "--temp", help="Sampling temperature (0: greedy).")


def top_p(help: str):
    """``--top-p`` (1: off)."""
    return typer.Option(1.0, "--top-p", help=help)


def top_k():
    """``--top-k`` (0: off)."""
    return typer.Option(0, "--top-k", help="Sample among the K most likely tokens only (0: off).")


def min_p(help: str):
    """``--min-p`` (0: off)."""
    return typer.Option(0.0, "--min-p", help=help)


def repetition_penalty(help: str):
    """``--repetition-penalty`` (``None``: off)."""
    return typer.Option(None, "--repetition-penalty", help=help)


def seed(help: str):
    """``--seed`` (``None``: a random one)."""
    return typer.Option(None, "--seed", help=help)


def draft(help: str = DRAFT_HELP):
    """``--draft``: the drafter of speculative decoding."""
    return typer.Option(None, "--draft", help=help)


def draft_tokens(note: str = "; the measured acceptance rate moves it below"):
    """``--draft-tokens``: the most draft tokens per step."""
    return typer.Option(None, "--draft-tokens", help=DRAFT_TOKENS_HELP + note + ").")


# ---- an HTTP surface: --host, --port, API keys, TLS ----

def host(help: str):
    """``--host`` (loopback)."""
    return typer.Option("127.0.0.1", "--host", help=help)


def port(default: int, help: str):
    """``--port``."""
    return typer.Option(default, "--port", help=help)


def api_key(help: str):
    """``--api-key`` (repeatable)."""
    return typer.Option([], "--api-key", help=help)


def api_key_file(help: str, *aliases: str):
    """``--api-key-file`` (repeatable; ``aliases``: more flags)."""
    return typer.Option([], "--api-key-file", *aliases, help=help)


def insecure_no_auth(help: str, *aliases: str):
    """``--insecure-no-auth`` (``aliases``: more flags)."""
    return typer.Option(False, "--insecure-no-auth", *aliases, help=help)


def tls_cert(help: str):
    """``--tls-cert``: a PEM certificate."""
    return typer.Option(None, "--tls-cert", help=help)


def tls_key():
    """``--tls-key``: the private key of ``--tls-cert``."""
    return typer.Option(None, "--tls-key", help="PEM private key of --tls-cert.")
