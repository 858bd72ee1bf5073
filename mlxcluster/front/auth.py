"""API keys and TLS for the HTTP surfaces (``serve``, ``join``'s dashboard, the router's users).

Keys: ``--api-key KEY`` (repeatable) and ``--api-key-file FILE`` (one key per line, ``#``
comments) give a :class:`KeyRing`.  A request proves a key with ``Authorization: Bearer KEY``
(OpenAI and Ollama clients) or ``x-api-key: KEY`` (Anthropic's client).  The ring keeps only the
keys' SHA-256 digests and compares the given key's digest with every one of them with
:func:`hmac.compare_digest` (no early exit), so the time taken says nothing about the keys.
A key is named, in logs and in ``/metrics``, by its :func:`key_id` (the first 8 hex digits of its
SHA-256), never by itself.

:class:`ApiKeyMiddleware` (an ASGI middleware, installed by :func:`install`) checks every request
of an application except ``GET /health`` (left open for load balancers' probes, as vLLM does; it
tells no secret) and the dashboard's login.  A refusal is 401 with ``WWW-Authenticate: Bearer`` in
the dialect's own error format: Anthropic's (``/v1/messages...``), Ollama's (``/api/...``), else
OpenAI's (``invalid_request_error`` / ``invalid_api_key``); a browser asking for the dashboard page
gets a login form instead.

The dashboard in a browser: ``EventSource`` cannot send headers and a key in the URL would land in
logs and history, so the page signs in once: the form posts the key to ``POST /dashboard/login``,
which answers with a random session cookie (``HttpOnly`` -- no script can read it --
``SameSite=Strict``, ``Secure`` under TLS, 12 h).  The cookie authenticates the page, its assets,
``/dashboard/state``, ``/dashboard/events`` and the chat box's ``POST``; a state-changing request
authenticated only by the cookie must also come from the page's own origin (``Sec-Fetch-Site`` or
``Origin``), so another site cannot make a signed-in browser use the cluster.  Sessions live in
this process's memory (at most :data:`MAX_SESSIONS`; a restart signs everyone out).
``POST /dashboard/logout`` ends one.

TLS: :func:`tls_files` checks ``--tls-cert`` / ``--tls-key`` once at start (both or neither; a file
that does not load is one line); uvicorn then serves HTTPS with them.  :func:`check_exposure` is
the rule that an API or dashboard listening beyond loopback needs a key (or
``--insecure-no-auth``).

Who asked: while an authenticated request runs, :data:`REQUEST_KEY` holds its key's full SHA-256
hex digest (a context variable, so the request's own tasks see it and no other request's do);
``serve --cache-isolation key`` makes it the request's prefix-cache namespace (issue 32).
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import json
import logging
import secrets
import ssl
import time
import weakref
from contextvars import ContextVar
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("mlxcluster.auth")

#: The SHA-256 hex digest of the API key the current request presented (its session's key for the
#: dashboard), set by :class:`ApiKeyMiddleware` for the request's context; "" where no key was checked.
REQUEST_KEY: ContextVar[str] = ContextVar("mlxcluster_request_key", default="")

__all__ = ["ApiKeyMiddleware", "KeyRing", "REQUEST_KEY", "check_exposure", "install", "is_loopback", "key_id", "read_keys",
           "tls_files", "OPEN_PATHS", "SESSION_COOKIE"]

#: paths answered without a key (``/health``: load balancers probe it; the login itself)
OPEN_PATHS = frozenset({"/health", "/dashboard/login", "/dashboard/logout"})
#: the dashboard's session cookie
SESSION_COOKIE = "mlxcluster_session"
#: a session lasts this long (seconds)
SESSION_TTL_S = 12 * 3600.0
#: sessions kept at most (the oldest is dropped)
MAX_SESSIONS = 1024
#: the login body's largest size (bytes)
MAX_LOGIN_BYTES = 16 * 1024


def key_id(key: str) -> str:
    """A short name of ``key`` that does not reveal it: the first 8 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def read_keys(keys: Sequence[str] = (), files: Sequence[str] = ()) -> List[str]:
    """The API keys given as ``--api-key`` values and in ``--api-key-file`` files (one per line;
    blank lines and lines starting with ``#`` skipped; surrounding whitespace stripped), in order,
    without duplicates.

    Raises:
        ValueError: one line: an empty key, a key holding whitespace, a file that cannot be read
            or that holds no key.
    """
    out: List[str] = []
    for k in keys:
        if not k.strip():
            raise ValueError("--api-key needs a non-empty key")
        out.append(k.strip())
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                found = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read --api-key-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
        if not found:
            raise ValueError(f"--api-key-file {path} holds no key")
        out.extend(found)
    for k in out:
        if any(c.isspace() for c in k):
            raise ValueError(f"API key {key_id(k)} holds whitespace: a key is one word")
    return list(dict.fromkeys(out))


