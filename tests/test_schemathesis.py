"""Schemathesis against serve's own ``/openapi.json`` (issue 28 defect 2), in the fast tier.

The app is ``create_app`` over a real :class:`~mlxcluster.front.provider.Provider` (tiny GGUF
tokenizer) whose rank 0 is a fake ``Generation`` service: every answer is the provider's and
the dialects' own code, only the model is fake.  Schemathesis generates bodies from the
published request models (positive and negative) for every operation, a few examples each,
and checks: no 5xx, every status code documented, the content type documented, and every JSON
answer conforming to its documented schema (streamed answers are text).  Then the refusals
the models make are checked by hand: one line naming the field, in the endpoint's own error
format, never FastAPI's 422.
"""

import functools
import json
from concurrent import futures
from types import SimpleNamespace

import grpc
import httpx
import pytest

from mlxcluster.leader.scheduler import Scheduler
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc

MODEL = "tiny"
#: operations schemathesis does not call: an endless event stream (one snapshot per second)
SKIPPED = ("/dashboard/events",)


@functools.lru_cache(maxsize=None)
def plain_http():
    """The SSL context of this module's httpx requests to the plain-HTTP app (never used): one, where
    each request would load the CA bundle itself (~20 ms of CPU)."""
    import ssl

    return ssl.create_default_context()


def checks():
    """What each answer is checked by: no 5xx, and status code, content type, headers and body as the
    document says.  (schemathesis and hypothesis are imported by the checks that use them: every test
    worker collects this module, and pytest rewrites both packages' modules on import.)"""
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                                   response_schema_conformance, status_code_conformance)

    return [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
            response_schema_conformance]


class Rank0(pb_grpc.GenerationServicer):
    """A fake rank 0: any number of requests at once, each answered at once with up to 2
    tokens (``"A"``) and ``done``; embeddings of width 4; rank 0's own prompt check."""

    def Info(self, request, context):
        return pb.InfoReply(model=MODEL, world_size=1, backend="ring", context_length=64, vocab_size=256,
                            weight_format="float32", capacity=4, max_queue=4, queued=0, running=0, batch_limit=4)

    def Generate(self, request, context):
        try:
            Scheduler.validate_prompt(SimpleNamespace(vocab_size=256, context_length=64), request.prompt_ids)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        yield pb.GenerateEvent(started=pb.GenerateStarted(prompt_ids=request.prompt_ids))
        n = min(2, request.max_tokens or 2)
        for _ in range(n):
            yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=70, text="A"))
        yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.MAX_TOKENS, text_tail="", generated_tokens=n))

    def Embed(self, request, context):
        dims = request.dimensions or 4
        if dims > 4:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "'dimensions' must be at most 4")
        return pb.EmbedReply(embeddings=[pb.Embedding(values=[1.0] + [0.0] * (dims - 1), tokens=1)
                                         for _ in request.inputs], prompt_tokens=len(request.inputs))


@pytest.fixture(scope="module")
def provider(tmp_path_factory, tls):
    from mlxcluster.front.provider import Provider
    from tinymodel import write_gguf

    path = str(tmp_path_factory.mktemp("schemathesis") / "tiny.gguf")
    write_gguf(path, metadata_overrides={
        "tokenizer.chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"})
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServicer_to_server(Rank0(), grpc_server)
    port = grpc_server.add_secure_port("127.0.0.1:0", tls.server())
    grpc_server.start()
    try:
        yield Provider(f"127.0.0.1:{port}", path, MODEL, tls)
    finally:
        grpc_server.stop(None)


@pytest.fixture(scope="module")
def server(provider):
    from test_provider import Server

    s = Server(provider)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def secured(provider):
    """The same provider's app with an API key (``serve --api-key``)."""
    from mlxcluster.front import create_app
    from mlxcluster.front.auth import KeyRing
    from test_auth import Server

    s = Server(create_app(provider, KeyRing([KEY])))
    yield s
    s.stop()


KEY = "sk-schemathesis-0123456789"
#: examples per operation and generation mode (positive: bodies the models accept; negative: refused)
EXAMPLES = 2
#: the example of each POST operation whose request model has none (every POST is answered 200 for its
#: example, checked, not only where generated bodies happen to be accepted)
BODIES = {"/api/embed": {"model": MODEL, "input": "hi"}, "/api/embeddings": {"model": MODEL, "prompt": "hi"},
          "/api/show": {"model": MODEL}}


