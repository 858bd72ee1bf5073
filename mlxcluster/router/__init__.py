"""Marketplace router: providers dial in over gRPC (``proto/router.proto``), users call an
OpenAI-compatible HTTP API that is routed to the least-loaded live provider."""

from .server import Router, RouterError

__all__ = ["Router", "RouterError"]
