"""API keys and TLS on the HTTP surfaces (``mlxcluster.front.auth``).

Fast tier, in process: ``serve``'s application over a fake rank 0 (``test_provider.FakeRank0``,
released so that every request answers one token), served by uvicorn on loopback -- the official
openai, anthropic and ollama clients refused without / with a wrong key and answered with one, on
every dialect; ``/metrics``, the dashboard (page, state, events, chat box) and its cookie sign-in;
the exposure rule and key files; HTTPS answered to the openai client that trusts the certificate.
"""

import asyncio
import functools
import socket
import ssl
import threading
from concurrent import futures

import grpc
import httpx
import openai
import pytest

from mlxcluster.front import Provider, create_app
from mlxcluster.front.auth import KeyRing, check_exposure, is_loopback, key_id, read_keys, tls_files
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc
from mlxcluster.security import self_signed
from test_provider import FakeRank0

KEYS = ["sk-alice-0123456789", "sk-bob-9876543210"]
WRONG = "sk-mallory-000000"


class Server:
    """uvicorn serving ``app`` on a free loopback port in a thread (HTTPS with ``tls``: (cert, key))."""

    def __init__(self, app, tls=None):
        import uvicorn

        ready = threading.Event()

        class _Server(uvicorn.Server):
            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                ready.set()

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        port = self.sock.getsockname()[1]
        kw = dict(ssl_certfile=tls[0], ssl_keyfile=tls[1]) if tls else {}
        self.server = _Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1, **kw))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        assert ready.wait(30) and self.server.started, "uvicorn did not start"
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tinymodel import write_gguf

    path = tmp_path_factory.mktemp("auth") / "tiny.gguf"
    write_gguf(str(path), metadata_overrides={
        "tokenizer.chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"})
    return str(path)


@pytest.fixture(scope="module")
def rank0(tls):
    fake = FakeRank0()
    fake.release()  # every call answers its one token at once
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(fake, server)
    port = server.add_secure_port("127.0.0.1:0", tls.server())
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def served(rank0, tiny_model, tls):
    provider = Provider(rank0, tiny_model, "tiny", tls)
    server = Server(create_app(provider, KeyRing(KEYS)))
    yield server
    server.stop()


@functools.lru_cache(maxsize=None)
def plain_http():
    """The SSL context of every client of the plain-HTTP app (never used): one for the module, where
    each client would load the CA bundle itself (~20 ms of CPU)."""
    return ssl.create_default_context()


def _openai(url, key):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30,
                         http_client=openai.DefaultHttpxClient(verify=plain_http()))


def _anthropic(url, key):
    import anthropic
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=30,
                               http_client=anthropic.DefaultHttpxClient(verify=plain_http()))


def _ollama(url, key):
    import ollama
    return ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30,
                         verify=plain_http())


MESSAGES = [{"role": "user", "content": "hi"}]


# -- the official clients, every dialect ----------------------------------------------------------
def test_openai_client_is_refused_without_the_right_key(served):
    client = _openai(served.url, WRONG)
    for call in (lambda: client.models.list(),
                 lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2),
                 lambda: client.completions.create(model="tiny", prompt="hi", max_tokens=2),
                 lambda: client.responses.create(model="tiny", input="hi", max_output_tokens=16)):
        with pytest.raises(openai.AuthenticationError) as info:
            call()
        assert info.value.status_code == 401
        err = info.value.body
        assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
        assert info.value.response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        client.embeddings.create(model="tiny", input="hi")
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                         ("POST", "/v1/responses"), ("POST", "/v1/embeddings")):  # no key at all
        r = httpx.request(method, served.url + path, json={"model": "tiny", "prompt": "hi", "messages": MESSAGES},
                          verify=plain_http())
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["message"].startswith("Missing API key")


def test_openai_client_is_answered_with_either_key(served):
    for key in KEYS:
        client = _openai(served.url, key)
        assert [m.id for m in client.models.list()] == ["tiny"]
        chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert chat.choices[0].message.content == "A"
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text == "A"
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "A"
        assert client.responses.create(model="tiny", input="hi", max_output_tokens=16).output_text == "A"


def test_anthropic_client_is_refused_in_anthropics_format(served):
    import anthropic
    client = _anthropic(served.url, WRONG)
    with pytest.raises(anthropic.AuthenticationError) as info:
        client.messages.create(model="tiny", max_tokens=2, messages=MESSAGES)
    assert info.value.status_code == 401
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": info.value.body["error"]["message"]}}
    assert "API key" in info.value.body["error"]["message"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):  # no key at all
        r = httpx.post(served.url + path, json={"model": "tiny", "max_tokens": 2, "messages": MESSAGES},
                       verify=plain_http())
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_anthropic_client_is_answered_with_x_api_key(served):
    client = _anthropic(served.url, KEYS[1])
    message = client.messages.create(model="tiny", max_tokens=2, messages=MESSAGES)
    assert message.content[0].text == "A"
    with client.messages.stream(model="tiny", max_tokens=2, messages=MESSAGES) as stream:
        assert "".join(stream.text_stream) == "A"


