"""The cluster as an OpenAI-style provider: :class:`Provider` (queue, metrics,
OpenAI chunk streams over rank 0's gRPC) and its HTTP API (:func:`create_app`,
imported lazily so the router link need not import FastAPI)."""

from .core import Provider, ProviderError, collect

__all__ = ["Provider", "ProviderError", "collect", "create_app"]


def create_app(provider):
    from .api import create_app as _create_app

    return _create_app(provider)
