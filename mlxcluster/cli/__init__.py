"""The ``mlxcluster`` commands: typer options -> the objects of the layers below -> printed results.

Shared options are declared once in :mod:`mlxcluster.cli.options`; ``docs/cli.md`` is generated from
this app (``scripts/gen_cli_docs.py``).  Entry points: :data:`app` and :func:`main`.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

# gRPC's C core logs failed TLS handshakes (a peer without the secret) to stderr before
# any of our code sees them; the command reports them as one line itself.  Read when
# grpc is first imported, so set before that; GRPC_VERBOSITY=ERROR/INFO brings them back.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import typer  # noqa: E402

from . import options as opt  # noqa: E402 - every shared option, declared once
from .common import (_Command, _Progress, _client_credentials, _env_secret, _fail, _find_rank0,  # noqa: E402
                     _read_secret, _setup_logging, _start_local)
from .network import _thunderbolt_network  # noqa: E402
from .serving import (_bind_http, _ClusterGroups, _LocalGroups, _ModelGroups, _serve_groups, _serve_http,  # noqa: E402
                      _serve_pool_http, _serve_prefill)

if TYPE_CHECKING:  # pragma: no cover
    from ..runtime.rank_config import RankConfig

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Tensor-parallel LLM inference over MLX ranks.")


def _command(*args, **kwargs):
    """``app.command`` (same arguments) making a :class:`_Command` whose help is the function's
    docstring reflowed (:func:`~mlxcluster.cli.options.reflow`: one line per paragraph)."""
    def decorate(func):
        return app.command(*args, cls=_Command, help=opt.reflow(func.__doc__), **kwargs)(func)
    return decorate


def _check_weights(weights: Optional[str]) -> None:
    """``--weights`` is unset or a known weight format, else a one-line error (exit 2)."""
    from ..model.loader import WEIGHT_FORMATS

    if weights is not None and weights not in WEIGHT_FORMATS:
        raise _fail(f"unknown weight format {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}", 2)


def _model_info(model: Optional[str]):
    """:func:`~mlxcluster.model.loader.inspect_model` of ``--model``; a bad model is a one-line error."""
    from ..model.loader import ModelError, inspect_model

    try:
        return inspect_model(model)
    except ModelError as exc:
        raise _fail(str(exc))


def _weight_format(info, weights: Optional[str], world_size: Optional[int]) -> str:
    """The weight format to load (``--weights``, else the fastest for this platform), checked
    against the model ``info`` split into ``world_size`` ranks (``None``: not checked); a model
    that does not split so is a one-line error."""
    from ..model.loader import ModelError, default_weight_format
    from ..model.tp import WorldSizeError, check_world_size

    fmt = weights or default_weight_format()
    if world_size is not None:
        try:
            check_world_size(info.config, world_size, info.quantization, fmt, info.name)
        except (ModelError, WorldSizeError) as exc:
            raise _fail(str(exc))
    return fmt


def _need_llama(info, what: str) -> None:
    """``what`` (pipelines, disaggregation) is written for the Llama family: a one-line error
    (exit 2) for another architecture."""
    from ..model.arch import is_llama

    if not is_llama(info.config):
        raise _fail(f"{what} supports Llama-family models only; {info.name} is {info.architecture} "
                    "(tensor parallelism, --world-size N, runs every architecture)", 2)


def _topology(info, fmt: str, *, world_size: int = 1, **options):
    """The :class:`~mlxcluster.model.topology.Topology` of a command's options, validated once for
    ``info``'s model loaded as ``fmt`` (``auto`` resolved, every rule checked: a broken one is a
    one-line error, exit 2).  ``world_size`` is ``--world-size``: with ``--layers``/``--afd`` 1 means
    "the route's (or split's) size"; ``options`` are the other fields of ``Topology``."""
    from ..model.topology import Topology, TopologyError

    given = world_size != 1 or (options.get("layers") is None and options.get("afd") is None)
    try:
        return Topology(tp=world_size if given else None, **options).validate(
            info.config, name=info.name, quantization=info.quantization, weights=fmt)
    except TopologyError as exc:
        raise _fail(str(exc), 2)


def _draft_secret(draft: Optional[str], secret_file: Optional[str]) -> Optional[str]:
    """The secret local ranks start with for ``--draft``: a ``remote:HOST:PORT`` drafter's calls are
    mutual TLS under the draft group's secret (``--secret-file`` or ``MLXCLUSTER_SECRET``; neither: a
    one-line error, exit 2); ``None`` (a fresh one) for any other drafter."""
    if draft is None or not draft.startswith("remote:"):
        return None
    if secret_file is None and not _env_secret():
        raise _fail("--draft remote:HOST:PORT needs --secret-file: the secret the draft group (serve --role draft) "
                    "was started with", 2)
    return _read_secret(secret_file)


def _check_local_options(backend: str, weights: Optional[str]) -> str:
    """Validate the backend and weights of a local launch (its topology: :func:`_topology`);
    returns the resolved backend."""
    from ..runtime.launcher import LaunchError, resolve_backend

    try:
        backend = resolve_backend(backend)
    except LaunchError as exc:
        raise _fail(str(exc), 2)
    _check_weights(weights)
    return backend


def _check_kv_bits(kv_bits: Optional[int], kv_group_size: Optional[int], cluster: Optional[str] = None) -> None:
    """``--kv-bits`` / ``--kv-group-size`` on their own (before any model is read): a width other than 4
    or 8, a group size other than 32, 64 or 128, a group size without ``--kv-bits``, or either beside
    ``generate``/``serve``'s ``--cluster`` (local ranks' options: a cluster runs its own format) is a
    one-line error (exit 2)."""
    from ..engine.kvquant import KV_BITS, kv_format

    if kv_bits is None:
        if kv_group_size is not None:
            raise _fail("--kv-group-size needs --kv-bits", 2)
        return
    if kv_bits not in KV_BITS:
        raise _fail(f"--kv-bits {kv_bits}: choose {' or '.join(map(str, KV_BITS))} (or leave it out: full precision)", 2)
    try:
        kv_format(kv_bits, kv_group_size)
    except ValueError as exc:
        raise _fail(str(exc), 2)
    if cluster is not None:
        raise _fail("--kv-bits and --kv-group-size configure local ranks: with --cluster the cluster's own KV "
                    "format applies (join --kv-bits)", 2)


def _kv_options(kv_bits: Optional[int], kv_group_size: Optional[int], info) -> dict:
    """``--kv-bits`` / ``--kv-group-size`` as :class:`~mlxcluster.runtime.rank_config.RankConfig` fields
    (``kv_bits``, ``kv_group_size``), checked against the model ``info`` (a group size that does not
    divide its head_dim is a one-line error, exit 2); ``{}`` at full precision."""
    from ..engine.kvquant import config_head_dim, kv_format

    _check_kv_bits(kv_bits, kv_group_size)
    if kv_bits is None:
        return {}
    try:
        fmt = kv_format(kv_bits, kv_group_size, config_head_dim(info.config) or None)
    except ValueError as exc:
        raise _fail(str(exc), 2)
    return dict(kv_bits=fmt.bits, kv_group_size=fmt.group_size)


@_command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text; - reads it from standard input (or give --prompt-file)."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", help="Read the prompt from this UTF-8 file (instead of PROMPT)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    system: Optional[str] = opt.system("System message (with --chat)."),
    model: Optional[str] = opt.model(),
    world_size: int = opt.world_size(),
    backend: str = opt.backend(),
    max_tokens: int = opt.max_tokens(128, "Maximum tokens to generate."),
    weights: Optional[str] = opt.weights(),
    as_json: bool = opt.as_json("Print one JSON object instead of streaming text."),
    start_timeout: float = opt.start_timeout(),
    cluster: Optional[str] = opt.cluster("Use the formed cluster NAME (found over mDNS) instead of starting local ranks."),
    interface: List[str] = opt.interface(),
    secret_file: Optional[str] = opt.secret_file(opt.SECRET_FILE_CLIENT),
    layers: Optional[str] = opt.layers("Pipeline parallelism: one inclusive layer range per stage, rank order, the output stage as K:output (e.g. 0:14,15:output forward, 15:output,0:14 reverse), or auto; the world size is the route's."),
    stage_tp: Optional[str] = opt.stage_tp("With --layers: ranks per stage, rank order (e.g. 3,1: a tensor-parallel stage of 3 and one of 1; needs --backend mpi)."),
    local_decode: bool = opt.local_decode("With a reverse --layers route (rank 0 owns K:output): prefill through the pipeline, then the other stages hand their K/V to rank 0, which loads every layer and decodes alone."),
    pd: Optional[str] = typer.Option(None, "--pd", help="Prefill/decode disaggregation P:D: a prefill group of P ranks (1) streams each prompt's K/V per chunk and layer to a tensor-parallel decode group of D ranks, which decodes (e.g. 1:1, 1:3); a prompt whose stream is refused is prefilled by the decode group itself."),
    afd: Optional[str] = opt.afd("Attention-FFN disaggregation A:1: attention ranks (embedding, attention, KV cache, head; with 2:1 they split the layers) and one FFN rank holding every MLP; the world size is A + 1."),
    afd_microbatches: int = opt.afd_microbatches("With --afd: whole sequences in flight per round, ping-ponged per layer so neither side idles."),
    temperature: float = opt.temperature(),
    top_p: float = opt.top_p("Nucleus sampling: keep the most likely tokens up to this probability mass, in (0, 1] (1: off)."),
    top_k: int = opt.top_k(),
    min_p: float = opt.min_p("Drop tokens less likely than this fraction of the most likely one's probability, in [0, 1] (0: off)."),
    repetition_penalty: Optional[float] = opt.repetition_penalty("Penalise the last 20 tokens of prompt + answer (mlx-lm's repetition penalty, > 0; 1: off)."),
    seed: Optional[int] = opt.seed("Seed of the sampler: the same seed, the same answer (default: a random one; --json prints it)."),
    draft: Optional[str] = opt.draft(),
    draft_tokens: Optional[int] = opt.draft_tokens(),
    prompt_cache_dir: Optional[str] = opt.prompt_cache_dir(),
    prompt_cache_size: Optional[str] = opt.prompt_cache_size(),
    kv_bits: Optional[int] = opt.kv_bits(),
    kv_group_size: Optional[int] = opt.kv_group_size(),
):
    """Generate a continuation of PROMPT (greedy unless --temperature).

    It runs on an N-rank tensor-parallel group on this machine, a pipeline of stages (--layers),
    prefill and decode groups (--pd), or on a formed cluster (--cluster)."""
    if max_tokens < 1:
        raise _fail("--max-tokens must be at least 1", 2)
    _check_kv_bits(kv_bits, kv_group_size, cluster)
    sampling = _sampling_options(temperature, top_p, top_k, min_p, repetition_penalty, seed)
    sampling.update(_draft_options(draft, draft_tokens))
    prompt = _read_prompt(prompt, prompt_file)
    options = dict(layers=layers, stage_tp=stage_tp, local_decode=local_decode, afd=afd,
                   afd_microbatches=afd_microbatches)  # the topology's (Topology's fields)
    if (prompt_cache_dir is not None or prompt_cache_size is not None) and (pd is not None or cluster is not None):
        raise _fail("--prompt-cache-dir and --prompt-cache-size configure one local rank: they exclude --pd and "
                    "--cluster", 2)
    if pd is not None:
        if cluster is not None:
            raise _fail("--pd runs two local tensor-parallel groups: it excludes --cluster", 2)
        _generate_pd(pd, prompt, chat, system, model, backend, max_tokens, weights, as_json, start_timeout,
                     options, sampling=sampling, kv=(kv_bits, kv_group_size))
        return
    if cluster is not None:
        _cluster_excludes(options)
        creds = _client_credentials(cluster, secret_file)
        address, found = _find_rank0(cluster, interface, creds)
        from ..cluster.client import generate_resumed

        # the cluster re-forms when a node is lost: the answer resumes on the new group (lossless failover)
        resumed = functools.partial(generate_resumed, cluster, creds, interface, address, found.formation_id,
                                    on_replay=lambda line: typer.echo(line, err=True))
        _run_generation(address, creds, prompt, chat, system, max_tokens, as_json, found.world_size, found.backend,
                        sampling=sampling, events=resumed)
        return
    from ..runtime.launcher import LocalCluster

    backend = _check_local_options(backend, weights)
    info = _model_info(model)
    fmt = _weight_format(info, weights, None)
    topology = _topology(info, fmt, world_size=world_size, **options)
    world_size = topology.world_size
    from ..runtime.rank_config import RankConfig

    rank = RankConfig(**_prompt_cache_options(prompt_cache_dir, prompt_cache_size, topology),
                      **_kv_options(kv_bits, kv_group_size, info))
    local = LocalCluster(world_size, backend, model=info.path, weights=fmt, topology=topology,
                         secret=_draft_secret(draft, secret_file), on_event=_Progress(world_size, enabled=True),
                         start_timeout_s=start_timeout, config=rank)
    try:
        _start_local(local)
        _run_generation(local.address, local.credentials, prompt, chat, system, max_tokens, as_json, world_size,
                        backend if world_size > 1 else "none", weights=fmt, failure=lambda: local.failure,
                        sampling=sampling)
    except KeyboardInterrupt:
        raise _fail("interrupted", 130)
    finally:
        local.stop()


def _prompt_cache_options(directory: Optional[str], size: Optional[str], topology) -> dict:
    """``--prompt-cache-dir`` / ``--prompt-cache-size`` as :class:`~mlxcluster.runtime.rank_config.RankConfig`
    fields (``{}`` without), checked here first: a bad size,
    a directory that cannot be made or written, or a group the disk tier cannot serve is a one-line
    error (exit 2)."""
    if directory is None:
        if size is not None:
            raise _fail("--prompt-cache-size needs --prompt-cache-dir", 2)
        return {}
    from ..runtime.rank_config import prompt_cache_refusal

    why = prompt_cache_refusal(topology)
    if why:
        raise _fail(why, 2)
    return _prompt_cache_dir(directory, size)


def _prompt_cache_dir(directory: str, size: Optional[str]) -> dict:
    """``--prompt-cache-dir DIR`` (made here, absolute) and ``--prompt-cache-size`` as
    :class:`~mlxcluster.runtime.rank_config.RankConfig` fields (``prompt_cache_dir``, ``prompt_cache_size``): a bad
    size or a directory that cannot be made or written is a one-line error (exit 2)."""
    from ..engine.prompt_disk import parse_size

    if size is not None:
        try:
            parse_size(size)
        except ValueError as exc:
            raise _fail(str(exc), 2)
    if not directory.strip():
        raise _fail("--prompt-cache-dir needs a directory", 2)
    path = os.path.abspath(os.path.expanduser(directory))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise _fail(f"--prompt-cache-dir {directory}: {exc.strerror or exc}", 2)
    if not os.access(path, os.W_OK | os.X_OK):
        raise _fail(f"--prompt-cache-dir {directory}: not writable", 2)
    return dict(prompt_cache_dir=path, prompt_cache_size=size or "")


#: a request setting (:class:`~mlxcluster.protocol.args.ArgumentError`'s ``param``) -> the generate flag that sets it
_SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                   "repetition_penalty": "--repetition-penalty", "seed": "--seed"}


def _sampling_options(temperature: float, top_p: float, top_k: int, min_p: float,
                      repetition_penalty: Optional[float], seed: Optional[int]) -> dict:
    """``generate``'s sampling flags as :meth:`GenerationClient.stream` keywords, checked here by the
    one check of a request's settings (:func:`~mlxcluster.protocol.args.check_args`, as rank 0 checks
    them) before any rank starts: a bad value is a one-line error naming the flag (exit 2).  No
    ``--seed`` with a temperature: a random 63-bit seed (0 when greedy)."""
    import secrets

    from ..protocol.args import ArgumentError, GenerationArgs, LogitsArgs, SamplingArgs, check_args

    if seed is None:
        seed = secrets.randbits(63) if temperature > 0 else 0
    # a K beyond the vocabulary keeps every token: bounded to the message's int32
    kw = dict(temperature=temperature, top_p=top_p, top_k=min(top_k, 2**31 - 1), min_p=min_p, seed=seed)
    logits = LogitsArgs() if repetition_penalty is None else LogitsArgs(repetition_penalty=repetition_penalty)
    try:
        check_args(GenerationArgs(sampling=SamplingArgs(**kw), logits=logits))
    except ArgumentError as exc:
        raise _fail(f"{_SAMPLING_FLAGS.get(exc.param, exc.param)} must be {exc.rule}, got {exc.value}", 2)
    if repetition_penalty is not None:
        kw["repetition_penalty"] = repetition_penalty
    return kw


def _draft_options(draft: Optional[str], draft_tokens: Optional[int], per_request: bool = True) -> dict:
    """``--draft`` / ``--draft-tokens`` checked before any rank starts (an unknown or malformed
    drafter, a bound outside 1..16: a one-line error, exit 2; rank 0 checks ``layers:N`` against the
    model and loads ``model:PATH``).  ``per_request`` (``generate``, ``chat``): the
    :meth:`GenerationClient.stream` keyword ``speculative`` (``{}`` without ``--draft``; rank 0 refuses
    a model that cannot speculate with one line); else (``serve``) rank 0's
    :class:`~mlxcluster.runtime.rank_config.RankConfig` fields ``draft`` / ``draft_tokens`` (its default
    for every request, ``{}`` without ``--draft``)."""
    from ..engine.speculative import MAX_DRAFT_TOKENS, parse_draft

    if draft_tokens is not None and not 1 <= draft_tokens <= MAX_DRAFT_TOKENS:
        raise _fail(f"--draft-tokens must be in 1..{MAX_DRAFT_TOKENS}, got {draft_tokens}", 2)
    if draft is None:
        if draft_tokens is not None:
            raise _fail("--draft-tokens needs --draft (ngram, ngram:MIN-MAX, model:PATH, layers:N or "
                        "remote:HOST:PORT)", 2)
        return {}
    try:
        parse_draft(draft)
    except ValueError as exc:
        raise _fail(str(exc), 2)
    if per_request:
        return {"speculative": (draft, draft_tokens or 0)}
    return dict(draft=draft, **({"draft_tokens": draft_tokens} if draft_tokens is not None else {}))


def _read_prompt(prompt: Optional[str], prompt_file: Optional[str]) -> str:
    """The prompt: PROMPT, standard input for PROMPT ``-``, or ``--prompt-file``'s UTF-8 text (exactly one
    of them); a missing or unreadable source is a one-line error (exit 2)."""
    if (prompt is None) == (prompt_file is None):
        raise _fail("give the prompt as PROMPT, - (standard input) or --prompt-file FILE, once", 2)
    try:
        if prompt_file is not None:
            with open(prompt_file, encoding="utf-8") as f:
                return f.read()
        if prompt == "-":
            return sys.stdin.read()
    except (OSError, UnicodeDecodeError) as exc:
        where = prompt_file if prompt_file is not None else "standard input"
        raise _fail(f"cannot read the prompt from {where}: {getattr(exc, 'strerror', None) or exc}", 2)
    return prompt


def _cluster_excludes(options: dict) -> None:
    """With ``--cluster`` the topology is the formed cluster's: a topology option is a one-line error (exit 2)."""
    given = [flag for flag, on in (("--layers", options["layers"] is not None),
                                   ("--stage-tp", options["stage_tp"] is not None),
                                   ("--local-decode", options["local_decode"]), ("--afd", options["afd"] is not None),
                                   ("--afd-microbatches", options["afd_microbatches"] != 1)) if on]
    if given:
        raise _fail(f"{given[0]} configures local ranks; a cluster's topology (its route) is its nodes' own", 2)