@pytest.mark.parametrize("key", [None, WRONG])
def test_ollama_client_is_refused_in_ollamas_format(served, key):
    import ollama
    client = _ollama(served.url, key)
    for call in (lambda: client.chat(model="tiny", messages=MESSAGES, options={"num_predict": 2}),
                 lambda: client.generate(model="tiny", prompt="hi", options={"num_predict": 2}),
                 lambda: client.list(), lambda: client.ps(), lambda: client.show("tiny"),
                 lambda: client.embed(model="tiny", input="hi")):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 401 and "API key" in info.value.error
    raw = httpx.get(served.url + "/api/version", headers={"Authorization": f"Bearer {key}"} if key else {},
                    verify=plain_http())
    assert raw.status_code == 401 and set(raw.json()) == {"error"}


def test_ollama_client_is_answered_with_a_bearer_key(served):
    client = _ollama(served.url, KEYS[0])
    assert client.chat(model="tiny", messages=MESSAGES, options={"num_predict": 2}).message.content == "A"
    assert client.generate(model="tiny", prompt="hi", options={"num_predict": 2}).response == "A"
    assert "".join(p.message.content for p in client.chat(model="tiny", messages=MESSAGES, stream=True,
                                                          options={"num_predict": 2})) == "A"
    assert [m.model for m in client.list().models] == ["tiny:latest"]


# -- the rest of serve's surface ---------------------------------------------------------------------
def test_metrics_docs_and_dashboard_need_a_key_and_health_stays_open(served):
    paths = ["/metrics", "/", "/dashboard/state", "/dashboard/dashboard.js", "/openapi.json", "/docs",
             "/v1/models/tiny"]
    with httpx.Client(base_url=served.url, timeout=30, verify=plain_http()) as c:
        for path in paths:
            r = c.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
            assert r.json()["error"]["code"] == "invalid_api_key", path
            assert c.get(path, headers={"x-api-key": WRONG}).status_code == 401, path
            assert c.get(path, headers={"Authorization": f"Bearer {KEYS[0]}"}).status_code == 200, path
        with c.stream("GET", "/dashboard/events") as r:
            assert r.status_code == 401
        with c.stream("GET", "/dashboard/events", headers={"x-api-key": KEYS[1]}) as r:
            assert r.status_code == 200 and next(r.iter_lines()).startswith('data: {"')
        assert c.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES}).status_code == 401
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"  # load balancers probe it


