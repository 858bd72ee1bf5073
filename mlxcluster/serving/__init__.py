"""Serving plane: rank 0's admission queue and continuous batching (:mod:`.scheduler`)
and ``Generation`` service (:mod:`.generation`; tokenize and detokenize there only), the
OpenAI-compatible provider (:class:`Provider`) and its HTTP API (:func:`create_app`), the
router link (:mod:`.link`) and server-sent events (:mod:`.sse`, shared with the router).

Names are imported lazily, so ``import mlxcluster.serving.sse`` (the router) loads neither
the provider's gRPC stubs nor FastAPI."""

from typing import Any

__all__ = ["Provider", "ProviderError", "create_app"]


def __getattr__(name: str) -> Any:
    if name in ("Provider", "ProviderError"):
        from . import provider

        return getattr(provider, name)
    if name == "create_app":
        from .api import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