class KeyRing:
    """A set of API keys, kept as SHA-256 digests.

    Args:
        keys: the keys (non-empty strings).

    Raises:
        ValueError: no key, or an empty one.
    """

    def __init__(self, keys: Iterable[str]):
        keys = list(dict.fromkeys(keys))
        if not keys or not all(keys):
            raise ValueError("no API keys given")
        self._digests = [hashlib.sha256(k.encode("utf-8", "surrogateescape")).digest() for k in keys]
        #: each key's :func:`key_id`, in the order given
        self.ids: List[str] = [key_id(k) for k in keys]

    def __len__(self) -> int:
        return len(self._digests)

    def digest_hex(self, index: int) -> str:
        """Key ``index``'s SHA-256 as 64 hex digits (who asked, never the key itself)."""
        return self._digests[index].hex()

    def match(self, given: str) -> Optional[int]:
        """The index of the key ``given`` is, or ``None``; every key is compared, in constant time."""
        digest = hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest()
        found = None
        for i, d in enumerate(self._digests):
            if hmac.compare_digest(digest, d):
                found = i
        return found

    @staticmethod
    def presented(headers: Mapping[str, str]) -> Optional[str]:
        """The key a request presents: ``Authorization: Bearer KEY``, else ``x-api-key: KEY``
        (``headers`` with lower-case names); ``None`` when it presents none."""
        scheme, _, value = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        value = headers.get("x-api-key", "").strip()
        return value or None

    def check(self, headers: Mapping[str, str]) -> Optional[int]:
        """The index of the key the request presents (:meth:`presented`), or ``None``."""
        given = self.presented(headers)
        return None if given is None else self.match(given)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable only from this machine: a loopback IP
    address or ``localhost``.  Anything else (``0.0.0.0``, a LAN address, another name) is not."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, keys: Sequence[str], insecure_no_auth: bool, option: str = "--host") -> None:
    """The exposure rule: an HTTP surface on a non-loopback ``host`` needs API keys, unless the
    user said ``--insecure-no-auth``.

    Raises:
        ValueError: one line naming ``--api-key`` and ``--insecure-no-auth``.
    """
    if not keys and not insecure_no_auth and not is_loopback(host):
        raise ValueError(f"{option} {host} is reachable from other machines: give --api-key KEY (or "
                         f"--api-key-file FILE), or --insecure-no-auth to serve it without authentication")


def tls_files(cert: Optional[str], key: Optional[str]) -> Optional[Tuple[str, str]]:
    """``(cert, key)`` after checking that they load as a server certificate and its key (PEM),
    or ``None`` when neither is given.

    Raises:
        ValueError: one line: only one given, or the files do not load (missing, not PEM, the key
            does not match the certificate).
    """
    if not cert and not key:
        return None
    if not cert or not key:
        raise ValueError("--tls-cert and --tls-key go together: give both or neither")
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    for option, path, load, what in (("--tls-cert", cert, x509.load_pem_x509_certificates, "PEM certificate"),
                                     ("--tls-key", key, lambda b: serialization.load_pem_private_key(b, None),
                                      "unencrypted PEM private key")):
        try:
            with open(path, "rb") as f:
                load(f.read())
        except OSError as exc:
            raise ValueError(f"cannot read {option} {path}: {exc.strerror or exc}") from None
        except (ValueError, TypeError):
            raise ValueError(f"{option} {path} holds no {what}") from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        why = "the key does not match the certificate" if "KEY_VALUES_MISMATCH" in str(exc) else \
            (getattr(exc, "reason", None) or str(exc))
        raise ValueError(f"cannot use --tls-cert {cert} with --tls-key {key}: {why}") from None
    return cert, key


# -- the middleware ------------------------------------------------------------------------------

_COUNTERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _counters(registry: Optional[CollectorRegistry]) -> Tuple[Optional[Counter], Optional[Counter]]:
    """The per-key request counter and the refusal counter in ``registry`` (made once per registry)."""
    if registry is None:
        return None, None
    if registry not in _COUNTERS:
        _COUNTERS[registry] = (
            Counter("mlxcluster_api_key_requests", "HTTP requests authenticated by each API key (key_id: first 8 "
                    "hex digits of the key's SHA-256)", ["key_id"], registry=registry),
            Counter("mlxcluster_api_key_refused", "HTTP requests refused for a missing or wrong API key",
                    ["reason"], registry=registry))
    return _COUNTERS[registry]


_LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mlxcluster: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font:15px system-ui,sans-serif;max-width:24rem;margin:4rem auto;padding:0 1rem}}
input,button{{font:inherit;padding:.4rem;margin:.3rem 0;width:100%;box-sizing:border-box}}
.error{{color:#b00020}}</style></head>
<body><h1>mlxcluster</h1><p>This dashboard needs an API key (one of <code>--api-key</code>).</p>
<form method="post" action="/dashboard/login"><label for="key">API key</label>
<input id="key" name="key" type="password" autocomplete="current-password" autofocus required>
<button type="submit">Sign in</button></form><p class="error" role="alert">{error}</p></body></html>
"""


class ApiKeyMiddleware:
    """ASGI middleware: every HTTP request needs an API key of ``ring`` (see the module docstring).

    Args:
        app: the ASGI application it guards.
        ring: the accepted keys.
        registry: where the per-key counters go (``/metrics``); ``None``: not counted.
        open_paths: paths answered without a key.
    """

    def __init__(self, app, ring: KeyRing, registry: Optional[CollectorRegistry] = None,
                 open_paths: Iterable[str] = OPEN_PATHS):
        self.app = app
        self.ring = ring
        self.open_paths = frozenset(open_paths)
        self.requests, self.refused = _counters(registry)
        self._sessions: Dict[bytes, Tuple[int, float]] = {}  # SHA-256(session token) -> (key index, expiry)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # lifespan; no websockets here
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope.get("method", "GET")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path == "/dashboard/login" and method == "POST":
            return await self._login(scope, receive, send, headers)
        if path == "/dashboard/logout" and method == "POST":
            return await self._logout(scope, send, headers)
        if path in self.open_paths:
            return await self.app(scope, receive, send)
        given = KeyRing.presented(headers)
        if given is not None:  # a key header decides; else the dashboard's session cookie
            index, reason = self.ring.match(given), "invalid"
        else:
            index, reason = self._session(headers, method, scope), "missing"
        if index is None:
            if self.refused is not None:
                self.refused.labels(reason).inc()
            return await self._refuse(scope, send, headers, reason)
        if self.requests is not None:
            self.requests.labels(self.ring.ids[index]).inc()
        token = REQUEST_KEY.set(self.ring.digest_hex(index))
        try:
            return await self.app(scope, receive, send)
        finally:
            REQUEST_KEY.reset(token)

    # -- sessions -------------------------------------------------------------------------------
    def _session(self, headers: Mapping[str, str], method: str, scope) -> Optional[int]:
        token = _cookie(headers.get("cookie", ""), SESSION_COOKIE)
        if not token:
            return None
        entry = self._sessions.get(hashlib.sha256(token.encode("latin-1")).digest())
        if entry is None or entry[1] < time.monotonic():
            return None
        if method not in ("GET", "HEAD", "OPTIONS") and not _same_origin(headers, scope):
            return None
        return entry[0]

    def _new_session(self, index: int) -> str:
        now = time.monotonic()
        for h in [h for h, (_, expiry) in self._sessions.items() if expiry < now]:
            del self._sessions[h]
        while len(self._sessions) >= MAX_SESSIONS:  # the oldest first (insertion order)
            del self._sessions[next(iter(self._sessions))]
        token = secrets.token_urlsafe(32)
        self._sessions[hashlib.sha256(token.encode("latin-1")).digest()] = (index, now + SESSION_TTL_S)
        return token

    async def _login(self, scope, receive, send, headers) -> None:
        """``POST /dashboard/login``: a form (``key=...``) or JSON (``{"key": ...}``) body; a valid
        key gets a session cookie (303 to the page for a form, 200 ``{"ok": true}`` for JSON)."""
        form = not headers.get("content-type", "").startswith("application/json")
        if not _same_origin(headers, scope):
            return await _send(send, 403, *_page_or_json(form, "sign in from the dashboard's own page"))
        body = b""
        for _ in range(MAX_LOGIN_BYTES):  # bounded: each message carries at least one byte or ends it
            message = await receive()
            body += message.get("body", b"")
            if len(body) > MAX_LOGIN_BYTES:
                return await _send(send, 413, *_page_or_json(form, "the login body is too large"))
            if not message.get("more_body", False):
                break
        given = ""
        try:
            if form:
                given = (parse_qs(body.decode("utf-8")).get("key") or [""])[0].strip()
            else:
                value = json.loads(body or b"{}")
                given = value.get("key", "") if isinstance(value, dict) and isinstance(value.get("key"), str) else ""
        except (UnicodeDecodeError, ValueError):
            given = ""
        index = self.ring.match(given) if given else None
        if index is None:
            if self.refused is not None:
                self.refused.labels("invalid" if given else "missing").inc()
            return await _send(send, 401, *_page_or_json(form, "wrong API key"),
                               extra=[(b"www-authenticate", b"Bearer")])
        if self.requests is not None:
            self.requests.labels(self.ring.ids[index]).inc()
        log.info("dashboard sign-in with key %s", self.ring.ids[index])
        cookie = _set_cookie(self._new_session(index), SESSION_TTL_S, scope.get("scheme") == "https")
        if form:
            return await _send(send, 303, b"", b"text/plain; charset=utf-8",
                               extra=[(b"location", b"/"), (b"set-cookie", cookie)])
        return await _send(send, 200, b'{"ok":true}', b"application/json", extra=[(b"set-cookie", cookie)])

    async def _logout(self, scope, send, headers) -> None:
        token = _cookie(headers.get("cookie", ""), SESSION_COOKIE)
        if token and _same_origin(headers, scope):
            self._sessions.pop(hashlib.sha256(token.encode("latin-1")).digest(), None)
        await _send(send, 200, b'{"ok":true}', b"application/json",
                    extra=[(b"set-cookie", _set_cookie("", 0, scope.get("scheme") == "https"))])

    # -- refusals --------------------------------------------------------------------------------
    async def _refuse(self, scope, send, headers, reason: str) -> None:
        path, method = scope.get("path", ""), scope.get("method", "GET")
        message = ("Incorrect API key provided" if reason == "invalid" else "Missing API key") + \
            ": send Authorization: Bearer <key> or x-api-key: <key>"
        if path == "/" and method in ("GET", "HEAD") and "text/html" in headers.get("accept", ""):
            body, ctype = _login_page("")  # a browser opening the dashboard: sign in
        elif path == "/v1/messages" or path.startswith("/v1/messages/"):
            body, ctype = _json({"type": "error", "error": {"type": "authentication_error", "message": message}})
        elif path.startswith("/api/"):
            body, ctype = _json({"error": message})
        else:
            body, ctype = _json({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                           "code": "invalid_api_key"}})
        await _send(send, 401, body, ctype, extra=[(b"www-authenticate", b"Bearer")])


def install(app, ring: Optional[KeyRing], registry: Optional[CollectorRegistry] = None) -> None:
    """Guard the Starlette/FastAPI ``app`` with :class:`ApiKeyMiddleware` (nothing when ``ring``
    is ``None``: no keys configured).  Call before the application starts."""
    if ring is not None:
        app.add_middleware(ApiKeyMiddleware, ring=ring, registry=registry)


def _json(value: Any) -> Tuple[bytes, bytes]:
    return json.dumps(value, separators=(",", ":")).encode(), b"application/json"


def _login_page(error: str) -> Tuple[bytes, bytes]:
    return _LOGIN_PAGE.format(error=html.escape(error)).encode(), b"text/html; charset=utf-8"


def _page_or_json(form: bool, error: str) -> Tuple[bytes, bytes]:
    return _login_page(error) if form else _json({"error": {"message": error, "type": "invalid_request_error",
                                                            "param": None, "code": "invalid_api_key"}})


async def _send(send, status: int, body: bytes, ctype: bytes, extra: Sequence[Tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode()),
                            (b"cache-control", b"no-store"), *extra]})
    await send({"type": "http.response.body", "body": body})


def _cookie(header: str, name: str) -> str:
    for part in header.split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v.strip()
    return ""


def _set_cookie(token: str, max_age: float, secure: bool) -> bytes:
    return (f"{SESSION_COOKIE}={token}; Path=/; Max-Age={int(max_age)}; HttpOnly; SameSite=Strict"
            + ("; Secure" if secure else "")).encode("latin-1")


def _same_origin(headers: Mapping[str, str], scope) -> bool:
    """Whether a browser request comes from this server's own pages: ``Sec-Fetch-Site`` says
    ``same-origin``, else ``Origin`` is this server's; a request carrying neither (not a modern
    browser's) passes -- ``SameSite=Strict`` keeps the cookie from other sites' requests there."""
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = headers.get("origin")
    if origin is None:
        return True
    return origin == f"{scope.get('scheme', 'http')}://{headers.get('host', '')}"
