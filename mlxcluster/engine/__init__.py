"""Execution plane: the per-rank MLX work -- sessions and KV caches, the decode batch,
sampling, the compiled single-rank step.  No gRPC, no queues."""
