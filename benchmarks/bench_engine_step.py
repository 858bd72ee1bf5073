"""The decode engine alone vs mlx-lm's generate_step, in one process, alternating (no gRPC, no
rank process): greedy decode tok/s of `RankEngine.step(lookahead=True)` on mlxcluster's build of an
mlx-lm directory, on mlx-lm's own model object, and of `mlx_lm.generate.generate_step`.

Usage: python benchmarks/bench_engine_step.py MODEL_DIR   (preload OpenBLAS as the ranks do:
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3)
"""
import time, sys, mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlxcluster.model.loader import read_model
from mlxcluster.model.tp import build_model
from mlxcluster.engine.decode import RankEngine
from mlxcluster.engine.sampling import Sampling
d = sys.argv[1]
model, tok = load(d)
src = read_model(d)
ours = build_model(src.config, src.weights, src.quantization, "float32")
ids = tok.encode("Here is a list of the planets in the solar system, with one fact about each:")
N=64
def mlxlm():
    t=None; n=0
    for i,(y,_) in enumerate(generate_step(mx.array(ids), model, max_tokens=N)):
        if i==0: t=time.perf_counter()
        n+=1
    return (n-1)/(time.perf_counter()-t)
def mine(m, compile_decode=False):
    eng = RankEngine(m, 2048, compile_decode=compile_decode)
    eng.prefill("u", ids, Sampling(), [], N)
    t=time.perf_counter()
    for _ in range(N-1):
        eng.step(lookahead=True)
    r = (N-1)/(time.perf_counter()-t)
    eng.remove("u")
    return r
for rep in range(3):
    print("mlx-lm %.2f  ours(mlx-lm model) %.2f  ours %.2f" % (mlxlm(), mine(model), mine(ours)), flush=True)