def parse_pd(spec: str, n_kv_heads: int) -> Tuple[int, int]:
    """``"P:D"`` -> ``(P, D)``: prefill and decode ranks.

    Raises:
        ValueError: not two positive integers, P other than 1, or D not dividing the KV heads."""
    parts = spec.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"--pd {spec!r}: write prefill ranks:decode ranks, e.g. 1:3")
    p, d = int(parts[0]), int(parts[1])
    if p != 1:
        raise ValueError(f"--pd {spec!r}: the prefill group runs on one rank (tensor-parallel prefill groups are not supported)")
    if n_kv_heads % d:
        raise ValueError(f"--pd {spec!r}: the model's {n_kv_heads} KV heads do not split over {d} decode ranks")
    return p, d


def _generate_pd(spec, prompt, chat, system, model, backend, max_tokens, weights, as_json, start_timeout,
                 options, sampling: Optional[dict] = None, kv: Tuple[Optional[int], Optional[int]] = (None, None)):
    """``generate --pd P:D``: a prefill group and a decode group on this machine (one secret);
    ``options``: the other topology options (PD excludes them: :meth:`Topology.validate`); ``kv``:
    ``(--kv-bits, --kv-group-size)``, both groups' KV format."""
    import dataclasses

    from ..runtime.launcher import LocalCluster
    from ..security import new_secret

    info = _model_info(model)
    fmt = _weight_format(info, weights, None)
    prefill_topology = _topology(info, fmt, role="prefill", **options)
    cfg = info.config
    try:
        p, d = parse_pd(spec, int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]))
    except ValueError as exc:
        raise _fail(str(exc), 2)
    # the decode group's --prefill-peer is the prefill group's address, known once it runs
    decode_topology = _topology(info, fmt, world_size=d, **options)
    backend = _check_local_options(backend, weights)
    from ..runtime.rank_config import RankConfig

    rank = RankConfig(**_kv_options(kv[0], kv[1], info))
    secret = new_secret()
    prefill = LocalCluster(p, backend, model=info.path, weights=fmt, topology=prefill_topology, secret=secret,
                           on_event=_Progress(p, enabled=True), start_timeout_s=start_timeout, config=rank)
    decode = None
    try:
        _start_local(prefill)
        decode = LocalCluster(d, backend, model=info.path, weights=fmt, secret=secret,
                              topology=dataclasses.replace(decode_topology, prefill_peer=prefill.address),
                              on_event=_Progress(d, enabled=True), start_timeout_s=start_timeout, config=rank)
        _start_local(decode)
        _run_generation(decode.address, decode.credentials, prompt, chat, system, max_tokens, as_json, d,
                        backend if d > 1 else "none", weights=fmt,
                        failure=lambda: decode.failure or prefill.failure, pd=spec, sampling=sampling)
    except KeyboardInterrupt:
        raise _fail("interrupted", 130)
    finally:
        if decode is not None:
            decode.stop()
        prefill.stop()


def _run_generation(address, creds, prompt, chat, system, max_tokens, as_json, world_size, backend,
                    weights="", failure=lambda: None, pd: str = "", sampling: Optional[dict] = None,
                    events=None) -> None:
    """Stream (or collect, with ``as_json``) one generation from rank 0 at ``address`` (mutual TLS with
    ``creds``); ``sampling``: :meth:`GenerationClient.stream`'s sampling keywords (default: greedy);
    ``events``: what streams the ``GenerateEvent`` s (:meth:`GenerationClient.stream`'s keywords;
    default: that method itself)."""
    from ..leader.generation import ClientError, GenerationClient, collect

    sampling = sampling or {}
    client = GenerationClient(address, creds)
    events = events or client.stream
    try:
        if as_json:
            result = collect(events(prompt=prompt, chat=chat, system=system or "", max_tokens=max_tokens, **sampling))
            typer.echo(json.dumps({
                "prompt_ids": result.prompt_ids,
                "token_ids": result.token_ids,
                "text": result.text,
                "world_size": world_size,
                "backend": backend,
                "weights": weights,
                "stop_reason": result.reason,
                "seed": sampling.get("seed", 0),
                "ttft_s": result.ttft_s,
                "prefill_tokens_per_s": result.prefill_tokens_per_s,
                "decode_tokens_per_s": result.decode_tokens_per_s,
                "peak_memory_bytes_per_rank": result.peak_memory_bytes_per_rank,
                "cached_prompt_tokens": result.cached_prompt_tokens,
                **({"handoff_bytes": result.handoff_bytes, "handoff_s": result.handoff_s,
                    "handoff_fallback": result.handoff_fallback} if result.handoff_bytes or result.handoff_fallback
                   else {}),
                **({"pd": pd or "prefill group", "pd_prefill_s": result.pd_prefill_s, "pd_tail_s": result.pd_tail_s,
                    "pd_streamed_s": result.pd_streamed_s} if pd or result.pd_prefill_s else {}),
                **({"draft": sampling["speculative"][0], "spec_drafted_tokens": result.spec_drafted_tokens,
                    "spec_accepted_tokens": result.spec_accepted_tokens,
                    "acceptance_rate": round(result.acceptance_rate, 4), "spec_steps": result.spec_steps,
                    "decode_steps": result.decode_steps, "tokens_per_step": round(result.tokens_per_step, 4)}
                   if "speculative" in sampling else {}),
            }))
            return
        done = None
        for event in events(prompt=prompt, chat=chat, system=system or "", max_tokens=max_tokens, **sampling):
            kind = event.WhichOneof("event")
            if kind == "token" and event.token.text:
                sys.stdout.write(event.token.text)
                sys.stdout.flush()
            elif kind == "done":
                done = event.done
                sys.stdout.write(done.text_tail + "\n")
                sys.stdout.flush()
        if done is not None:
            typer.echo(
                f"[{done.generated_tokens} tokens, TTFT {done.ttft_s * 1000:.0f} ms, "
                f"prefill {done.prefill_tokens_per_s:.1f} tok/s, decode {done.decode_tokens_per_s:.1f} tok/s, "
                + (f"accepted {done.spec_accepted_tokens}/{done.spec_drafted_tokens} drafted, "
                   if "speculative" in sampling else "") +
                f"world size {world_size}]", err=True)
    except ClientError as exc:
        why = failure()
        raise _fail(str(exc) if not why else f"{exc} ({why})")
    finally:
        client.close()


