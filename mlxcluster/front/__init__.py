"""The HTTP front (the ``serve`` process, and what the router shares): the OpenAI-compatible
provider (:class:`Provider`, a ``Generation`` client of rank 0) and its HTTP API
(:func:`create_app`), the Anthropic / Ollama / Responses dialects (:mod:`.dialects`), tool calls
(:mod:`.tools`), server-sent events (:mod:`.sse`), the group's healer (:mod:`.healer`), the
router link (:mod:`.link`) and the dashboard's assets.

Names are imported lazily, so ``import mlxcluster.front.sse`` (the router) loads neither
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