def test_requests_are_counted_per_key_id_never_by_the_key(served):
    def count(text, kid):
        line = f'mlxcluster_api_key_requests_total{{key_id="{kid}"}} '
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line))

    h0 = {"Authorization": f"Bearer {KEYS[0]}"}
    with httpx.Client(base_url=served.url, timeout=30, verify=plain_http()) as c:
        before = c.get("/metrics", headers=h0).text
        for _ in range(3):
            assert c.get("/v1/models", headers={"x-api-key": KEYS[1]}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": WRONG}).status_code == 401
        after = c.get("/metrics", headers=h0).text
    assert count(after, key_id(KEYS[1])) - count(before, key_id(KEYS[1])) == 3
    assert count(after, key_id(KEYS[0])) - count(before, key_id(KEYS[0])) == 1  # the second /metrics read
    assert 'mlxcluster_api_key_refused_total{reason="invalid"}' in after
    assert not any(k in after for k in KEYS) and len(key_id(KEYS[0])) == 8


def test_the_dashboard_in_a_browser_signs_in_with_a_cookie(served):
    browser = {"accept": "text/html,application/xhtml+xml", "sec-fetch-site": "same-origin"}
    with httpx.Client(base_url=served.url, timeout=30, verify=plain_http()) as c:
        page = c.get("/", headers=browser)  # not signed in: the page asks for the key
        assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
        assert 'action="/dashboard/login"' in page.text and 'type="password"' in page.text
        wrong = c.post("/dashboard/login", data={"key": WRONG}, headers=browser)
        assert wrong.status_code == 401 and "wrong API key" in wrong.text and "set-cookie" not in wrong.headers
        ok = c.post("/dashboard/login", data={"key": KEYS[0]}, headers=browser)
        assert ok.status_code == 303 and ok.headers["location"] == "/"
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and KEYS[0] not in cookie
        assert c.get("/", headers=browser).status_code == 200  # the cookie, kept by the client
        assert c.get("/dashboard/state").json()["model"] == "tiny"
        with c.stream("GET", "/dashboard/events") as r:
            assert r.status_code == 200 and next(r.iter_lines()).startswith("data: ")
        chat = {"model": "tiny", "max_tokens": 2, "messages": MESSAGES}
        r = c.post("/v1/chat/completions", json=chat, headers={"sec-fetch-site": "same-origin"})  # the chat box
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "A"
        # another site's page cannot make the signed-in browser use the cluster
        assert c.post("/v1/chat/completions", json=chat, headers={"sec-fetch-site": "cross-site"}).status_code == 401
        assert c.post("/v1/chat/completions", json=chat,
                      headers={"origin": "http://evil.example"}).status_code == 401
        assert c.post("/dashboard/login", data={"key": KEYS[0]},
                      headers={"sec-fetch-site": "cross-site"}).status_code == 403
        c.post("/dashboard/logout", headers={"sec-fetch-site": "same-origin"})
        assert c.get("/dashboard/state").status_code == 401
        cookies = httpx.Cookies({"mlxcluster_session": "forged-token"})
    with httpx.Client(base_url=served.url, timeout=30, cookies=cookies, verify=plain_http()) as c:
        assert c.get("/dashboard/state").status_code == 401


def test_json_login_for_scripts(served):
    with httpx.Client(base_url=served.url, timeout=30, verify=plain_http()) as c:
        assert c.post("/dashboard/login", json={"key": "x"}).status_code == 401
        r = c.post("/dashboard/login", json={"key": KEYS[1]})
        assert r.status_code == 200 and r.json() == {"ok": True}
        assert c.get("/metrics").status_code == 200


# -- key loading, the exposure rule, TLS files ---------------------------------------------------------
def test_key_files_and_the_key_ring(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# users\nsk-one\n\n  sk-two  \n# sk-not-a-key\nsk-one\n")
    assert read_keys(["sk-zero"], [str(f)]) == ["sk-zero", "sk-one", "sk-two"]
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    for keys, files, words in (([], [str(empty)], "holds no key"), ([], [str(tmp_path / "none")], "cannot read"),
                               (["  "], [], "non-empty"), (["a b"], [], "whitespace")):
        with pytest.raises(ValueError, match=words):
            read_keys(keys, files)
    ring = KeyRing(["k1", "k2"])
    assert ring.match("k2") == 1 and ring.match("k3") is None and ring.match("") is None
    assert ring.check({"authorization": "Bearer k1"}) == 0 and ring.check({"x-api-key": "k2"}) == 1
    assert ring.check({"authorization": "Basic k1"}) is None and ring.check({}) is None
    assert ring.ids == [key_id("k1"), key_id("k2")]


def test_exposure_beyond_loopback_needs_a_key_or_insecure_no_auth():
    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2", "[::1]"):
        assert is_loopback(host)
        check_exposure(host, [], False)
    for host in ("0.0.0.0", "::", "192.168.1.5", "example.com"):
        assert not is_loopback(host)
        with pytest.raises(ValueError) as info:
            check_exposure(host, [], False)
        assert "--api-key" in str(info.value) and "--insecure-no-auth" in str(info.value)
        check_exposure(host, ["k"], False)
        check_exposure(host, [], True)


def test_tls_files_are_checked_once(tmp_path):
    key_pem, cert_pem = self_signed(["127.0.0.1"])
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    assert tls_files(None, None) is None and tls_files(str(cert), str(key)) == (str(cert), str(key))
    other_key = tmp_path / "other.pem"
    other_key.write_bytes(self_signed(["127.0.0.1"])[0])
    for c, k, words in ((str(cert), None, "go together"), (None, str(key), "go together"),
                        (str(tmp_path / "missing.pem"), str(key), "cannot read --tls-cert"),
                        (str(key), str(key), "--tls-cert .* holds no PEM certificate"),
                        (str(cert), str(cert), "--tls-key .* holds no unencrypted PEM private key"),
                        (str(cert), str(other_key), "the key does not match the certificate")):
        with pytest.raises(ValueError, match=words) as info:
            tls_files(c, k)
        assert "\n" not in str(info.value)


def test_https_serve_answers_the_openai_client_that_trusts_its_certificate(rank0, tiny_model, tls, tmp_path):
    key_pem, cert_pem = self_signed(["127.0.0.1", "localhost"])
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(cert_pem)
    key.write_bytes(key_pem)
    provider = Provider(rank0, tiny_model, "tiny", tls)
    server = Server(create_app(provider, KeyRing(KEYS)), tls=(str(cert), str(key)))
    try:
        assert server.url.startswith("https://")
        trusted = httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=30)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0, http_client=trusted)
        assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices[0] \
            .message.content == "A"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key=WRONG, max_retries=0, http_client=trusted).models.list()
        untrusting = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0,
                                   http_client=httpx.Client(timeout=30))  # system roots: not this certificate
        with pytest.raises(openai.APIConnectionError):
            untrusting.models.list()
        with pytest.raises(httpx.HTTPError):  # no plaintext on the TLS port
            httpx.get(server.url.replace("https://", "http://") + "/health", timeout=10)
        trusted.close()  # (its kept-alive connection would hold server.stop() for its 1 s of graceful shutdown)
    finally:
        server.stop()
        asyncio.run(provider.aclose())