@_command()
def chat(
    model: Optional[str] = opt.model(),
    world_size: int = opt.world_size(),
    backend: str = opt.backend(),
    weights: Optional[str] = opt.weights(),
    max_tokens: int = opt.max_tokens(512, "Maximum tokens of each answer."),
    system: Optional[str] = opt.system("System message of the conversation."),
    start_timeout: float = opt.start_timeout(),
    cluster: Optional[str] = opt.cluster("Chat with the formed cluster NAME (found over mDNS) instead of starting local ranks."),
    interface: List[str] = opt.interface(),
    secret_file: Optional[str] = opt.secret_file(opt.SECRET_FILE_CLIENT),
    temperature: float = opt.temperature(),
    top_p: float = opt.top_p("Nucleus sampling, in (0, 1] (1: off)."),
    top_k: int = opt.top_k(),
    min_p: float = opt.min_p("Minimum probability relative to the most likely token, in [0, 1] (0: off)."),
    repetition_penalty: Optional[float] = opt.repetition_penalty("mlx-lm's repetition penalty over the last 20 tokens (> 0; 1: off)."),
    seed: Optional[int] = opt.seed("Seed of the sampler (default: a random one)."),
    draft: Optional[str] = opt.draft(),
    draft_tokens: Optional[int] = opt.draft_tokens(),
):
    """Chat with the model: a multi-turn conversation through its chat template, answers streamed.

    It runs on an N-rank group on this machine or on a formed cluster (--cluster).

    /reset forgets the conversation, /exit or Ctrl-D quits, Ctrl-C stops the current answer."""
    if max_tokens < 1:
        raise _fail("--max-tokens must be at least 1", 2)
    sampling = _sampling_options(temperature, top_p, top_k, min_p, repetition_penalty, seed)
    sampling.update(_draft_options(draft, draft_tokens))
    if cluster is not None:
        creds = _client_credentials(cluster, secret_file)
        address, found = _find_rank0(cluster, interface, creds)
        from ..cluster.client import generate_resumed

        # each answer resumes on the re-formed cluster when a node is lost (lossless failover)
        resumed = functools.partial(generate_resumed, cluster, creds, interface, address, found.formation_id,
                                    on_replay=lambda line: typer.echo(f"\n[{line}]", err=True))
        raise typer.Exit(_chat_session(address, creds, system, max_tokens, sampling,
                                       f"cluster {cluster!r}, world size {found.world_size}", events=resumed))
    from ..runtime.launcher import LocalCluster

    backend = _check_local_options(backend, weights)
    info = _model_info(model)
    fmt = _weight_format(info, weights, None)
    topology = _topology(info, fmt, world_size=world_size)
    world_size = topology.world_size
    local = LocalCluster(world_size, backend, model=info.path, weights=fmt, topology=topology,
                         secret=_draft_secret(draft, secret_file), on_event=_Progress(world_size, enabled=True),
                         start_timeout_s=start_timeout)
    try:
        _start_local(local)
        status = _chat_session(local.address, local.credentials, system, max_tokens, sampling,
                               f"{info.name}, world size {world_size}", failure=lambda: local.failure)
    except KeyboardInterrupt:  # while the ranks start
        raise _fail("interrupted", 130)
    finally:
        local.stop()
    raise typer.Exit(status)


def _chat_session(address, creds, system, max_tokens, sampling, what, failure=lambda: None, events=None) -> int:
    """Run ``mlxcluster chat``'s loop (:class:`~mlxcluster.cluster.chat.ChatSession`) against rank 0
    at ``address``; its exit status.  ``events``: what streams each answer's ``GenerateEvent`` s
    (:meth:`GenerationClient.stream`'s keywords; default: that method)."""
    from ..cluster.chat import HELP, ChatSession
    from ..leader.generation import ClientError, GenerationClient

    try:
        import readline  # noqa: F401 - line editing and history for input()
    except ImportError:  # pragma: no cover - not on every platform
        pass
    client = GenerationClient(address, creds)
    events = events or client.stream

    def stream(messages, limit):
        try:
            yield from events(messages=messages, system=system or "", max_tokens=limit, **sampling)
        except ClientError as exc:  # a failed local group says why (a rank's last line)
            why = failure()
            raise ClientError(f"{exc} ({why})" if why else str(exc), exc.code) from None

    try:
        typer.echo(f"chat with {what}: {HELP}", err=True)
        return ChatSession(stream, max_tokens=max_tokens).run()
    finally:
        client.close()


