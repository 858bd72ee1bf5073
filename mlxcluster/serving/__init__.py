"""Serving plane: rank 0's ``Generation`` service (tokenize and detokenize here only),
the OpenAI-compatible provider (:class:`Provider`, its HTTP API :func:`create_app`,
imported lazily so the router link need not import FastAPI), the router link and SSE."""

from .provider import Provider, ProviderError, collect

__all__ = ["Provider", "ProviderError", "collect", "create_app"]


def create_app(provider):
    from .api import create_app as _create_app

    return _create_app(provider)
