"""Control plane: frames, rank 0 engine, rank N server, gRPC services."""