def test_cli_refuses_exposure_without_keys_and_bad_security_options(tmp_path):
    """One line, exit 2, before any rank, node or server starts."""
    from harness import assert_one_line_error, cli

    for args, option in ((["serve", "--host", "0.0.0.0"], "--host 0.0.0.0"),
                         (["join", "--dashboard-host", "192.168.7.7"], "--dashboard-host 192.168.7.7")):
        proc = cli(*args)
        assert proc.returncode == 2
        assert_one_line_error(proc, option, "--api-key", "--insecure-no-auth")
    assert_one_line_error(cli("serve", "--tls-cert", str(tmp_path / "c.pem")), "--tls-cert and --tls-key go together")
    assert_one_line_error(cli("serve", "--api-key-file", str(tmp_path / "none")), "cannot read --api-key-file")
    assert_one_line_error(cli("join", "--api-key", " "), "--api-key needs a non-empty key")
    assert_one_line_error(cli("serve", "--router-ca", str(tmp_path / "ca.pem")), "--router-ca needs --router")
    assert_one_line_error(cli("serve", "--router", "127.0.0.1:1", "--router-token", "t", "--router-ca",
                              str(tmp_path / "ca.pem")), "cannot read --router-ca")
    assert_one_line_error(cli("router", "--provider-token", "t", "--no-auth", "--tls-key", str(tmp_path / "k.pem")),
                          "--tls-cert and --tls-key go together")
    # the router takes serve's key options (its older spellings too)
    assert_one_line_error(cli("router", "--provider-token", "t"), "users need API keys", "--api-key",
                          "--insecure-no-auth")
    assert_one_line_error(cli("router", "--provider-token", "t", "--api-key", "k", "--insecure-no-auth"),
                          "exclude each other")
    assert_one_line_error(cli("router", "--provider-token", "t", "--api-keys-file", str(tmp_path / "none")),
                          "cannot read --api-key-file")
    assert_one_line_error(cli("router", "--provider-token", "t", "--api-key", " "), "--api-key needs a non-empty key")


@pytest.mark.slow
def test_the_dashboard_with_a_key_in_chromium(served):
    """A real browser (headless Chromium): the page asks for the key, refuses a wrong one, and once
    signed in shows the live state (the event stream, through the cookie) and its chat box answers."""
    from test_dashboard import CHROMIUM, DRIVER, _js, _wait

    if not (CHROMIUM and DRIVER):
        pytest.skip("chromium and chromium-driver are not installed (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    browser = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        browser.get(served.url + "/")
        box = browser.find_element("id", "key")  # the sign-in form, not the dashboard
        box.send_keys(WRONG)
        box.submit()
        _wait(browser, "return document.querySelector('.error') && "
                       "document.querySelector('.error').textContent.includes('wrong API key')", "the refusal", 30)
        assert not _js(browser, "return document.cookie")
        box = browser.find_element("id", "key")
        box.send_keys(KEYS[0])
        box.submit()
        _wait(browser, "const s = document.getElementById('summary'); return s && s.textContent.includes('tiny')",
              "the dashboard's live state", 30)
        assert _js(browser, "return document.cookie") == ""  # HttpOnly: no script reads the session
        browser.find_element("id", "max-tokens").clear()
        browser.find_element("id", "max-tokens").send_keys("2")
        chat = browser.find_element("id", "chat-input")
        chat.send_keys("hi")
        chat.submit()
        _wait(browser, "const a = document.getElementById('last-answer'); return a && a.dataset.state === 'done'",
              "the chat box's answer", 30)
        assert _js(browser, "return document.getElementById('last-answer').textContent") == "A"
    finally:
        browser.quit()