def _nothing_to_break(operation):
    """Whether schemathesis has no negative case for ``operation``: no body, and no parameter but path
    parameters that are any string (a path cannot leave them out, and any string is one).  Hypothesis
    would look for one ~460 times before giving up (``Unsatisfiable``: ~1 s for ``/v1/models/{model}``)."""
    raw = operation.definition.raw
    anything = {"type": "string"}
    return "requestBody" not in raw and all(
        p.get("in") == "path" and {k: v for k, v in p.get("schema", {}).items() if k not in ("title", "description")}
        == anything for p in raw.get("parameters", []))


def _conform(url, modes, examples=EXAMPLES, load_headers=None):
    """Schemathesis over ``url``'s own ``/openapi.json``: every operation (but :data:`SKIPPED`), each
    request model's example (or :data:`BODIES`') once, then ``examples`` generated cases per mode
    (no negative ones where :func:`_nothing_to_break`), no shrinking (the document loaded with
    ``load_headers``, the cases sent without them); each answer checked by :func:`checks`.  Returns
    ``{operation label: set of statuses}``; fails naming every operation that broke a check.
    Schemathesis's Python API with hypothesis (its pytest loader, ``schemathesis.pytest``, fails on
    pytest 9)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable

    schema = schemathesis.openapi.from_url(url + "/openapi.json", headers=load_headers or {})
    failures, seen, labels = [], {}, []

    def run(operation, strategy, n, what):
        @given(case=strategy)
        @settings(max_examples=n, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        def probe(case):
            response = case.call(timeout=30)
            seen.setdefault(operation.label, set()).add(response.status_code)
            case.validate_response(response, checks=checks())

        try:
            probe()
        except Unsatisfiable:  # nothing to break (no body; any path string is valid)
            assert what == "negative", operation.label
        except Exception as exc:  # every operation's failure is reported, not only the first
            failures.append(f"{operation.label} ({what}): {str(exc).strip()[:1500]}")

    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in SKIPPED:
            continue
        labels.append(operation.label)
        examples_of = schema.get_strategies_from_examples(operation)  # the request models' examples
        if not examples_of and operation.path in BODIES:
            examples_of = [st.just(operation.Case(body=BODIES[operation.path], media_type="application/json"))]
        for example in examples_of:
            run(operation, example, 1, "example")
        for mode in modes:
            if mode.value == "negative" and _nothing_to_break(operation):
                continue
            run(operation, operation.as_strategy(generation_mode=mode), examples, mode.value)
    assert not failures, "\n\n".join(failures)
    assert set(seen) == set(labels) and len(labels) >= 18, (labels, seen)  # every operation was called
    return seen


def test_api_conforms_to_its_openapi_document(server):
    """0 undocumented status codes, 0 5xx, documented media types, JSON answers match their schema,
    for bodies generated from the published document (positive and negative)."""
    from schemathesis import GenerationMode

    seen = _conform(server.url, [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    for label, statuses in seen.items():  # every POST endpoint answered its example and refused a body
        if label.startswith("POST "):
            assert {200, 400} <= statuses, (label, statuses)


def test_api_with_a_key_conforms_and_publishes_its_security(secured):
    """With ``--api-key`` the document names the schemes (Bearer, x-api-key) every operation but
    /health needs, and a request without a key is the documented 401 in the documented error body."""
    doc = httpx.get(secured.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                    verify=plain_http()).json()
    assert set(doc["components"]["securitySchemes"]) == {"bearer", "apiKey"} and len(doc["security"]) == 2
    health = doc["paths"]["/health"]["get"]
    assert health["security"] == [] and "401" not in health["responses"]
    assert httpx.get(secured.url + "/openapi.json", timeout=30, verify=plain_http()).status_code == 401
    from schemathesis import GenerationMode

    seen = _conform(secured.url, [GenerationMode.POSITIVE], examples=1,
                    load_headers={"Authorization": f"Bearer {KEY}"})
    assert seen.pop("GET /health") == {200}
    assert set().union(*seen.values()) == {401}, seen


def _keys(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield key
            yield from _keys(value)
    elif isinstance(node, list):
        for value in node:
            yield from _keys(value)


def test_every_post_endpoint_publishes_its_body_and_errors(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=30, verify=plain_http()).json()
    components = doc["components"]["schemas"]
    posts = {p: item["post"] for p, item in doc["paths"].items() if "post" in item and p != "/dashboard/login"}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/api/chat",
            "/api/generate", "/api/show"} <= set(posts)
    for path, op in posts.items():
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.rsplit("/", 1)[1] in components, path
        assert {"200", "400", "401", "404", "413"} <= set(op["responses"]), path
        assert "422" not in op["responses"], path
        if "429" in op["responses"]:
            assert "Retry-After" in op["responses"]["429"]["headers"], path
    assert not {"ge", "le", "gt", "lt"} & set(_keys(components)), "a bound not translated to JSON Schema"
    assert "messages" in components["ChatCompletionRequest"]["required"]
    assert components["ChatCompletionRequest"]["properties"]["temperature"]["anyOf"][0] == {
        "type": "number", "minimum": 0, "maximum": 2, "description": "Sampling temperature (0: greedy)."}
    error_of = {"/v1/chat/completions": "OpenAIErrorBody", "/v1/messages": "AnthropicErrorBody",
                "/api/chat": "OllamaErrorBody"}
    for path, name in error_of.items():
        assert posts[path]["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(name)
    for path in ("/v1/models", "/v1/models/{model}", "/health", "/metrics", "/api/tags", "/api/ps",
                 "/api/version", "/dashboard/state"):
        item = doc["paths"][path]["get"]
        assert "200" in item["responses"] and "422" not in item["responses"], path
    assert "503" in doc["paths"]["/health"]["get"]["responses"]


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]},
     "messages[0].role", "must be one of"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
     "temperature", "must be a number"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": 5},
     "stop", "must be a string or a list"),
    ("/v1/chat/completions", {"model": MODEL}, "messages", "is required"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, "stream", "must be a boolean"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": 5}]},
     "messages[0].content", "must be a string or a list"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": "many"}, "max_output_tokens",
     "must be an integer"),
    ("/api/chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream",
     "must be a boolean"),
    ("/api/generate", {"model": MODEL}, "prompt", "is required"),
    ("/api/show", {"model": 5}, "model", "must be a string"),
])
def test_a_body_the_model_refuses_is_400_in_the_endpoints_format(server, path, body, param, words):
    r = httpx.post(server.url + path, json=body, timeout=30, verify=plain_http())
    assert r.status_code == 400, r.text
    err = r.json()
    if path == "/v1/messages":
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        message = err["error"]["message"]
    elif path.startswith("/api/"):
        assert set(err) == {"error"} and isinstance(err["error"], str)
        message = err["error"]
    else:
        assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param
        message = err["error"]["message"]
    assert message.startswith(f"'{param}' ") and words in message and "\n" not in message, message


def test_what_the_provider_accepts_passes_the_models(server):
    """Bodies real clients send: assistant content null with tool_calls, content parts, stop as a
    string or a list, a float-integer seed, logit_bias string keys, Ollama without stream."""
    chat = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "and?"}]}]}
    for extra in ({"stop": "x"}, {"stop": ["x", "y"]}, {"seed": 35804.0}, {"logit_bias": {"5": -1}},
                  {"stream": True, "stream_options": {"include_usage": True}}, {"unknown_field": {"a": 1}}):
        r = httpx.post(server.url + "/v1/chat/completions", json={**chat, **extra}, timeout=30, verify=plain_http())
        assert r.status_code == 200, (extra, r.text)
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": [[1, 2, 3]], "max_tokens": 1},
                   timeout=30, verify=plain_http())
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/api/generate", json={"model": MODEL + ":latest", "prompt": "hi",
                                                      "options": {"num_predict": 1}}, timeout=30, verify=plain_http())
    assert r.status_code == 200 and json.loads(r.text.splitlines()[-1])["done"], r.text


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [1] * 1_000_000}]},
    {"messages": [1] * 1_000_000},
    {"messages": [{"role": "user", "content": "hi"}], "tools": [1] * 1_000_000},
    {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {str(i): "x" for i in range(200_000)}},
])
def test_a_million_wrong_items_cost_one_error(body):
    """Validation stops at a list's first bad item (and at an oversized map's size): an 8 MiB body
    of wrong items is refused at once, not after one error per item (93 s for 4M items before)."""
    from pydantic import ValidationError

    from mlxcluster.front.schemas import ChatCompletionRequest, check

    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate(body)
    assert exc.value.error_count() <= 4
    with pytest.raises(Exception) as refused:
        check(ChatCompletionRequest, body)
    assert refused.value.status == 400 and "\n" not in refused.value.message