@_command()
def join(
    cluster: str = opt.cluster("Cluster name; nodes of other clusters are ignored.", default="default"),
    world_size: Optional[int] = opt.world_size("Ranks to form first: the nodes wait until this many are live (default: the largest size the model splits into among the nodes present). When a member is lost and no spare is live, the survivors re-form at once at the largest size the model splits into that they reach (logged as a warning), and grow back to N when nodes return; --exact-world-size waits for N instead.", default=None),
    exact_world_size: bool = typer.Option(False, "--exact-world-size", help="With --world-size N: N is a hard requirement. After a member is lost the others never re-form smaller; they wait until N nodes are live (status: 'exact world size N requested, M live'), and a generation in flight fails once its client stops waiting."),
    model: Optional[str] = opt.model("A .gguf file or mlx-lm model directory (default: embedded model); every node needs the same one."),
    backend: str = opt.backend("auto (jaccl when every node has RDMA over a full Thunderbolt mesh, else mpi when every node has OpenMPI, else ring), ring, mpi (mpirun through the nodes' daemons, no ssh) or jaccl."),
    weights: Optional[str] = opt.weights("Weight format (default: fastest measured for this platform)."),
    interface: List[str] = opt.interface("Interface name or IPv4 address for discovery and the data plane (repeatable; default: all)."),
    port: int = opt.port(0, "TCP port of this node's gRPC service (0 = any free port)."),
    node_id: Optional[str] = typer.Option(None, "--node-id", help="Node id, unique in the cluster (default: hostname + address + gRPC port)."),
    secret_file: Optional[str] = opt.secret_file(after=" Required: nodes and clients without it are refused."),
    log_level: str = opt.log_level(),
    layers: Optional[str] = opt.layers("Serve one pipeline stage: this node's inclusive layer range (e.g. 0:9, or 20:output for the node that owns the output and becomes rank 0), or auto on every node (split by memory). Every node of the cluster must give one; the ranges must tile the model."),
    role: str = opt.role("Prefill/decode disaggregation: prefill (this node forms a one-rank group that streams prompts' K/V to decode groups) or decode (decode nodes form a tensor-parallel group once a prefill node runs, and take every prompt's K/V from it); draft (a spare machine that only drafts: this node forms a one-rank group serving --model, a draft model with the target's tokenizer, and the cluster's target group drafts with it by default, --draft remote:HOST:PORT); tp (default): an ordinary node. Nodes form only with nodes of their own role."),
    fetch_model: bool = typer.Option(False, "--fetch-model", help="This node has no copy of the model: fetch it from a peer that holds it (over the cluster's TLS, resumable, sha256-verified) into --models-dir, then form."),
    models_dir: Optional[str] = typer.Option(None, "--models-dir", help="Where --fetch-model keeps fetched models (default: ~/.cache/mlxcluster/models)."),
    dashboard_host: str = typer.Option("127.0.0.1", "--dashboard-host", help="Address of this node's dashboard (http://HOST:PORT/); beyond loopback it needs --api-key (or --insecure-no-auth)."),
    dashboard_port: Optional[int] = typer.Option(None, "--dashboard-port", help="Port of this node's dashboard (default 8477, or the next free port when 8477 is taken; 0 = any free port; a given port that is taken is an error)."),
    no_dashboard: bool = typer.Option(False, "--no-dashboard", help="Serve no dashboard."),
    api_key: List[str] = opt.api_key("API key the dashboard requires (repeatable): Authorization: Bearer KEY or x-api-key: KEY; the page asks for it once."),
    api_key_file: List[str] = opt.api_key_file("File of the dashboard's API keys, one per line (# comments)."),
    insecure_no_auth: bool = opt.insecure_no_auth("Serve the dashboard beyond loopback without API keys (anyone who reaches it can use the cluster)."),
    tls_cert: Optional[str] = opt.tls_cert("PEM certificate: serve the dashboard over HTTPS (with --tls-key)."),
    tls_key: Optional[str] = opt.tls_key(),
    spare: bool = typer.Option(False, "--spare", help="A spare: hold the model (read into the page cache while idle) and take a rank only in a lost member's place, at the same world size. Not with --layers or --role prefill."),
    no_standby: bool = typer.Option(False, "--no-standby", help="Keep no standby rank process (one started ahead, imports done and the model read when it fits in a quarter of the memory available, so that a re-formation starts this node's rank in a fraction of the time). Standbys serve ring, jaccl and world-size-1 formations: a node with --backend mpi, or auto where OpenMPI is usable, keeps none (mpirun starts MPI ranks)."),
    memory: Optional[str] = typer.Option(None, "--memory", help="Memory this node offers its ranks (e.g. 48GiB, 800MB): advertised to the cluster and planned with -- which shape forms, how many layers this node's pipeline stage gets -- instead of what the machine has available (keep the rest for other work)."),
    plan_mode: str = typer.Option("auto", "--plan", help="auto (default): without --world-size, --layers or --role, choose which nodes form what (one node alone, TP over a subset, a pipeline with uneven layer ranges) by the nodes' measured compute, memory and links (mlxcluster plan --cluster shows the ranking); manual: the largest world size the model splits into."),
    peer_timeout: float = typer.Option(3.0, "--peer-timeout", help="Seconds without an answered heartbeat (one each 0.5 s) after which a peer counts as lost and its formation re-forms without it: the time a frozen or cut-off node costs (a killed one is lost at once). Lower detects faster and risks re-forming under a stall. 1-60."),
    kv_bits: Optional[int] = opt.kv_bits(after=" Formations this node coordinates run it on every rank (a member runs its coordinator's)."),
    kv_group_size: Optional[int] = opt.kv_group_size(),
    prompt_cache_dir: Optional[str] = opt.prompt_cache_dir("This node's ranks: ", " A formation with another node re-formed in the same layout finds it again; a rank without one (or a topology without a disk tier) prefills."),
    prompt_cache_size: Optional[str] = opt.prompt_cache_size(),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the Thunderbolt network plan (per cable both ends and their /30 addresses, each Mac's commands, the jaccl device matrix and mesh/ring, the ring hostfile, problems) as MLX's mlx.distributed_config computes it, and exit without joining."),
    as_json: bool = opt.as_json("With --dry-run: print the plan as JSON."),
    recorded: Optional[str] = typer.Option(None, "--recorded", help="Read the macOS tools' outputs from DIR instead of running them: one folder per Mac, named by its host name, holding system_profiler_SPThunderboltDataType.json, networksetup_listallhardwareports.txt, ifconfig.txt, ibv_devices.txt and sw_vers.txt."),
    configure_network: bool = typer.Option(False, "--configure-network", help="Run this Mac's network commands of the plan with sudo (bridge0 down, one /30 per cable, a route per peer) before joining. Default: only print them when this Mac's cabled Thunderbolt ports lack an address."),
):
    """Join (or found) a cluster: discover peers over Bonjour/mDNS, form a tensor-parallel group (or,
    with --layers, a pipeline), serve."""
    from ..cluster.discovery import primary_address, resolve_interfaces
    from ..cluster.node import NodeConfig
    from ..model.tp import valid_world_sizes
    from ..runtime.backends import check_request

    _setup_logging(log_level)
    if as_json and not dry_run:
        raise _fail("--json prints the network plan: it needs --dry-run", 2)
    _thunderbolt_network(dry_run, as_json, recorded, configure_network)
    try:
        check_request(backend)
    except ValueError as exc:
        raise _fail(str(exc), 2)
    _check_weights(weights)
    _check_kv_bits(kv_bits, kv_group_size)
    cache = {}  # this node's ranks' disk tier: NodeConfig.prompt_cache_dir / _size
    if prompt_cache_dir is not None:
        cache = _prompt_cache_dir(prompt_cache_dir, prompt_cache_size)
    elif prompt_cache_size is not None:
        raise _fail("--prompt-cache-size needs --prompt-cache-dir", 2)
    if not 1.0 <= peer_timeout <= 60.0:
        raise _fail(f"--peer-timeout must be in 1..60 seconds, got {peer_timeout:g}", 2)
    board = None if no_dashboard else _dashboard(dashboard_host, dashboard_port, api_key, api_key_file,
                                                 insecure_no_auth, tls_cert, tls_key)
    secret = _read_secret(secret_file)
    try:
        addresses = resolve_interfaces(interface) if interface else []
    except ValueError as exc:
        raise _fail(str(exc))
    memory_limit = _check_join_shape(role, layers, world_size, exact_world_size, spare, plan_mode, memory)
    node = dict(spare=spare, exact_world_size=exact_world_size, standby=not no_standby and backend != "mpi",
                peer_timeout_s=peer_timeout, plan=plan_mode, memory_limit=memory_limit, **cache)  # NodeConfig's
    if fetch_model:
        if model is not None or layers is not None or role != "tp":
            raise _fail("--fetch-model takes the model from a peer: it excludes --model, --layers and --role", 2)
        cfg = _fetching_node(cluster, world_size, backend, weights, addresses, port, node_id, secret, models_dir)
        for field, value in node.items():
            setattr(cfg, field, value)
        if kv_bits is not None:  # the group size against the model's head_dim: checked by the ranks
            cfg.kv_bits, cfg.kv_group_size = int(kv_bits), int(kv_group_size or 64)
        _run_node(cfg, board)
        return
    info = _model_info(model)
    kv = _kv_options(kv_bits, kv_group_size, info)  # {"kv_bits": B, "kv_group_size": G} or {}
    layers = _node_layers(info, layers, world_size, role)
    fmt = _weight_format(info, weights, None if layers else world_size)
    address = addresses[0] if addresses else primary_address()
    cfg = NodeConfig(cluster=cluster, address=address, interfaces=addresses, port=port,
                     node_id=node_id or "", model_path=info.path, weights=fmt, backend=backend,
                     world_size=world_size, secret=secret,
                     valid_world_sizes=valid_world_sizes(info.config, info.quantization, fmt),
                     layers=layers or "", n_layers=info.n_layers, role="" if role == "tp" else role,
                     kv_bits=kv.get("kv_bits", 0), kv_group_size=kv.get("kv_group_size", 0),
                     recorded_dir=recorded or "", **node)
    _run_node(cfg, board)


def _dashboard(host: str, port: Optional[int], api_key, api_key_file, insecure_no_auth, tls_cert, tls_key):
    """``join``'s dashboard: ``(host, port, KeyRing or None, (cert, key) or None)`` (:func:`_run_node`'s
    ``board``); a port outside 0..65535 or what :func:`_http_security` refuses is a one-line error (exit 2)."""
    if port is not None and not 0 <= port <= 65535:
        raise _fail(f"--dashboard-port must be in 0..65535, got {port}", 2)
    return (host, port) + _http_security(host, api_key, api_key_file, insecure_no_auth, tls_cert, tls_key,
                                         "--dashboard-host")


def _check_join_shape(role: str, layers: Optional[str], world_size: Optional[int], exact_world_size: bool,
                      spare: bool, plan_mode: str, memory: Optional[str]) -> int:
    """``join``'s checks of what this node forms (``--role``, ``--layers``, ``--world-size``,
    ``--exact-world-size``, ``--spare``, ``--plan``); returns ``--memory`` in bytes (0: unset).  A value
    not allowed, or options that exclude each other, is a one-line error (exit 2)."""
    if role not in ("tp", "prefill", "decode", "draft"):
        raise _fail(f"--role {role!r}: choose tp, prefill, decode or draft", 2)
    if exact_world_size and world_size is None:
        raise _fail("--exact-world-size needs --world-size N (the size it keeps to)", 2)
    if plan_mode not in ("auto", "manual"):
        raise _fail(f"--plan {plan_mode!r}: choose auto or manual", 2)
    memory_limit = 0
    if memory is not None:
        from ..cluster.measure import parse_memory

        try:
            memory_limit = parse_memory(memory)
        except ValueError as exc:
            raise _fail(str(exc), 2)
    if role != "tp" and layers is not None:
        raise _fail(f"--role {role} forms tensor-parallel groups: it excludes --layers", 2)
    if role in ("prefill", "draft") and world_size not in (None, 1):
        raise _fail(f"--role {role} forms a group of this node alone: it excludes --world-size", 2)
    if spare and layers is not None:
        raise _fail("--spare takes a lost member's place in a tensor-parallel group: a pipeline stage (--layers) "
                    "has no stand-in", 2)
    if spare and role in ("draft", "prefill"):
        raise _fail(f"--spare with --role {role}: a {role} node forms a group of its own, so a second {role} node "
                    "is already a stand-in", 2)
    return memory_limit


def _node_layers(info, layers: Optional[str], world_size: Optional[int], role: str) -> Optional[str]:
    """``join --layers`` checked against the model ``info``: ``"auto"``, this node's range as
    ``"FIRST:LAST"`` / ``"FIRST:output"`` (:func:`~mlxcluster.model.layout.parse_range`), or ``None``
    without it.  A pipeline stage or a PD role of a model outside the Llama family, ``--world-size``
    beside ``--layers`` or a malformed range is a one-line error (exit 2)."""
    if layers is not None or role in ("prefill", "decode"):  # a draft node runs any model mlx-lm drafts with
        _need_llama(info, "--layers" if layers is not None else f"--role {role}")
    if layers is None:
        return None
    from ..model.layout import LayoutError, parse_range

    layers = layers.strip()
    if world_size is not None:
        raise _fail("--world-size and --layers exclude each other: a pipeline's size is its route's", 2)
    try:
        return layers if layers == "auto" else str(parse_range(layers, info.n_layers))
    except LayoutError as exc:
        raise _fail(str(exc), 2)


def _http_security(host, api_key, api_key_file, insecure_no_auth, tls_cert, tls_key, option):
    """An HTTP surface's ``(KeyRing or None, (cert, key) or None)`` from its ``--api-key``,
    ``--api-key-file``, ``--insecure-no-auth``, ``--tls-cert`` and ``--tls-key``; a one-line error
    (exit 2) for unreadable keys or TLS files, or a non-loopback ``host`` (``option``) without keys
    and without ``--insecure-no-auth`` (:func:`mlxcluster.front.auth.check_exposure`)."""
    import logging

    from ..front.auth import KeyRing, check_exposure, read_keys, tls_files

    try:
        keys = read_keys(api_key, api_key_file)
        check_exposure(host, keys, insecure_no_auth, option)
        tls = tls_files(tls_cert, tls_key)
    except ValueError as exc:
        raise _fail(str(exc), 2)
    if keys:
        logging.getLogger("mlxcluster.auth").info("%d API key(s): %s", len(keys),
                                                  ", ".join(KeyRing(keys).ids))
    return (KeyRing(keys) if keys else None), tls


def _run_node(cfg, board: Optional[Tuple] = None) -> None:
    """Run a node daemon, and its dashboard at ``board`` (host, port or ``None`` for the default,
    KeyRing or ``None``, (cert, key) or ``None``; ``board`` ``None``: no dashboard), until
    SIGTERM/SIGINT (then one line saying which); start-up errors are one line."""
    import signal

    from ..cluster.dashboard import NodeDashboard, bind
    from ..cluster.discovery import DiscoveryError
    from ..cluster.node import NodeDaemon

    dashboard = None
    try:
        sock = None
        if board is not None:
            host, port, auth, tls = board
            sock = bind(host, port)  # the default port, else the next free one (several nodes on a host)
        daemon = NodeDaemon(cfg)
        stopped_by: List[str] = []

        def _stop(signum, _frame):
            stopped_by.append(signal.Signals(signum).name)
            daemon.stop()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        if sock is not None:
            dashboard = NodeDashboard(daemon, sock, auth=auth, tls=tls)
            dashboard.start()
        daemon.run()
        if stopped_by:
            typer.echo(f"mlxcluster: node stopped ({stopped_by[0]})", err=True)
    except (OSError, ValueError, DiscoveryError) as exc:
        raise _fail(str(exc))
    finally:
        if dashboard is not None:
            dashboard.stop()


def _fetching_node(cluster, world_size, backend, weights, addresses, port, node_id, secret, models_dir):
    """The ``NodeConfig`` of ``join --fetch-model``: a node that starts without the model
    (:mod:`mlxcluster.cluster.transfer`) and derives the model's settings once it is here."""
    from ..cluster.discovery import primary_address
    from ..cluster.node import NodeConfig
    from ..model.tp import valid_world_sizes

    def configure(path: str) -> dict:  # once the model is here: what join derives from it
        info = _model_info(path)
        fmt = weights or _weight_format(info, None, None)
        return {"weights": fmt, "n_layers": info.n_layers,
                "valid_world_sizes": valid_world_sizes(info.config, info.quantization, fmt)}

    address = addresses[0] if addresses else primary_address()
    return NodeConfig(cluster=cluster, address=address, interfaces=addresses, port=port, node_id=node_id or "",
                      model_path="", weights=weights, backend=backend, world_size=world_size, secret=secret,
                      fetch_dir=models_dir or os.path.join(os.path.expanduser("~"), ".cache", "mlxcluster", "models"),
                      configure_model=configure)


@_command()
def status(
    cluster: str = opt.cluster("Cluster name.", default="default"),
    interface: List[str] = opt.interface("Interface name or IPv4 address to browse on (repeatable)."),
    timeout: float = opt.timeout("Seconds to browse for nodes."),
    as_json: bool = opt.as_json(),
    secret_file: Optional[str] = opt.secret_file(after=" Without a secret only what nodes advertise over mDNS is shown (unverified)."),
):
    """List the nodes of a cluster: ranks, states, backend and model."""
    from ..cluster.client import cluster_status
    from ..cluster.discovery import MAX_MEMORY_BYTES
    from ..security import CLIENT, credentials

    secret = _read_secret(secret_file, required=False)
    creds = credentials(secret, cluster, [CLIENT]) if secret else None
    try:
        nodes = cluster_status(cluster, interface, timeout, creds)
    except (ValueError, OSError) as exc:
        raise _fail(str(exc))
    if as_json:
        typer.echo(json.dumps(nodes, indent=2))
        return
    if not nodes:
        raise _fail(f"no nodes of cluster {cluster!r} found")
    formed = [n for n in nodes if n.get("rank") == 0 and n.get("state") == "ready"
              and n.get("role") not in ("prefill", "draft")]  # their groups serve other groups, not clients
    head = f"cluster {cluster!r}: {len(nodes)} node(s)"
    if formed:
        r0 = formed[0]
        head += (f", formed: world size {r0['world_size']}, backend {r0['backend']}, "
                 f"rank 0 at {r0['rank0_address']}, model {r0['model']}")
        if r0.get("backend_reason"):  # e.g. "no jaccl: no Thunderbolt cable between rank 0 (a) and rank 2 (c)"
            head += f"\nbackend {r0['backend']}: {r0['backend_reason']}"
        plan = r0.get("plan")
        if plan:  # the shape planner's prediction beside the measured figures (issue 31)
            head += "\n" + _plan_line(plan)
        if r0.get("draft_peer"):  # join --role draft: the group's default drafter
            head += f"\ndrafting with the draft node's group at {r0['draft_peer']} (remote:{r0['draft_peer']})"
    elif creds is None:
        head += " (advertised states, unverified: give the secret with MLXCLUSTER_SECRET or --secret-file)"
    else:
        head += ", not formed"
    spares = [n["node_id"] for n in nodes if n.get("spare")]
    if spares:
        head += f"\nspare node(s): {', '.join(spares)}"
    typer.echo(head)
    users: Dict[str, List[str]] = {}  # a draft group's address -> the formations (rank 0's node) drafting with it
    for n in nodes:
        if n.get("draft_peer") and n.get("rank") == 0:
            users.setdefault(n["draft_peer"], []).append(f"formation {n.get('formation_id')} ({n['node_id']})")
    typer.echo(f"{'NODE':<28} {'ADDRESS':<22} {'STATE':<9} {'RANK':<5} {'BACKENDS':<12} {'MEMORY':>9}  PLATFORM")
    for n in nodes:
        rank = str(n["rank"]) if n.get("formation_id") else "-"
        mem_bytes = n.get("memory_bytes") or 0  # 0: unknown (discovery reads implausible values as 0)
        mem = f"{mem_bytes / 2**30:.1f} GiB" if 0 < mem_bytes <= MAX_MEMORY_BYTES else "?"
        typer.echo(f"{n['node_id']:<28} {n['address']:<22} {n.get('state', '?'):<9} {rank:<5} "
                   f"{','.join(n.get('backends', [])):<12} {mem:>9}  {n.get('platform', '')}")
        if n.get("error"):  # why it is idle, failed or unreachable, e.g. "lost node(s) node-2"
            typer.echo(f"{'':<28} {n['error']}")
        if n.get("layers"):
            typer.echo(f"{'':<28} layers {n['layers']}")
        if n.get("spare"):
            typer.echo(f"{'':<28} spare" + ("" if n.get("formation_id") else ": takes a rank when a member is lost"))
        if n.get("role"):
            typer.echo(f"{'':<28} role {n['role']}" + (f", prefill group at {n['prefill_peer']}"
                                                      if n.get("prefill_peer") else "")
                       + (f": serving drafts at {n['rank0_address']}, used by "
                          + (", ".join(users.get(n["rank0_address"], [])) or "no group yet")
                          if n["role"] == "draft" and n.get("rank0_address") else ""))
        if n.get("draft_peer") and n.get("rank") == 0:
            typer.echo(f"{'':<28} drafts with the draft node's group at {n['draft_peer']}")
        if n.get("waiting") and not n.get("formation_id"):  # e.g. "no pipeline route yet: gap ..."
            typer.echo(f"{'':<28} waiting: {n['waiting']}")


def _plan_line(plan: dict) -> str:
    """``plan TP=3 on a,b,c (auto): predicted 11.7 tok/s, TTFT 0.21 s (512 tokens); measured 10.9 tok/s,
    TTFT 0.30 s`` from a node's ``plan`` dict (:func:`mlxcluster.cluster.node.plan_view`)."""
    pred = (f"predicted {plan['decode_tok_s']:.1f} tok/s, TTFT {plan['ttft_s']:.2f} s ({plan['prompt_tokens']} tokens)"
            if plan.get("decode_tok_s") else "not predicted")
    meas = []
    if plan.get("measured_decode_tok_s"):
        meas.append(f"{plan['measured_decode_tok_s']:.1f} tok/s")
    if plan.get("measured_ttft_s"):
        meas.append(f"TTFT {plan['measured_ttft_s']:.2f} s")
    line = f"plan {plan['label']} ({plan['mode']}): {pred}; measured " + (", ".join(meas) if meas else "nothing yet")
    return line + (f" -- {plan['note']}" if plan.get("note") else "")


@_command("plan")
def plan_cmd(
    measurements: Optional[str] = typer.Option(None, "--measurements", help="JSON file of the cluster's measurements (format: this command's help)."),
    model: Optional[str] = opt.model("Model (GGUF file, mlx-lm directory or Hugging Face repo id; default: the embedded SmolLM2-135M)."),
    weights: Optional[str] = opt.weights("Weight format the ranks would load (default: the fastest for this platform)."),
    context: int = typer.Option(4096, "--context", help="Context length each sequence must hold, tokens (its K/V cache counts in every node's memory)."),
    optimize: str = typer.Option("decode", "--optimize", help="decode (single-stream tok/s), throughput (tok/s at --batch) or ttft."),
    batch: int = typer.Option(8, "--batch", help="Sequences decoded together for --optimize throughput."),
    prompt_tokens: int = typer.Option(512, "--prompt-tokens", help="Prompt length of the TTFT figure, tokens."),
    top: int = typer.Option(30, "--top", help="Print at most this many candidates."),
    cluster: Optional[str] = opt.cluster("Plan from what the live nodes of cluster NAME measured (their compute, memory, links and backends; found over mDNS, needs the secret) instead of --measurements."),
    interface: List[str] = opt.interface(),
    timeout: float = opt.timeout(),
    secret_file: Optional[str] = opt.secret_file(opt.WITH_CLUSTER),
    save: Optional[str] = typer.Option(None, "--save", help="With --cluster: also write the gathered measurements to this JSON file (the --measurements format)."),
    kv_bits: Optional[int] = opt.kv_bits(help="The ranks' KV format (join --kv-bits 4|8): the K/V memory each candidate needs per token (default: full precision)."),
    kv_group_size: Optional[int] = opt.kv_group_size(),
):
    """Rank every plan for a cluster -- each node alone, TP, pipelines, TP x PP, PD -- by predicted
    decode tok/s, batch tok/s or TTFT, and say why each was not chosen (cluster/shape.py's cost model).

    The measurements file is JSON:

    {"nodes": [{"node_id": "a", "memory_bytes": 8000000000,
    "layer_s": 0.0012, "prefill_tokens_per_s": 250, "layer_batch_s": 0.00005, "head_s": 0.01,
    "chip": "Apple M2", "host": ""}, ...], "links": [{"a": "a", "b": "b", "latency_s": 0.00008,
    "bandwidth_bytes_per_s": 1.2e9, "interface": "en0"}, ...], "all_sum_us": {"mpi": 76, "ring": 4000}}

    Its fields: usable memory in bytes; layer_s one whole layer's decode time at batch 1 in seconds (layer_batch_s
    per extra sequence, head_s the embedding, head and sampling per step); prefill_tokens_per_s the
    whole model's on one rank; a link per node pair (latency in seconds, bandwidth in bytes/s); the
    measured all_sum of a decode-sized tensor per available backend in microseconds.
    """
    from ..cluster.shape import (ModelProfile, Request, ShapeError, all_sum_line, describe, measurements_from_json,
                                plan_shape)

    notes: List[str] = []
    _check_kv_bits(kv_bits, kv_group_size)
    if cluster is not None and measurements is not None:
        raise _fail("--cluster and --measurements exclude each other", 2)
    if cluster is None and measurements is None:
        raise _fail("plan needs --cluster NAME or --measurements FILE (a JSON file: see mlxcluster plan --help)", 2)
    if cluster is None and save is not None:
        raise _fail("--save writes what --cluster gathers: give --cluster", 2)
    if cluster is None:
        try:
            with open(measurements, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError) as exc:
            raise _fail(f"cannot read {measurements}: {exc}", 2)
    _check_weights(weights)
    info = _model_info(model)
    fmt = _weight_format(info, weights, None)
    if cluster is not None:
        from ..cluster.measure import combine, gather, measurements_json
        from ..model.loader import model_digest
        from ..security import CLIENT, credentials

        creds = credentials(_read_secret(secret_file), cluster, [CLIENT])
        try:
            reports, notes, digests = gather(cluster, interface, timeout, creds)
        except (ValueError, OSError) as exc:
            raise _fail(str(exc))
        if not digests and not notes:
            raise _fail(f"no nodes of cluster {cluster!r} found")
        others = sorted({d for d in digests.values() if d} - {model_digest(info.path)})
        if others:
            notes.append(f"the nodes serve model digest {', '.join(others)}, not {info.name}'s: pass its --model")
        doc = measurements_json(combine(reports))
        if not doc["nodes"]:
            raise _fail(f"no node of cluster {cluster!r} has measured its compute yet" +
                        (f" ({'; '.join(notes)})" if notes else ""))
        if save is not None:
            try:
                with open(save, "w", encoding="utf-8") as fh:
                    json.dump(doc, fh, indent=2)
            except OSError as exc:
                raise _fail(f"cannot write {save}: {exc}")
    try:
        m = measurements_from_json(doc)
        profile = ModelProfile.from_config(info.config, name=info.name, quantization=info.quantization, weights=fmt,
                                           kv_bits=kv_bits or 0, kv_group_size=kv_group_size or 64)
        ranked = plan_shape(m, profile, Request(context=context, optimize=optimize, batch=batch,
                                                prompt_tokens=prompt_tokens))
    except ShapeError as exc:
        raise _fail(str(exc), 2)
    for note in notes:
        typer.echo(f"note: {note}", err=True)
    typer.echo(f"{info.name}, {fmt} weights, context {context} tokens, optimize {optimize} "
               f"({len(m.nodes)} node(s), {len(ranked)} candidate(s); {all_sum_line(m)}):")
    for line in describe(ranked, optimize, limit=top):
        typer.echo(line)


@_command("models")
def models_cmd(
    paths: List[str] = typer.Argument(None, help="Model directories or GGUF files to list too (a directory of models is searched one level down)."),
    as_json: bool = opt.as_json(),
    cluster: Optional[str] = opt.cluster("List what each node of cluster NAME holds instead (found over mDNS; needs the secret)."),
    interface: List[str] = opt.interface(),
    timeout: float = opt.timeout(),
    secret_file: Optional[str] = opt.secret_file(opt.WITH_CLUSTER),
):
    """List the models on this machine: the embedded default, the Hugging Face cache (HF_HUB_CACHE)
    and PATHS.

    Each row gives the architecture, parameters, size, quantisation and the tensor-parallel world
    sizes the model splits into; pass its REF to --model.

    With --cluster: the model each node of the cluster holds (name, digest, size) or is fetching
    (join --fetch-model)."""
    if cluster is not None:
        if paths:
            raise _fail("--cluster lists the nodes' models: it takes no PATHS", 2)
        _cluster_models(cluster, interface, timeout, secret_file, as_json)
        return
    from ..model.catalog import list_models

    entries = list_models(paths or ())
    if as_json:
        typer.echo(json.dumps([e.as_dict() for e in entries], indent=2))
        return
    typer.echo(f"{'MODEL (--model)':<44} {'ARCH':<16} {'PARAMS':>8} {'SIZE':>9}  {'QUANTISATION':<22} WORLD SIZES")
    for e in entries:
        if e.error:
            typer.echo(f"{e.ref:<44} unreadable: {e.error}")
            continue
        params = f"{e.parameters / 1e6:.1f}M" if e.parameters is not None else "?"
        size = f"{e.size_bytes / 2**20:.1f} MiB"
        typer.echo(f"{e.ref:<44} {e.architecture:<16} {params:>8} {size:>9}  {e.quantization:<22} "
                   f"{','.join(map(str, e.valid_world_sizes))}" + ("  (default)" if e.default else ""))


def _cluster_models(cluster: str, interface: List[str], timeout: float, secret_file: Optional[str],
                    as_json: bool) -> None:
    """``models --cluster``: each verified node's model, or its transfer (one row per node)."""
    from ..cluster.client import cluster_status
    from ..security import CLIENT, credentials

    creds = credentials(_read_secret(secret_file), cluster, [CLIENT])
    try:
        nodes = cluster_status(cluster, interface, timeout, creds)
    except (ValueError, OSError) as exc:
        raise _fail(str(exc))
    if not nodes:
        raise _fail(f"no nodes of cluster {cluster!r} found")
    rows = []
    for n in nodes:
        fetch = n.get("fetch")
        if not n.get("verified"):
            held = f"unreachable: {n.get('error', '')}"
        elif n.get("model"):
            held = "holds" + (f" (fetched from {fetch['from']})" if fetch and fetch["state"] == "verified" else "")
        elif fetch:
            pct = 100.0 * fetch["done_bytes"] / max(1, fetch["total_bytes"])
            held = f"fetching from {fetch['from']}: {pct:.0f}% of {fetch['total_bytes'] / 2**20:.1f} MiB" \
                if fetch["state"] == "fetching" else f"fetch {fetch['state']}"
        else:
            held = "none (waiting for a peer that holds the model)"
        rows.append({"node_id": n["node_id"], "address": n["address"], "model": n.get("model", ""),
                     "model_digest": n.get("model_digest", ""), "model_bytes": n.get("model_bytes", 0),
                     "state": n.get("state", "?"), "holds": held, "fetch": fetch})
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    typer.echo(f"{'NODE':<28} {'MODEL':<36} {'DIGEST':<17} {'SIZE':>10}  STATUS")
    for r in rows:
        size = f"{r['model_bytes'] / 2**20:.1f} MiB" if r["model_bytes"] else "-"
        typer.echo(f"{r['node_id']:<28} {r['model'] or '-':<36} {r['model_digest'] or '-':<17} {size:>10}  {r['holds']}")


@_command()
def doctor(
    cluster: Optional[str] = opt.cluster("Check toward every node of cluster NAME (found over mDNS) and compare what the nodes advertise."),
    peer: List[str] = typer.Option([], "--peer", help="IPv4 address of another node to check the route and firewall toward (repeatable)."),
    facts: List[str] = typer.Option([], "--facts", help="Another node's `mlxcluster doctor --json` output, to compare versions and MTUs with (repeatable)."),
    interface: List[str] = opt.interface(),
    timeout: float = opt.timeout(),
    secret_file: Optional[str] = opt.secret_file(opt.WITH_CLUSTER, " Without a secret only what nodes advertise over mDNS is compared."),
    as_json: bool = opt.as_json("Print this node's report and the findings as JSON (the input of another node's --facts)."),
):
    """Check what blocks each backend on this node and print each finding with the command that
    fixes it.

    On Macs: RDMA (rdma_ctl, ibv_devices), Thunderbolt 5 link speed, ports inside bridge0, the macOS
    version and the route to each peer (Wi-Fi or Thunderbolt). On Linux: OpenMPI, OpenBLAS, the
    firewall and the route to each peer. Across nodes: the MLX and macOS versions and each cable's
    MTU.

    Exit status 1 when a finding is an error."""
    import ipaddress
    import socket

    from ..runtime.doctor import NodeReport, has_errors

    for p in peer:
        try:
            ipaddress.IPv4Address(p)
        except ValueError:
            raise _fail(f"--peer {p!r} is not an IPv4 address", 2)
    others = []
    for path in facts:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
            others.append(NodeReport.from_dict(data.get("report") if isinstance(data, dict) else None))
        except (OSError, ValueError) as exc:
            raise _fail(f"--facts {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", 2)
    if cluster is not None:
        from ..cluster.doctor import doctor_cluster
        from ..security import CLIENT, credentials

        secret = _read_secret(secret_file, required=False)
        creds = credentials(secret, cluster, [CLIENT]) if secret else None
        try:
            report, findings, _rows = doctor_cluster(cluster, interface, timeout, creds, others)
        except (ValueError, OSError, LookupError) as exc:
            raise _fail(str(exc))
        for p in peer:  # more peers than the cluster advertises
            if p not in report.peers:
                from ..runtime.doctor import check_route, route_command, run_tool

                findings += check_route(report.system, p, run_tool(route_command(report.system, p)))
    else:
        from ..runtime.doctor import doctor_local

        report, findings = doctor_local(socket.gethostname(), peer, others)
    if as_json:
        typer.echo(json.dumps({"report": report.to_dict(), "findings": [f.to_dict() for f in findings],
                               "errors": sum(f.severity == "error" for f in findings)}, indent=2))
    else:
        problems = [f for f in findings if f.severity != "note"]
        typer.echo(f"mlxcluster doctor: {report.name} ({report.system}, MLX {report.mlx_version or 'not installed'})"
                   + (f", {len(report.peers)} peer(s)" if report.peers else ""))
        for f in findings:
            typer.echo(f"{f.severity.upper():<8} {f.node + ': ' if f.node and f.node != report.name else ''}{f.what}")
            if f.fix_command:
                typer.echo(f"{'':<8} fix: {f.fix_command}")
            if f.detail and f.severity != "note":
                typer.echo(f"{'':<8} why: {f.detail}")
        if not problems:
            typer.echo("no problems found")
    raise typer.Exit(1 if has_errors(findings) else 0)


@_command("secret")
def secret_cmd():
    """Print a new random cluster secret (128 bits).

    Put it in a mode-600 file for --secret-file, e.g. `mlxcluster secret > ~/.mlxcluster-secret &&
    chmod 600 ~/.mlxcluster-secret`."""
    from ..security import new_secret

    typer.echo(new_secret())


@_command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(ctx: typer.Context):
    """Side-by-side benchmark: plain mlx-lm, mlx-lm's own TP, mlxcluster TP=1 and TP=N per backend.

    It measures decode/prefill tokens/s, TTFT, all_sum vs TCP RTT, control-plane time, bootstrap and
    peak memory. Options are those of benchmarks/bench.py (--world-size, --backends, --out-dir,
    --quick, ...).

    With --serving: serve against mlx_lm.server under 1-64 concurrent clients (output tok/s, TTFT,
    inter-token latency, requests/s, peak memory per rank; benchmarks/bench_serving.py).

    The harness lives in the source checkout, outside the installed package."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "benchmarks", "bench.py")
    if not os.path.isfile(path):
        raise _fail(f"the benchmark harness is not here ({path}): run it from a source checkout", 2)
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location("benchmarks.bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    raise typer.Exit(module.main(list(ctx.args)))


@_command("export")
def export_cmd(
    out: str = typer.Argument(..., help="Directory to write."),
    model: Optional[str] = opt.model("GGUF file (default: embedded model)."),
    dequantize: bool = typer.Option(False, "--dequantize", help="Write float32 weights instead of the packed quantised ones."),
):
    """Write a GGUF model as an mlx-lm model directory (config.json, model.safetensors, tokenizer)."""
    from ..model.export import export_mlx
    from ..model.loader import ModelError

    try:
        path = export_mlx(model, out, dequantize=dequantize)
    except (ModelError, OSError, ValueError) as exc:
        raise _fail(str(exc))
    typer.echo(path)


@_command()
def router(
    host: str = opt.host("Address of the users' OpenAI-compatible HTTP API."),
    port: int = opt.port(8080, "HTTP port for users."),
    grpc_host: Optional[str] = typer.Option(None, "--grpc-host", help="Address providers dial (default: --host)."),
    grpc_port: int = typer.Option(8081, "--grpc-port", help="gRPC port providers dial (Marketplace.Link)."),
    provider_token: Optional[str] = typer.Option(None, "--provider-token", envvar="MLXCLUSTER_PROVIDER_TOKEN",
                                                 help="Token providers must present (or MLXCLUSTER_PROVIDER_TOKEN)."),
    retry_attempts: int = typer.Option(2, "--retry-attempts", help="Other providers to try when one fails before answering."),
    max_continuations: int = typer.Option(2, "--max-continuations", help="Times an answer whose provider is lost mid-answer is continued on another provider of the same model digest (the user's stream goes on where it stopped); then it ends with one error naming the cause. 0: never."),
    heartbeat_timeout: float = typer.Option(5.0, "--heartbeat-timeout", help="Seconds of provider silence before it counts as lost."),
    api_key: List[str] = opt.api_key("A users' API key (repeatable): users send Authorization: Bearer KEY or x-api-key: KEY."),
    api_keys_file: List[str] = opt.api_key_file("File of the users' API keys, one per line (# comments).", "--api-keys-file"),
    no_auth: bool = opt.insecure_no_auth("Serve users without API keys (only behind another gateway).", "--no-auth"),
    rate_limit: float = typer.Option(600.0, "--rate-limit", help="Requests per minute per API key (0 = unlimited)."),
    log_level: str = opt.log_level(),
    tls_cert: Optional[str] = opt.tls_cert("PEM certificate (with --tls-key): users' API over HTTPS, and the certificate of the providers' TLS link."),
    tls_key: Optional[str] = opt.tls_key(),
    link_cert_dir: Optional[str] = typer.Option(None, "--link-cert-dir", help="Without --tls-cert: where the self-signed link certificate is kept and reused (router-link.pem, router-link.key; default ~/.cache/mlxcluster/router); providers trust it with serve --router-ca."),
):
    """Run a marketplace router until SIGINT/SIGTERM.

    Providers dial in over gRPC; users get one OpenAI-compatible API, routed to the least-loaded
    provider of the model."""
    import asyncio
    import signal

    _setup_logging(log_level)
    early: List[int] = []  # a signal that arrives while the heavy imports below run
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: early.append(signum))
    from ..router.server import Router

    if not provider_token:
        raise _fail("a provider token is required: --provider-token or MLXCLUSTER_PROVIDER_TOKEN", 2)
    if heartbeat_timeout <= 0 or retry_attempts < 0:
        raise _fail("--heartbeat-timeout must be positive and --retry-attempts at least 0", 2)
    if rate_limit < 0:
        raise _fail("--rate-limit must be at least 0", 2)
    if max_continuations < 0:
        raise _fail(f"--max-continuations must be at least 0, got {max_continuations}", 2)
    from ..front.auth import read_keys

    try:
        api_keys = read_keys(api_key, api_keys_file) or None
    except ValueError as exc:
        raise _fail(str(exc), 2)
    if api_keys and no_auth:
        raise _fail("--api-key/--api-key-file and --insecure-no-auth exclude each other", 2)
    if not api_keys and not no_auth:
        raise _fail("users need API keys: --api-key KEY or --api-key-file PATH (or --insecure-no-auth behind "
                    "another gateway)", 2)
    from ..front.auth import tls_files
    from ..router.server import link_certificate, link_names
    from ..security import fingerprint

    try:
        tls = tls_files(tls_cert, tls_key)
    except ValueError as exc:
        raise _fail(str(exc), 2)
    if tls is not None and link_cert_dir is not None:
        raise _fail("--link-cert-dir keeps a self-signed certificate: it excludes --tls-cert", 2)
    link_credentials = None
    if tls is None:  # the link is never plaintext: a self-signed certificate, kept for the next start
        directory = link_cert_dir or os.path.join(os.path.expanduser("~"), ".cache", "mlxcluster", "router")
        try:
            key_pem, cert_pem, cert_path, created = link_certificate(directory, link_names(grpc_host or host))
        except OSError as exc:
            raise _fail(str(exc))
        link_credentials = (key_pem, cert_pem)
        typer.echo(f"router: provider link certificate {cert_path} ({'new' if created else 'kept'}; SHA-256 "
                   f"{fingerprint(cert_pem)}); providers: serve --router HOST:PORT --router-ca {cert_path}", err=True)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if early:
            return
        r = Router(provider_token, retry_attempts=retry_attempts, heartbeat_timeout_s=heartbeat_timeout,
                   api_keys=api_keys, rate_limit_per_min=rate_limit, max_continuations=max_continuations)
        await r.start(host, port, grpc_host, grpc_port, tls=tls, link_credentials=link_credentials)
        typer.echo(f"router: users at http{'s' if tls else ''}://{host}:{r.http_port}/v1, providers (TLS) at "
                   f"{grpc_host or host}:{r.grpc_port}", err=True)
        try:
            await stop.wait()
        finally:
            await r.stop()

    try:
        asyncio.run(run())
    except OSError as exc:
        raise _fail(str(exc))


@_command()
def serve(
    world_size: int = opt.world_size("Local ranks to start (without --cluster)."),
    cluster: Optional[str] = opt.cluster("Serve the formed cluster NAME (found over mDNS) instead of starting local ranks."),
    interface: List[str] = opt.interface(),
    secret_file: Optional[str] = opt.secret_file("With --cluster, or --role prefill/decode/draft or --draft remote:HOST:PORT (the secret both groups share): ", " Other local ranks get a fresh random secret."),
    model: List[str] = typer.Option([], "--model", help="A .gguf file, mlx-lm model directory or Hugging Face repo id (default: embedded SmolLM2-135M-Instruct); with --cluster, the cluster's model (its tokenizer is read here). Repeat it to serve several models: the first is the default of requests that name no model and is loaded at start, the others load on their first request."),
    model_name: List[str] = typer.Option([], "--model-name", help="Model id clients pass as `model` (default: the model file's name); repeated, the i-th names the i-th --model."),
    models_file: Optional[str] = typer.Option(None, "--models-file", help="TOML file of models to serve, after any --model: [[model]] tables with name, path or ref, pinned (never evicted nor unloaded when idle), keep_alive or ttl (a duration: 5m, 1h, seconds; -1: never), world_size (docs/serving.md). Any error is one line at start."),
    max_loaded_models: Optional[int] = typer.Option(None, "--max-loaded-models", help="Several models: at most N loaded at once; a request for another unloads the least recently used idle unpinned one (Ollama's OLLAMA_MAX_LOADED_MODELS) (default: no bound but memory)."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget", help="Several models: the memory their weights may hold together, e.g. 48GiB (default: this machine's usable memory: MLX's recommended working set on a Mac, else the RAM available at start, less 1 GiB). A model that can never fit is refused in one line naming the memory."),
    keep_alive: Optional[str] = typer.Option(None, "--keep-alive", help="Several models: how long a model stays loaded after its last request (Ollama's keep_alive: 5m, 1h, 300ms, or seconds; 0: unload at once; negative: never) (default: 5m). A request's keep_alive (Ollama's field) overrides it for its model."),
    backend: str = opt.backend("ring, mpi, or auto (mpi when mpirun is installed, else ring)."),
    weights: Optional[str] = opt.weights(),
    host: str = opt.host("Address of the OpenAI-compatible HTTP API."),
    port: int = opt.port(8000, "HTTP port (0 = any free port)."),
    max_queue: Optional[int] = typer.Option(None, "--max-queue", help="Local ranks: requests that may wait at rank 0 for a batch slot; more are answered 429 (rank 0's --max-queue; default MLXCLUSTER_MAX_QUEUE or 64)."),
    max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="Local ranks: cap on the sequences rank 0 decodes together (rank 0's --max-batch; default MLXCLUSTER_MAX_BATCH or 64; the KV memory budget may admit fewer)."),
    itl_target_ms: Optional[float] = typer.Option(None, "--itl-target-ms", help="Local ranks: inter-token latency target in ms; a request waits rather than join a decode batch whose measured step time predicts a longer step (rank 0's --itl-target-ms; default MLXCLUSTER_ITL_TARGET_MS or 0: none)."),
    router: Optional[str] = typer.Option(None, "--router", help="Also offer this cluster to the marketplace router at URL."),
    router_token: Optional[str] = typer.Option(None, "--router-token", envvar=["MLXCLUSTER_ROUTER_TOKEN", "MLXCLUSTER_PROVIDER_TOKEN"], help="Token the router requires (or MLXCLUSTER_ROUTER_TOKEN / MLXCLUSTER_PROVIDER_TOKEN)."),
    start_timeout: float = opt.start_timeout(),
    log_level: str = opt.log_level(),
    layers: Optional[str] = opt.layers("Local ranks as a pipeline: one inclusive layer range per stage (e.g. 15:output,0:14), or auto; see generate --help."),
    stage_tp: Optional[str] = opt.stage_tp("With --layers: ranks per stage (e.g. 3,1; needs --backend mpi)."),
    local_decode: bool = opt.local_decode("With a reverse --layers route: distributed prefill, then rank 0 decodes alone (see generate --help)."),
    role: str = opt.role("tp (a group that prefills and decodes), prefill (a one-rank group that only streams prompts' K/V to decode groups: Generation.Prefill on --host:--port, no HTTP API), decode (with --prefill-peer: every prompt's K/V comes from that prefill group) or draft (a one-rank group serving --model as a draft model to target groups, --draft remote:HOST:PORT: Generation.Draft on --host:--port, no HTTP API)."),
    prefill_peer: Optional[str] = typer.Option(None, "--prefill-peer", help="With --role decode: HOST:PORT of the prefill group (its serve --role prefill --host/--port); a prompt whose stream is refused is prefilled here."),
    afd: Optional[str] = opt.afd("Local ranks as attention-FFN disaggregation A:1 (see generate --help)."),
    afd_microbatches: int = opt.afd_microbatches("With --afd: whole sequences in flight per round, ping-ponged per layer."),
    api_key: List[str] = opt.api_key("API key every request needs (repeatable): Authorization: Bearer KEY or x-api-key: KEY, on every endpoint and dialect but /health; the dashboard page asks for it once."),
    api_key_file: List[str] = opt.api_key_file("File of API keys, one per line (# comments)."),
    insecure_no_auth: bool = opt.insecure_no_auth("Serve a non-loopback --host without API keys (anyone who reaches it can use the cluster)."),
    tls_cert: Optional[str] = opt.tls_cert("PEM certificate: serve HTTPS (with --tls-key)."),
    tls_key: Optional[str] = opt.tls_key(),
    router_ca: Optional[str] = typer.Option(None, "--router-ca", help="With --router: PEM certificate(s) to trust for the router's TLS link (e.g. the self-signed one `mlxcluster router` wrote; default: the system's roots)."),
    max_replays: int = typer.Option(2, "--max-replays", help="Times a request is replayed on the next group when its group fails under it (the client's stream goes on where it stopped); then it fails with one 503 naming the cause. 0: fail at once."),
    unavailable_wait_s: float = typer.Option(60.0, "--unavailable-wait-s", help="Seconds a request waits for a serving group (while a failed one is replaced) before a 503 with Retry-After."),
    draft: Optional[str] = opt.draft("Local ranks: speculative decoding of every request that does not say otherwise (its `speculative` field): ngram or ngram:MIN-MAX (prompt lookup), model:PATH (a draft model with the same tokenizer, loaded once by rank 0 on the first request that drafts), layers:N (the model's first N layers with its norm and head draft) or remote:HOST:PORT (a draft group, serve --role draft, with --secret-file its secret) (default: off). A model that cannot speculate serves without it (logged once)."),
    draft_tokens: Optional[int] = opt.draft_tokens(note=""),
    prompt_cache_dir: Optional[str] = opt.prompt_cache_dir("Local ranks: "),
    prompt_cache_size: Optional[str] = opt.prompt_cache_size(),
    kv_bits: Optional[int] = opt.kv_bits("Local ranks: ", " A prefill and a decode group (--role) need the same: a K/V stream of another format is refused (the decode group then prefills)."),
    kv_group_size: Optional[int] = opt.kv_group_size(),
    cache_isolation: str = typer.Option("none", "--cache-isolation", help="none: prompts share the prefix caches unless a request sets cache_salt (vLLM's field: its own namespace); key: each API key's prompts also get their own namespace, so no client learns another's prompts through cached_tokens or time to first token (needs --api-key)."),
):
    """Serve the cluster as an OpenAI-compatible HTTP API until SIGINT/SIGTERM.

    Endpoints: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics. Local ranks are
    started unless --cluster.

    Several models (--model repeated, or --models-file): each in its own local group, loaded on its
    first request, unloaded after --keep-alive idle or to make room (--max-loaded-models,
    --memory-budget: the least recently used idle unpinned model first); requests pick one by their
    `model` field.

    With --role prefill/decode, two groups split each request: prefill and decode."""
    _setup_logging(log_level)
    if not 0 <= port <= 65535:
        raise _fail(f"--port must be in 0..65535, got {port}", 2)
    _check_role(role, prefill_peer, cluster)
    _check_kv_bits(kv_bits, kv_group_size, cluster)
    options = dict(layers=layers, stage_tp=stage_tp, local_decode=local_decode, afd=afd,
                   afd_microbatches=afd_microbatches, role="prefill" if role == "prefill" else "tp",
                   prefill_peer=prefill_peer)  # the topology's (Topology's fields)
    auth, tls = _http_security(host, api_key, api_key_file, insecure_no_auth, tls_cert, tls_key, "--host") \
        if role not in ("prefill", "draft") else (None, None)  # (a prefill or draft group serves no HTTP)
    _check_cache_isolation(cache_isolation, auth)
    if (prompt_cache_dir is not None or prompt_cache_size is not None) and (cluster is not None
                                                                             or role in ("prefill", "draft")):
        raise _fail("--prompt-cache-dir and --prompt-cache-size configure a local group of one rank that decodes: "
                    "they exclude --cluster and --role prefill/draft", 2)
    specs = _model_specs(model, model_name, models_file)
    pooled = len(specs) > 1 or models_file is not None or any(
        v is not None for v in (max_loaded_models, memory_budget, keep_alive))
    if pooled:
        _check_pool_options(cluster, role, options, router, draft)
    if role in ("prefill", "draft"):
        if draft is not None:
            raise _fail(f"--draft configures a target group's speculative decoding: --role {role} excludes it", 2)
        backend = _check_local_options(backend, weights)
        info = _model_info(specs[0].ref)
        fmt = _weight_format(info, weights, None)
        topology = _topology(info, fmt, world_size=world_size, **dict(options, role=role))
        _serve_prefill(info, topology, backend, fmt, host, port, _read_secret(secret_file), start_timeout, role,
                       config=_rank_config(**_kv_options(kv_bits, kv_group_size, info)))
        return
    rank = _rank0_options(cluster, secret_file, max_queue, max_concurrency, itl_target_ms, max_replays,
                               unavailable_wait_s, draft, draft_tokens)
    run_link, router_roots = _router_link(router, router_token, router_ca)
    failover = dict(max_replays=max_replays, unavailable_wait_s=unavailable_wait_s, cache_isolation=cache_isolation)
    if pooled:
        _serve_several(specs, world_size, backend, weights, rank, dict(
            prompt_cache_dir=prompt_cache_dir, prompt_cache_size=prompt_cache_size, kv_bits=kv_bits,
            kv_group_size=kv_group_size), dict(max_loaded_models=max_loaded_models, memory_budget=memory_budget,
                                              keep_alive=keep_alive), host, port, start_timeout, log_level.lower(),
            auth, tls, failover)
        return
    info = _model_info(specs[0].ref)
    name = specs[0].name or _served_name(info)
    if cluster is None:
        backend = _check_local_options(backend, weights)
        fmt = _weight_format(info, weights, None)
        topology = _topology(info, fmt, world_size=world_size, **options)
        rank = _rank_config(rank, **_prompt_cache_options(prompt_cache_dir, prompt_cache_size, topology),
                                   **_kv_options(kv_bits, kv_group_size, info))
        # a decode group (and its restarts) shares the prefill group's secret; other local groups get fresh ones
        remote_draft = draft is not None and draft.startswith("remote:")
        secret = _read_secret(secret_file) if role == "decode" or remote_draft else None
    else:
        _cluster_excludes(options)
    sock = _bind_http(host, port)  # first: a taken port fails before any rank starts
    source = _LocalGroups(info, topology, backend, fmt, start_timeout, rank, secret) if cluster is None \
        else _ClusterGroups(cluster, interface, secret_file)
    _serve_groups(sock, source, lambda first, start: _serve_http(
        sock, first, start, info.path, name, host, log_level.lower(), run_link, router, router_token, auth=auth,
        tls=tls, router_roots=router_roots, failover=failover))


def _model_specs(model: List[str], model_name: List[str], models_file: Optional[str]):
    """``serve``'s registry (:func:`mlxcluster.cli.registry.model_specs`): a one-line error (exit 2) for a
    models file that cannot be read or has a bad entry, or ``--model-name`` without its ``--model``."""
    from .registry import model_specs

    try:
        return model_specs(model, model_name, models_file)
    except ValueError as exc:
        raise _fail(str(exc), 2)


def _check_pool_options(cluster, role, options: dict, router, draft) -> None:
    """Several models (or the pool's options) on one ``serve``: a one-line error (exit 2) for the
    options the pool does not combine with yet: ``--cluster`` (placement over a formed cluster), a
    ``--role`` other than tp, one model's topology (``--layers``, ``--stage-tp``, ``--local-decode``,
    ``--afd``; a models file gives each model its ``world_size``), ``--router`` and a ``--draft`` other
    than ``ngram`` (a draft model serves one tokenizer)."""
    if cluster is not None:
        raise _fail("several models (--model twice, --models-file, --max-loaded-models, --memory-budget, "
                    "--keep-alive) need local ranks: --cluster serves the formed cluster's one model", 2)
    if role != "tp":
        raise _fail(f"several models need --role tp: --role {role} serves one model", 2)
    given = [f"--{k.replace('_', '-')}" for k in ("layers", "stage_tp", "afd") if options.get(k) is not None]
    given += ["--local-decode"] if options.get("local_decode") else []
    if given:
        raise _fail(f"{given[0]} sets one model's topology: with several models give each its world_size in "
                    "--models-file (tensor parallelism)", 2)
    if router is not None:
        raise _fail("--router offers one model to the marketplace router: it excludes several models", 2)
    if draft is not None and not draft.startswith("ngram"):
        raise _fail("--draft with several models: only ngram (prompt lookup) drafts for every model", 2)


def _serve_several(specs, world_size, backend, weights, rank, rank_options: dict, pool_options: dict, host,
                   port, start_timeout, log_level, auth, tls, failover) -> None:
    """``serve`` of several models (:class:`~mlxcluster.front.pool.ModelPool`): each model read and
    checked (its topology at its world size, its memory), the pool's bounds checked against them (a
    model that can never fit, pinned models beyond the budget or the count: one line, exit 2), then
    the default model started and the API served (:func:`~mlxcluster.cli.serving._serve_pool_http`)."""
    from ..front.residency import gib, parse_keep_alive

    backend = _check_local_options(backend, weights)
    models, sources, paths = _pool_models(specs, world_size, backend, weights, rank, rank_options, start_timeout)
    max_loaded, budget = pool_options["max_loaded_models"], _memory_budget(pool_options["memory_budget"])
    if max_loaded is not None and max_loaded < 1:
        raise _fail(f"--max-loaded-models must be at least 1, got {max_loaded}", 2)
    try:
        keep = parse_keep_alive(pool_options["keep_alive"] if pool_options["keep_alive"] is not None else "5m",
                                "--keep-alive")
    except ValueError as exc:
        raise _fail(str(exc), 2)
    for m in models:
        if m.bytes > budget:
            raise _fail(f"model {m.name!r} needs {gib(m.bytes)} ({m.bytes} bytes of weights) but the memory budget "
                        f"is {gib(budget)} ({budget} bytes): it can never be loaded here (--memory-budget, a smaller "
                        "quantization, or leave it out)", 2)
    pinned = [m for m in models if m.pinned]
    if sum(m.bytes for m in pinned) > budget:
        raise _fail(f"the pinned models ({', '.join(m.name for m in pinned)}) need "
                    f"{gib(sum(m.bytes for m in pinned))} together but the memory budget is {gib(budget)}", 2)
    if max_loaded is not None and len(pinned) > max_loaded:
        raise _fail(f"{len(pinned)} pinned models ({', '.join(m.name for m in pinned)}) are more than "
                    f"--max-loaded-models {max_loaded}", 2)
    sock = _bind_http(host, port)  # first: a taken port fails before any rank starts
    _serve_groups(sock, _ModelGroups(sources, models[0].name), lambda first, start: _serve_pool_http(
        sock, first, start, models, paths, host, log_level, auth=auth, tls=tls, failover=failover,
        pool=dict(budget_bytes=budget, max_loaded=max_loaded, keep_alive_s=keep)))


def _pool_models(specs, world_size, backend, weights, rank, rank_options: dict, start_timeout):
    """Each registered model read and checked: ``(PoolModel entries, {name: _LocalGroups}, {name: path})``.
    A model that cannot be read is one line (exit 1, as ``--model``), a topology that does not fit it or
    two models of one name one line (exit 2)."""
    from ..engine.memory import held_bytes, weight_file_bytes
    from ..front.pool import PoolModel
    from ..front.provider import describe_model
    from .registry import duplicate_names

    models, sources, paths = [], {}, {}
    for spec in specs:
        info = _model_info(spec.ref)
        fmt = _weight_format(info, weights, None)
        topology = _topology(info, fmt, world_size=spec.world_size or world_size)
        config = _rank_config(rank, **_prompt_cache_options(rank_options["prompt_cache_dir"],
                                                            rank_options["prompt_cache_size"], topology),
                              **_kv_options(rank_options["kv_bits"], rank_options["kv_group_size"], info))
        name = spec.name or _served_name(info)
        size = held_bytes(weight_file_bytes(info.path), info.quantization, fmt)
        models.append(PoolModel(name, size, spec.pinned, spec.keep_alive_s, size if sys.platform == "darwin" else 0,
                                lambda path=info.path, fmt=fmt, ctx=info.context_length: dict(
                                    describe_model(path), weight_format=fmt, context_length=ctx)))
        sources[name] = _LocalGroups(info, topology, backend, fmt, start_timeout, config, None)
        paths[name] = info.path
    twice = duplicate_names([m.name for m in models])
    if twice:
        name = next(iter(twice))
        raise _fail(f"model name {name!r} is given to {twice[name]} models: give each its own --model-name "
                    "(or name in --models-file)", 2)
    return models, sources, paths


def _memory_budget(text: Optional[str]) -> int:
    """``--memory-budget`` in bytes (one-line error, exit 2, for a bad size); unset: this machine's usable
    memory (:func:`mlxcluster.cluster.measure.usable_memory_bytes`; unknown: a one-line error asking
    for the option)."""
    from ..config import parse_bytes

    if text is not None:
        try:
            return parse_bytes(text, "--memory-budget", "48GiB, 800MB", minimum=10**6, too_small="at least 1 MB")
        except ValueError as exc:
            raise _fail(str(exc), 2)
    from ..cluster.measure import usable_memory_bytes

    usable = usable_memory_bytes()
    if usable <= 0:
        raise _fail("this machine's usable memory is unknown: give --memory-budget SIZE", 2)
    return usable


def _check_cache_isolation(cache_isolation: str, auth) -> None:
    """``serve --cache-isolation``: ``none`` or ``key``, and ``key`` only with API keys (``auth``, a
    :class:`~mlxcluster.front.auth.KeyRing` or ``None``); else a one-line error (exit 2)."""
    from ..front.provider import CACHE_ISOLATION

    if cache_isolation not in CACHE_ISOLATION:
        raise _fail(f"--cache-isolation must be {' or '.join(CACHE_ISOLATION)}, got {cache_isolation!r}", 2)
    if cache_isolation == "key" and auth is None:
        raise _fail("--cache-isolation key isolates API keys' prompts: give --api-key KEY (or --api-key-file FILE)", 2)


def _rank_config(base: Optional["RankConfig"] = None, **fields) -> "RankConfig":
    """``base`` (default: a new :class:`~mlxcluster.runtime.rank_config.RankConfig`) with ``fields`` replaced."""
    import dataclasses

    from ..runtime.rank_config import RankConfig

    return dataclasses.replace(base if base is not None else RankConfig(), **fields)


def _rank0_options(cluster, secret_file, max_queue, max_concurrency, itl_target_ms, max_replays,
                   unavailable_wait_s, draft, draft_tokens) -> "RankConfig":
    """``serve``'s checks of its admission, failover and speculation options, and the local ranks'
    :class:`~mlxcluster.runtime.rank_config.RankConfig` they give (``draft``, ``draft_tokens``,
    ``max_queue``, ``max_batch`` (``--max-concurrency``), ``itl_target_ms``; unset: the ranks' defaults).  A value out of
    range, one of them beside ``--cluster`` (rank 0's own settings apply there), or ``--draft
    remote:HOST:PORT`` without the draft group's secret is a one-line error (exit 2)."""
    if max_queue is not None and max_queue < 0:
        raise _fail("--max-queue must be at least 0", 2)
    if max_replays < 0:
        raise _fail(f"--max-replays must be at least 0, got {max_replays}", 2)
    if not 0 <= unavailable_wait_s < float("inf"):
        raise _fail(f"--unavailable-wait-s must be a number of seconds >= 0, got {unavailable_wait_s}", 2)
    if max_concurrency is not None and max_concurrency < 1:
        raise _fail("--max-concurrency must be at least 1", 2)
    if itl_target_ms is not None and not itl_target_ms >= 0:
        raise _fail("--itl-target-ms must be at least 0", 2)
    if cluster is not None and (max_queue is not None or max_concurrency is not None or itl_target_ms is not None
                                or draft is not None):
        raise _fail("--max-queue, --max-concurrency, --itl-target-ms and --draft configure local ranks; with "
                    "--cluster rank 0's own settings apply", 2)
    fields = _draft_options(draft, draft_tokens, per_request=False)
    # a remote drafter's calls are mutual TLS under the draft group's secret: the local ranks share it
    if draft is not None and draft.startswith("remote:") and cluster is None and secret_file is None \
            and not _env_secret():
        raise _fail("--draft remote:HOST:PORT needs --secret-file: the secret the draft group (serve --role draft) "
                    "was started with", 2)
    from ..runtime.rank_config import RankConfig

    return RankConfig(max_queue=max_queue, max_batch=max_concurrency,
                      itl_target_ms=None if itl_target_ms is None else float(itl_target_ms), **fields)


def _router_link(router: Optional[str], router_token: Optional[str], router_ca: Optional[str]):
    """``serve --router``: ``(run_link, PEM roots)`` of the link to the marketplace router
    (:func:`mlxcluster.front.link.run_link`), ``(None, None)`` without ``--router``; a missing URL or
    token, a malformed URL, an unreadable ``--router-ca`` or one without ``--router`` is a one-line
    error (exit 2)."""
    if router is None:
        if router_ca is not None:
            raise _fail("--router-ca needs --router", 2)
        return None, None
    if not router.strip():
        raise _fail("--router needs the router's URL", 2)
    if not router_token:
        raise _fail("--router needs a token: --router-token or MLXCLUSTER_ROUTER_TOKEN", 2)
    from ..front.link import parse_router_url, read_ca, run_link

    try:
        parse_router_url(router)
        return run_link, read_ca(router_ca)
    except ValueError as exc:
        raise _fail(str(exc), 2)


def _served_name(info) -> str:
    """The model id clients pass as ``model`` by default: the Hugging Face repo id, else the model
    directory's or file's name (without ``.gguf``)."""
    if info.repo_id:
        return info.repo_id
    if os.path.isdir(info.path):
        return os.path.basename(os.path.normpath(info.path))
    return os.path.splitext(os.path.basename(info.path))[0]


def _check_role(role, prefill_peer, cluster) -> None:
    """``serve --role``: a one-line error (exit 2) for a role other than tp, prefill or decode, or one
    its other options do not fit.  (A decode group is a ``tp`` topology with a ``--prefill-peer``;
    the topology's own rules are :meth:`Topology.validate`'s.)"""
    if role not in ("tp", "prefill", "decode", "draft"):
        raise _fail(f"--role {role!r}: choose tp, prefill, decode or draft", 2)
    if role in ("tp", "draft") and prefill_peer is not None:
        raise _fail("--prefill-peer needs --role decode", 2)
    if role == "tp":
        if prefill_peer is not None:
            raise _fail("--prefill-peer needs --role decode", 2)
        return
    if cluster is not None:
        raise _fail(f"--role {role} starts local tensor-parallel ranks: it excludes --cluster", 2)
    if role == "decode" and not prefill_peer:
        raise _fail("--role decode needs --prefill-peer HOST:PORT (the prefill group's serve --role prefill)", 2)


def main() -> None:
    """The ``mlxcluster`` command.  A usage error (an unknown option, a missing or malformed argument)
    is one line on stderr and exit status 2, as the commands' own errors (:func:`_fail`), instead of
    click's boxed multi-line message; an abort (end of input at a prompt) is one line, exit status 130.
    (``typer.Abort``, not the click module's: typer >= 0.24's own click defines no ``Abort``.)"""
    try:
        from typer._click import exceptions as cx  # typer >= 0.24 carries its own click
    except ImportError:  # pragma: no cover - older typer on click
        from click import exceptions as cx

    try:
        code = app(standalone_mode=False)
    except cx.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `mlxcluster` / `mlxcluster router`: the help
            exc.show()
            sys.exit(exc.exit_code)
        names, ctx = [], exc.ctx
        while ctx is not None and ctx.parent is not None:  # the subcommands, not how the program was run
            names.append(ctx.info_name)
            ctx = ctx.parent
        where = " ".join(["mlxcluster", *reversed(names), "--help"])
        typer.echo(f"mlxcluster: error: {' '.join(exc.format_message().split())} (see {where})", err=True)
        sys.exit(2)
    except cx.ClickException as exc:  # another of click's errors (an unreadable file argument): one line
        typer.echo(f"mlxcluster: error: {' '.join(exc.format_message().split())}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("mlxcluster: aborted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
