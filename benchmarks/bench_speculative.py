"""Speculative decoding with n-gram (prompt lookup), draft-model and self-speculative drafting, side by
side with mlx-lm (issue 30).

One run on one machine, the same weights (the default SmolLM2-135M GGUF exported once as an mlx-lm
directory, float32; the draft model: its first ``--draft-layers`` layers, norm and head exported as an
mlx-lm directory of their own, the same tokenizer) and the same prompt token ids, greedy, on two prompt
sets:

  * ``repetitive``: the answer copies spans of the prompt (repeat a given text, edit a given piece of
    code, list a given text's items) -- where prompt lookup pays;
  * ``chat``: open questions (bench_serving's) -- where it should turn itself down.

Rows:

  * ``mlx-lm generate_step``: plain mlx-lm (``mlx_lm.generate.generate_step``) in a process of its own
    with the ranks' BLAS environment (:func:`~mlxcluster.runtime.blas.rank_environment`), as bench.py's;
  * ``mlx-lm speculative_generate_step draft=L layers k=K``: mlx-lm's own speculative decoding in the
    same process, the draft model above, ``num_draft_tokens=K`` (fixed); mlx-lm has no prompt-lookup
    drafter, so n-gram rows compare with its plain decoding;
  * ``mlxcluster TP=N off``: a :class:`~mlxcluster.runtime.launcher.LocalCluster` of N ranks, each
    request with ``speculative`` off;
  * ``mlxcluster TP=N ngram k<=K``, ``model k<=K`` (``model:DRAFT_DIR``, the same draft model as
    mlx-lm's) and ``layers:L k<=K`` (the target's own first L layers: the same weights as the draft
    model, no second model): the same group, each request with that ``speculative`` (``k`` adapted
    below ``K`` by the measured acceptance rate, verify cost and draft time).

Per row and set: decode tokens/s (the median over the set's prompts of each prompt's best decode rate
of ``--repeats`` answers, the two mlxcluster modes answering each prompt in turn: tokens after the
first over the time after the first), acceptance rate (accepted / drafted draft
tokens over the set) and tokens per decode step; and whether the answers equal the plain ones token
for token.  Prints a Markdown table; ``--json FILE`` writes the figures.

Usage::

    python benchmarks/bench_speculative.py [--world-sizes 1] [--draft-tokens 4] [--max-tokens 96]
        [--draft-layers 8] [--weights float32] [--skip-mlx-lm] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # python benchmarks/bench_speculative.py from an uninstalled checkout
    sys.path.insert(0, ROOT)

from benchmarks.common import machine_description, prepare_mlx_dir, scratch_dir  # noqa: E402

CODE = '''def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)


def variance(xs):
    m = mean(xs)
    total = 0
    for x in xs:
        total += (x - m) ** 2
    return total / len(xs)
'''
TEXT = ("The lighthouse stood at the end of the rocky point. Every night the keeper climbed the ninety steps, "
        "lit the lamp and wound the clockwork that turned the lens. Ships passing in the dark saw the beam "
        "sweep across the water once every ten seconds, and they knew where the rocks were.")
REPETITIVE = [
    "Repeat the following text exactly, word for word:\n\n" + TEXT,
    "Rename the function `mean` to `average` everywhere in this code and print the whole code:\n\n" + CODE,
    "Add a docstring to each function of this code and print the whole code:\n\n" + CODE,
    "Copy this paragraph, then say how many sentences it has:\n\n" + TEXT,
]


def _chat_prompts() -> List[str]:
    from benchmarks.bench_serving import PROMPTS

    return list(PROMPTS[:4])


def _ids(tokenizer, prompts: List[str]) -> List[List[int]]:
    from mlxcluster.model.tokenizer import apply_chat

    return [list(apply_chat(tokenizer, p, None)) for p in prompts]


def bench_mlxlm(mlx_dir: str, sets: Dict[str, List[List[int]]], max_tokens: int, repeats: int = 2,
                draft_dir: str = "", draft_tokens: int = 4) -> Dict[str, Dict[str, Any]]:
    """mlx-lm on each set's prompts (greedy), in this process: rows ``plain`` (``generate_step``) and,
    with ``draft_dir``, ``speculative`` (``speculative_generate_step`` with that draft model and
    ``num_draft_tokens=draft_tokens``), each prompt answered by both in turn."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.utils import load

    model, tokenizer = load(mlx_dir)
    draft = load(draft_dir)[0] if draft_dir else None
    eos = set(tokenizer.eos_token_ids)

    def run(ids, speculative):
        times, tokens, from_draft = [], [], 0
        steps = (speculative_generate_step(mx.array(ids), model, draft, num_draft_tokens=draft_tokens,
                                           max_tokens=max_tokens) if speculative else
                 ((t, lp, False) for t, lp in generate_step(mx.array(ids), model, max_tokens=max_tokens)))
        for tok, _, drafted in steps:
            times.append(time.perf_counter())
            tokens.append(int(tok))
            from_draft += bool(drafted)
            if tokens[-1] in eos:
                break
        rate = (len(tokens) - 1) / (times[-1] - times[0]) if len(tokens) > 1 else 0.0
        return tokens, rate, from_draft

    run(sets["chat"][0][:16], False)  # warm
    if draft is not None:
        run(sets["chat"][0][:16], True)
    modes = ["plain"] + (["speculative"] if draft is not None else [])
    out: Dict[str, Dict[str, Any]] = {m: {} for m in modes}
    for name, prompts in sets.items():
        got = {m: [] for m in modes}
        for ids in prompts:
            runs = {m: [] for m in modes}
            for _ in range(repeats):
                for m in modes:
                    runs[m].append(run(ids, m == "speculative"))
            for m in modes:
                got[m].append(max(runs[m], key=lambda a: a[1]))
        for m in modes:
            answers = got[m]
            accepted = sum(a[2] for a in answers)
            # each verify step yields its accepted drafts and one token of the target's
            steps = sum(len(a[0]) - a[2] for a in answers)
            out[m][name] = {"tokens_per_s": statistics.median(a[1] for a in answers),
                            "token_ids": [a[0] for a in answers],
                            "acceptance_rate": accepted / (steps * draft_tokens) if m == "speculative" and steps
                            else None,
                            "tokens_per_step": sum(len(a[0]) for a in answers) / steps if steps else 1.0}
    return out


