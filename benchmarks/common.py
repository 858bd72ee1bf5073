"""Helpers the benchmark scripts share: the machine's description, a scratch directory, the
mlx-lm directory a model reference runs as (one module that every benchmark imports, so that
none imports another's main)."""

from __future__ import annotations

import os
import platform
import shutil
from typing import Optional

__all__ = ["machine_description", "scratch_dir", "prepare_mlx_dir", "exit_on_sigterm"]


def machine_description() -> str:
    """'Linux x86_64, 2 cores, AMD EPYC': OS, architecture, cores and CPU model."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, {cpu}"


def scratch_dir() -> Optional[str]:
    """RAM-backed /dev/shm when it has room (the float32 export is written and read
    back at memory speed), else the default temp dir."""
    try:
        if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 4 * 2**30:
            return "/dev/shm"
    except OSError:
        pass
    return None


def prepare_mlx_dir(model: Optional[str], weights: str, workdir: str) -> str:
    """The mlx-lm directory mlx-lm runs on: the GGUF exported once (float32 unless
    ``weights == "quantized"``), or the given directory itself."""
    from mlxcluster.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path):
        return path
    from mlxcluster.model.export import export_mlx

    out = os.path.join(workdir, "mlx-model")
    export_mlx(path, out, dequantize=(weights != "quantized"))
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:
        pass
    return out


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit`` (status 143) in the main thread, so that a benchmark stopped
    with ``kill`` or ``timeout`` runs its ``finally`` blocks and stops the servers and rank groups it
    started (they run in sessions of their own and would be left running otherwise)."""
    import signal
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
