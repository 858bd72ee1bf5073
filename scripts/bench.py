#!/usr/bin/env python3
"""Benchmark plain mlx-lm, mlx-lm's tensor parallelism and mlxcluster side by side.

Usage: python scripts/bench.py [--world-size 3] [--backends mpi,ring] [--weights float32]
           [--decode-tokens 64] [--ring-decode-tokens 16] [--prefill-tokens 512]
           [--skip-mlx-lm] [--quick] [--out-dir bench-out]
See mlxcluster/bench.py.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlxcluster.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