def bench_mlxlm_process(mlx_dir: str, sets: Dict[str, List[List[int]]], max_tokens: int, repeats: int,
                        work: str, draft_dir: str = "", draft_tokens: int = 4) -> Dict[str, Dict[str, Any]]:
    """:func:`bench_mlxlm` in a child process with the ranks' BLAS environment (OpenBLAS preloaded,
    its threads): what a rank computes with.

    Raises:
        RuntimeError: the child failed (its last line)."""
    from mlxcluster.runtime.blas import rank_environment

    path = os.path.join(work, "sets.json")
    with open(path, "w") as f:
        json.dump(sets, f)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--mlx-lm-worker", mlx_dir, path,
                           str(max_tokens), str(repeats), draft_dir, str(draft_tokens)],
                          env=dict(os.environ, **rank_environment(1)),
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"mlx-lm worker failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench_mlxcluster(model: str, weights: str, world: int, sets: Dict[str, List[List[int]]], max_tokens: int,
                     draft_tokens: int, repeats: int = 2, draft_dir: str = "",
                     draft_layers: int = 0) -> Dict[str, Dict[str, Any]]:
    """One group of ``world`` ranks; each set's prompts without and with drafting (per request): n-gram,
    and with ``draft_dir`` the draft model ``model:DRAFT_DIR``, with ``draft_layers`` ``layers:L``."""
    from mlxcluster.leader.generation import GenerationClient
    from mlxcluster.runtime.launcher import LocalCluster, mpirun_path

    backend = "mpi" if world > 1 and mpirun_path() else "ring"
    rows: Dict[str, Dict[str, Any]] = {}
    with LocalCluster(world, backend, model=model, weights=weights, start_timeout_s=300) as cluster:
        client = GenerationClient(cluster.address, cluster.credentials, timeout_s=900)
        try:
            client.generate(prompt_ids=sets["chat"][0], max_tokens=8)  # warm
            modes = (("off", ("off", 0)), (f"ngram k<={draft_tokens}", ("ngram", draft_tokens)))
            if draft_dir:
                modes += ((f"model k<={draft_tokens}", (f"model:{draft_dir}", draft_tokens)),)
            if draft_layers:
                modes += ((f"layers:{draft_layers} k<={draft_tokens}", (f"layers:{draft_layers}", draft_tokens)),)
            for _, spec in modes[2:]:  # load the draft weights before timing
                client.generate(prompt_ids=sets["chat"][0], max_tokens=4, speculative=spec)
            prefix = f"mlxcluster TP={world}{' ' + backend if world > 1 else ''}"
            for name, prompts in sets.items():
                # each prompt without and with drafting in turn, `repeats` times (the best rate of each:
                # a shared machine's load drifts less between two answers than between two sets)
                got = {label: [[] for _ in prompts] for label, _ in modes}
                for i, ids in enumerate(prompts):
                    for _ in range(repeats):
                        for label, spec in modes:
                            got[label][i].append(client.generate(prompt_ids=ids, max_tokens=max_tokens,
                                                                 speculative=spec))
                for label, _ in modes:
                    results = [runs[0] for runs in got[label]]
                    drafted = sum(r.spec_drafted_tokens for r in results)
                    steps = sum(r.decode_steps for r in results)
                    rows.setdefault(f"{prefix} {label}", {})[name] = {
                        "tokens_per_s": statistics.median(max(r.decode_tokens_per_s for r in runs)
                                                          for runs in got[label]),
                        "acceptance_rate": sum(r.spec_accepted_tokens for r in results) / drafted if drafted else None,
                        "tokens_per_step": sum(len(r.token_ids) - 1 for r in results) / steps if steps else 0.0,
                        "drafted": drafted, "token_ids": [list(r.token_ids) for r in results]}
        finally:
            client.close()
    return rows


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--mlx-lm-worker"]:  # the child: MLX_DIR SETS_JSON MAX_TOKENS REPEATS DRAFT_DIR DRAFT_TOKENS
        with open(argv[2]) as f:
            sets = json.load(f)
        print(json.dumps(bench_mlxlm(argv[1], sets, int(argv[3]), int(argv[4]), argv[5], int(argv[6]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world-sizes", default="1", help="comma-separated TP sizes of mlxcluster groups (default 1)")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=8,
                    help="the draft model: the target's first L layers (model:DIR rows, mlx-lm's draft_model; "
                         "layers:L rows); 0: n-gram rows only")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2, help="answers per prompt and mode; the best rate counts")
    ap.add_argument("--weights", default="float32")
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    from mlxcluster.model.loader import default_model_path, read_model

    model = args.model or default_model_path()
    src = read_model(model)
    sets = {"repetitive": _ids(src.tokenizer, REPETITIVE), "chat": _ids(src.tokenizer, _chat_prompts())}
    rows: Dict[str, Dict[str, Any]] = {}
    t0 = time.time()
    L, K = args.draft_layers, args.draft_tokens
    with tempfile.TemporaryDirectory(dir=scratch_dir()) as work:
        draft_dir = ""
        if L:
            from mlxcluster.engine.drafters import export_first_layers

            draft_dir = export_first_layers(model, os.path.join(work, f"draft-{L}-layers"), L)
        if not args.skip_mlx_lm:
            got = bench_mlxlm_process(prepare_mlx_dir(model, args.weights, work), sets, args.max_tokens,
                                      args.repeats, work, draft_dir, K)
            rows["mlx-lm generate_step"] = got["plain"]
            if "speculative" in got:
                rows[f"mlx-lm speculative_generate_step draft={L} layers k={K}"] = got["speculative"]
        for world in [int(w) for w in args.world_sizes.split(",")]:
            rows.update(bench_mlxcluster(model, args.weights, world, sets, args.max_tokens, K, args.repeats,
                                         draft_dir, L))
    plain = {name: next((r[name]["token_ids"] for label, r in rows.items() if label.endswith(" off")), None)
             for name in sets}
    print(f"# speculative decoding ({machine_description()}; {args.weights}; greedy; draft model: the first {L} "
          f"layers; "
          f"{args.max_tokens} tokens max; {len(REPETITIVE)} repetitive + {len(sets['chat'])} chat prompts; "
          f"{time.time() - t0:.0f} s)\n")
    print("| row | set | decode tok/s | vs plain | acceptance | tokens/step | answers = plain |")
    print("|---|---|---:|---:|---:|---:|---|")
    for label, r in rows.items():
        for name in sets:
            x = r[name]
            base = next((rr[name]["tokens_per_s"] for ll, rr in rows.items()
                         if ll.endswith(" off") and ll.split(" ")[1] == label.split(" ")[1]), None)
            if label.startswith("mlx-lm"):
                base = rows.get("mlx-lm generate_step", {}).get(name, {}).get("tokens_per_s")
            ratio = x["tokens_per_s"] / base if base else None
            same = "-" if plain[name] is None else ("yes" if x["token_ids"] == plain[name] else "NO")
            print(f"| {label} | {name} | {_fmt(x['tokens_per_s'])} | {_fmt(ratio, '.2f') + ('x' if ratio else '')} | "
                  f"{_fmt(x['acceptance_rate'], '.2f')} | {_fmt(x['tokens_per_step'], '.2f')} | {same} |")
    print("\nvs plain: against the same system's plain row (mlx-lm's generate_step for mlx-lm rows). mlx-lm has "
          "no prompt-lookup drafter: compare n-gram rows with its plain generate_step. mlx-lm drafts a fixed k; "
          "mlxcluster adapts k <= K per request.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {n: {kk: vv for kk, vv in v.items() if kk != "token_ids"} for n, v in r.items()}
                       for k, r in rows.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
