"""A fake provider for the marketplace router: no model, no rank 0.

It has the interface the router link (:func:`mlxcluster.front.link.run_link`)
drives on a :class:`mlxcluster.front.provider.Provider` (``models``,
``context_length``, ``capacity``, ``load()``, ``chat_completion(body)``,
``completion(body)``), so the router can be load-tested
(``benchmarks/bench_router.py --fake-providers``) and tested
(``tests/test_router.py``) alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

from mlxcluster.protocol.errors import OpenAIError

__all__ = ["FakeProvider", "words"]


def words(n: int) -> str:
    """The text of ``n`` generated tokens: ``"w0 w1 ... w{n-1} "``."""
    return "".join(f"w{i} " for i in range(n))


class FakeProvider:
    """Runs ``capacity`` requests at once with up to ``max_queue`` waiting (one more
    is refused: 429 ``rate_limit_error``, ``Retry-After: 2``); each streams
    ``max_tokens`` (default ``n_tokens``) words ``"w{i} "`` with ``token_delay``
    seconds before each, as OpenAI chunks (chat: a role chunk first), then a
    ``finish_reason: "length"`` chunk and a usage chunk (``prompt_tokens``: 3).
    ``max_tokens: 0`` is refused (400, ``param: "max_tokens"``).

    Records, by the request's ``user`` field: ``calls`` (``(kind, user)``,
    kind ``"chat"`` or ``"completion"``), ``started`` (got a slot),
    ``cancelled`` (closed before its end, waiting or generating) and
    ``queue_wait`` (seconds waited for the slot).  Set ``fake_load`` (a
    ``load()`` dict) to report other work, ``always_429`` to refuse everything.
    """

    PROMPT_TOKENS = 3

    def __init__(self, name: str, models: Sequence[str] = ("fake-model",), capacity: int = 4,
                 max_queue: int = 100, n_tokens: int = 5, token_delay: float = 0.0, context_length: int = 2048):
        self.name = name
        self.models = list(models)
        self.capacity = capacity
        self.max_queue = max_queue
        self.n_tokens = n_tokens
        self.token_delay = token_delay
        self.context_length = context_length
        self.calls: List[Tuple[str, str]] = []
        self.started: List[str] = []
        self.cancelled: List[str] = []
        self.queue_wait: Dict[str, float] = {}
        self.queued = 0
        self.running = 0
        self.fake_load: Optional[Dict[str, int]] = None
        self.always_429 = False
        self._slots: Optional[asyncio.Semaphore] = None

    def load(self) -> Dict[str, int]:
        if self.fake_load is not None:
            return dict(self.fake_load)
        return {"queued": self.queued, "running": self.running, "capacity": self.capacity}

    def chat_completion(self, body: Dict[str, Any]) -> AsyncIterator[Dict[str, Any]]:
        return self._gen("chat", body)

    def completion(self, body: Dict[str, Any]) -> AsyncIterator[Dict[str, Any]]:
        return self._gen("completion", body)

    async def _gen(self, kind: str, body: Dict[str, Any]) -> AsyncIterator[Dict[str, Any]]:
        user = str(body.get("user") or "")
        self.calls.append((kind, user))
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity)
        if self.always_429 or (self.running >= self.capacity and self.queued >= self.max_queue):
            raise OpenAIError(429, f"{self.name}: queue full ({self.max_queue} waiting)", "rate_limit_error",
                              retry_after=2)
        if body.get("max_tokens") == 0:
            raise OpenAIError(400, "max_tokens must be at least 1", "invalid_request_error", "max_tokens")
        t0 = time.perf_counter()
        self.queued += 1
        try:
            await self._slots.acquire()
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(user)
            raise
        finally:
            self.queued -= 1
        self.queue_wait[user] = time.perf_counter() - t0
        self.running += 1
        self.started.append(user)
        cid, created, model = f"{self.name}-{len(self.calls)}", int(time.time()), self.models[0]
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        n = int(body.get("max_tokens") or self.n_tokens)

        def chunk(piece: Dict[str, Any], finish: Optional[str] = None) -> Dict[str, Any]:
            if kind == "chat":
                choice = {"index": 0, "delta": piece, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece.get("content", ""), "logprobs": None, "finish_reason": finish}
            return {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}

        try:
            if kind == "chat":
                yield chunk({"role": "assistant", "content": ""})
            for i in range(n):
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)  # the simulated decode step
                yield chunk({"content": f"w{i} "})
            yield chunk({}, "length")
            yield {"id": cid, "object": obj, "created": created, "model": model, "choices": [],
                   "usage": {"prompt_tokens": self.PROMPT_TOKENS, "completion_tokens": n,
                             "total_tokens": self.PROMPT_TOKENS + n}}
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(user)
            raise
        finally:
            self.running -= 1
            self._slots.release()
