"""``mlxcluster`` command line."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Tensor-parallel LLM inference over MLX ranks.")


def _fail(message: str, code: int = 1) -> "typer.Exit":
    typer.echo(f"mlxcluster: error: {message}", err=True)
    return typer.Exit(code)


class _Progress:
    """Shows rank start-up progress on stderr (one line, rewritten in place on a TTY)."""

    def __init__(self, world_size: int, enabled: bool):
        self.world_size = world_size
        self.enabled = enabled
        self.states = {}
        self.lock = threading.Lock()
        self.tty = sys.stderr.isatty()

    def __call__(self, event: dict) -> None:
        if not self.enabled or event.get("rank") is None:
            return
        with self.lock:
            self.states[event["rank"]] = event["event"]
            line = "ranks: " + "  ".join(f"{r}:{self.states.get(r, 'starting')}" for r in range(self.world_size))
            if self.tty:
                sys.stderr.write("\r\033[K" + line)
            else:
                sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Prompt text."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="System message (with --chat)."),
    model: Optional[str] = typer.Option(None, "--model", help="A .gguf file or mlx-lm model directory (default: embedded SmolLM2-135M-Instruct)."),
    world_size: int = typer.Option(1, "--world-size", "-n", help="Number of tensor-parallel ranks."),
    backend: str = typer.Option("auto", "--backend", help="ring (MLX TCP ring), mpi (OpenMPI), or auto (mpi when mpirun is installed, else ring)."),
    max_tokens: int = typer.Option(128, "--max-tokens", help="Maximum tokens to generate."),
    weights: Optional[str] = typer.Option(None, "--weights", help="quantized, float32, float16 or bfloat16 (default: fastest measured for this platform)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    start_timeout: float = typer.Option(300.0, "--start-timeout", help="Seconds to wait for ranks to load."),
):
    """Generate a greedy continuation of PROMPT with an N-rank tensor-parallel group on this machine."""
    from .model.loader import WEIGHT_FORMATS, ModelError, default_weight_format, inspect_model
    from .model.tp import WorldSizeError, check_world_size
    from .runtime.launcher import BACKENDS, LaunchError, LocalCluster, resolve_backend
    from .control.client import ClientError, GenerationClient

    backend = resolve_backend(backend)
    if backend not in BACKENDS:
        raise _fail(f"unknown backend {backend!r}: choose one of auto, {', '.join(BACKENDS)}", 2)
    if weights is not None and weights not in WEIGHT_FORMATS:
        raise _fail(f"unknown weight format {weights!r}: choose one of {', '.join(WEIGHT_FORMATS)}", 2)
    if max_tokens < 1:
        raise _fail("--max-tokens must be at least 1", 2)
    if world_size < 1:
        raise _fail("--world-size must be at least 1", 2)
    try:
        info = inspect_model(model)
        fmt = weights or default_weight_format()
        check_world_size(info.config, world_size, info.quantization, fmt, info.name)
    except (ModelError, WorldSizeError) as exc:
        raise _fail(str(exc))

    progress = _Progress(world_size, enabled=True)
    cluster = LocalCluster(world_size, backend, model=info.path, weights=fmt, on_event=progress,
                           start_timeout_s=start_timeout)
    try:
        try:
            cluster.start()
        except LaunchError as exc:
            progress.done()
            raise _fail(f"a rank failed to start: {exc}")
        progress.done()
        client = GenerationClient(cluster.address)
        try:
            if as_json:
                result = client.generate(prompt, chat=chat, system=system or "", max_tokens=max_tokens)
                typer.echo(json.dumps({
                    "prompt_ids": result.prompt_ids,
                    "token_ids": result.token_ids,
                    "text": result.text,
                    "world_size": world_size,
                    "backend": backend if world_size > 1 else "none",
                    "weights": fmt,
                    "stop_reason": result.reason,
                    "ttft_s": result.ttft_s,
                    "prefill_tokens_per_s": result.prefill_tokens_per_s,
                    "decode_tokens_per_s": result.decode_tokens_per_s,
                    "peak_memory_bytes_per_rank": result.peak_memory_bytes_per_rank,
                }))
            else:
                done = None
                for event in client.stream(prompt, chat=chat, system=system or "", max_tokens=max_tokens):
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
                        f"world size {world_size}]", err=True)
        except ClientError as exc:
            failure = cluster.failure
            raise _fail(str(exc) if not failure else f"{exc} ({failure})")
        finally:
            client.close()
    except KeyboardInterrupt:
        raise _fail("interrupted", 130)
    finally:
        cluster.stop()


@app.command("export")
def export_cmd(
    out: str = typer.Argument(..., help="Directory to write."),
    model: Optional[str] = typer.Option(None, "--model", help="GGUF file (default: embedded model)."),
    dequantize: bool = typer.Option(False, "--dequantize", help="Write float32 weights instead of the packed quantised ones."),
):
    """Write a GGUF model as an mlx-lm model directory (config.json, model.safetensors, tokenizer)."""
    from .model.export import export_mlx
    from .model.loader import ModelError

    try:
        path = export_mlx(model, out, dequantize=dequantize)
    except (ModelError, OSError, ValueError) as exc:
        raise _fail(str(exc))
    typer.echo(path)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
