"""Issue 28's defects of the HTTP front seen from outside (1, 3, 4, 5, 6, 7, 11, 12), each checked
in-process: the FastAPI app over a :class:`Provider` whose rank 0 is a fake ``Generation`` service
that answers a scripted text (so a tool call can be "generated" without a model), driven by the
official ``openai``, ``anthropic`` and ``ollama`` clients where the defect is what a client sees.
"""

import functools
import json
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import httpx
import openai
import pytest

from harness import serve_app
from mlxcluster.front.dialects import ANTHROPIC, OLLAMA_CHAT, OllamaGenerate
from mlxcluster.protocol import mlxcluster_pb2 as pb
from mlxcluster.protocol import mlxcluster_pb2_grpc as pb_grpc
from mlxcluster.protocol.errors import OpenAIError
from test_tools import TEMPLATE, WEATHER

MODEL = "tiny"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
USER = [{"role": "user", "content": "Weather in Oslo?"}]


class ScriptedRank0(pb_grpc.GenerationServicer):
    """Rank 0's ``Generation`` as the provider sees it: every ``Generate`` streams the text of
    :attr:`pieces` (one token each), then ends with EOS; the prompts it got are kept."""

    def __init__(self):
        self.pieces = ["Hello", " world"]
        self.prompts = []
        self.sampling = []
        self.salts = []

    def Info(self, request, context):
        return pb.InfoReply(model="tiny", world_size=1, backend="ring", context_length=1 << 22, vocab_size=256,
                            weight_format="float32", capacity=4, max_queue=4, batch_limit=4)

    def Generate(self, request, context):
        self.prompts.append(list(request.prompt_ids))
        self.sampling.append(request.sampling)
        self.salts.append(request.cache_salt)
        yield pb.GenerateEvent(started=pb.GenerateStarted(prompt_ids=request.prompt_ids))
        lp = request.sampling.logprobs
        top = [pb.TokenLogprob(token_id=70 + k, logprob=-0.5 - k) for k in range(request.sampling.top_logprobs)]
        for piece in self.pieces:
            yield pb.GenerateEvent(token=pb.GeneratedToken(token_id=70, text=piece, logprob=-0.5 if lp else 0.0,
                                                           top_logprobs=top))
        yield pb.GenerateEvent(done=pb.GenerateDone(reason=pb.EOS, text_tail="", generated_tokens=len(self.pieces)))


@pytest.fixture(scope="module")
def served(tmp_path_factory, tls):
    """``(fake rank 0, served)``: a provider whose tokenizer has a tools template (Qwen 2.5's), served
    (``.provider``, ``.url``)."""
    from tinymodel import write_gguf
    from mlxcluster.front import create_app
    from mlxcluster.front.provider import Provider

    path = tmp_path_factory.mktemp("defects") / "tiny.gguf"
    write_gguf(str(path), metadata_overrides={"tokenizer.chat_template": TEMPLATE})
    fake = ScriptedRank0()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_GenerationServicer_to_server(fake, grpc_server)
    port = grpc_server.add_secure_port("127.0.0.1:0", tls.server())
    grpc_server.start()
    try:
        provider = Provider(f"127.0.0.1:{port}", str(path), MODEL, tls)
        with serve_app(create_app(provider)) as url:
            yield fake, SimpleNamespace(provider=provider, url=url)
    finally:
        grpc_server.stop(None)


@pytest.fixture
def fake(served):
    served[0].pieces = ["Hello", " world"]
    return served[0]


@pytest.fixture
def url(served):
    return served[1].url


@functools.lru_cache(maxsize=None)
def plain_http():
    """The SSL context of every client here (each speaks plain HTTP to the served app, so it is
    never used): one for the module, where each client would load the CA bundle itself (~20 ms of
    CPU; ~70 clients)."""
    import ssl

    return ssl.create_default_context()


def _openai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                         http_client=openai.DefaultHttpxClient(verify=plain_http()))


def _anthropic(url):
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0,
                               http_client=anthropic.DefaultHttpxClient(verify=plain_http()))


def _ollama(url):
    import ollama

    return ollama.Client(host=url, verify=plain_http())


def _decoded(served, ids):
    return served[1].provider.tokenizer.decode(ids)


# -- 1: Ollama durations ---------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/api/chat", {"messages": USER}),
    ("/api/generate", {"prompt": "Weather in Oslo?"}),
])
def test_ollama_reports_real_durations_streamed_or_not(fake, url, path, body):
    body = dict(body, model=MODEL, options={"num_predict": 5})
    plain = httpx.post(url + path, json=dict(body, stream=False), timeout=30, verify=plain_http()).json()
    with httpx.stream("POST", url + path, json=body, timeout=30, verify=plain_http()) as r:
        streamed = [json.loads(line) for line in r.iter_lines() if line]
    for final in (plain, streamed[-1]):
        assert final["done"] and final["eval_count"] == 2 and final["prompt_eval_count"] > 0
        for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
            assert isinstance(final[key], int) and final[key] > 0, (key, final)
        assert final["total_duration"] >= final["load_duration"] + final["prompt_eval_duration"] + \
            final["eval_duration"]


# -- 3: Ollama options -----------------------------------------------------------------------
#: every option Ollama documents, at a value that asks for nothing here
NOTHING = {"mirostat": 0, "mirostat_eta": 0.1, "mirostat_tau": 5.0, "repeat_penalty": 1.0, "repeat_last_n": 64,
           "tfs_z": 1, "typical_p": 1.0, "top_k": 0, "min_p": 0.0, "penalize_newline": True, "numa": False,
           "num_thread": 2, "num_ctx": 2048, "num_batch": 512, "num_gpu": 1, "main_gpu": 0, "low_vram": False,
           "f16_kv": True, "logits_all": False, "vocab_only": False, "use_mmap": True, "use_mlock": False,
           "embedding_only": False, "num_keep": 4, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def test_ollama_options_that_ask_for_nothing_are_accepted(fake, url):
    req = OLLAMA_CHAT.to_openai({"model": MODEL, "messages": USER, "options": NOTHING})
    for key in ("top_k", "min_p", "repetition_penalty", "repetition_context_size"):
        assert key not in req
    r = _ollama(url).chat(model=MODEL, messages=USER, options=dict(NOTHING, temperature=0))
    assert r.message.content == "Hello world" and r.done
    # Ollama's documented defaults, as clients that always send a full set send them: honoured
    defaults = dict(NOTHING, top_k=40, top_p=0.9, repeat_penalty=1.1, temperature=0.8, seed=5)
    _ollama(url).chat(model=MODEL, messages=USER, options=defaults)
    s = fake.sampling[-1]
    assert (s.top_k, round(s.top_p, 4), round(s.repetition_penalty, 4), s.repetition_context_size, s.seed) == \
        (40, 0.9, 1.1, 64, 5)


def test_ollama_and_anthropic_sampling_options_map_to_the_providers_fields():
    def options(**o):
        return OLLAMA_CHAT.to_openai({"model": MODEL, "messages": USER, "options": o})

    req = options(top_k=40, min_p=0.05, repeat_penalty=1.1, top_p=0.9, seed=3)
    assert (req["top_k"], req["min_p"], req["top_p"], req["seed"]) == (40, 0.05, 0.9, 3)
    assert (req["repetition_penalty"], req["repetition_context_size"]) == (1.1, 64)  # Ollama's default window
    assert options(repeat_penalty=1.2, repeat_last_n=16)["repetition_context_size"] == 16
    assert options(repeat_penalty=1.2, repeat_last_n=-1, num_ctx=4096)["repetition_context_size"] == 4096
    assert options(repeat_penalty=1.2, repeat_last_n=-1)["repetition_context_size"] >= 2**31 - 1  # the context
    assert "repetition_penalty" not in options(repeat_penalty=1.2, repeat_last_n=0)  # 0: the penalty is off
    gen = OllamaGenerate().to_openai({"model": MODEL, "prompt": "x", "options": {"top_k": 5}})
    assert gen["top_k"] == 5
    assert ANTHROPIC.to_openai({"model": MODEL, "max_tokens": 5, "messages": USER, "top_k": 7})["top_k"] == 7


@pytest.mark.parametrize("opts,param", [
    ({"mirostat": 1}, "options.mirostat"), ({"mirostat": 2}, "options.mirostat"),
    ({"typical_p": 0.5}, "options.typical_p"), ({"tfs_z": 2.0}, "options.tfs_z"),
    ({"repeat_penalty": 1.1, "repeat_last_n": -2}, "options.repeat_last_n"),
    ({"repeat_penalty": 1.1, "penalize_newline": False}, "options.penalize_newline"),
    ({"top_k": "many"}, "options.top_k"), ({"rope_frequency_base": 1e4}, "options.rope_frequency_base"),
])
def test_ollama_options_that_would_change_the_answer_are_refused(url, opts, param):
    with pytest.raises(OpenAIError) as err:
        OLLAMA_CHAT.to_openai({"model": MODEL, "messages": USER, "options": opts})
    assert err.value.status == 400 and err.value.param == param
    r = httpx.post(url + "/api/chat", json={"model": MODEL, "messages": USER, "options": opts}, timeout=30,
                   verify=plain_http())
    assert r.status_code == 400 and param.split(".")[1] in r.json()["error"]  # Ollama's format


def test_ollama_logprobs_are_answered_never_ignored(fake, url):
    import ollama
    client = _ollama(url)
    r = client.chat(model=MODEL, messages=USER, logprobs=True, top_logprobs=2)
    assert [round(e.logprob, 3) for e in r.logprobs] == [-0.5, -0.5] and len(r.logprobs[0].top_logprobs) == 2
    parts = list(client.chat(model=MODEL, messages=USER, logprobs=True, stream=True))
    assert sum(len(p.logprobs or []) for p in parts) == 2
    g = client.generate(model=MODEL, prompt="x", logprobs=True)
    assert len(g.logprobs) == 2
    with pytest.raises(ollama.ResponseError) as err:  # a raw prompt: the completions' logprobs, not Ollama's
        client.generate(model=MODEL, prompt="x", raw=True, logprobs=True)
    assert err.value.status_code == 400 and "logprobs" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=MODEL, messages=USER, logprobs=True, top_logprobs=50)
    assert err.value.status_code == 400 and "top_logprobs" in err.value.error


# -- 4: null content ---------------------------------------------------------------------------
@pytest.mark.parametrize("messages,param", [
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "x"}], "messages[0].content"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}, {"role": "user", "content": "y"}],
     "messages[1].content"),
    ([{"role": "tool", "content": None, "tool_call_id": "c"}], "messages[0].content"),
])
def test_null_content_is_400(url, messages, param):
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages}, timeout=30,
                   verify=plain_http())
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_null_content_of_an_assistant_tool_call_is_accepted(fake, url):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    r = httpx.post(url + "/v1/chat/completions", timeout=30, verify=plain_http(), json={"model": MODEL, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assert r.status_code == 200, r.text


# -- 5: reasoning_effort, verbosity, stream_options -------------------------------------------
def test_reasoning_effort_verbosity_and_stream_options(fake, served, url):
    import anthropic
    import ollama
    client = _openai(url)
    ask = dict(model=MODEL, messages=USER, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as err:  # this template has no reasoning switch
        client.chat.completions.create(**ask, reasoning_effort="high")
    assert err.value.body["param"] == "reasoning_effort" and err.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**ask, verbosity="low")
    assert err.value.body["param"] == "verbosity"
    assert client.chat.completions.create(**ask, verbosity="medium").choices[0].message.content == "Hello world"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**ask, stream_options={"include_usage": True})
    assert err.value.body["param"] == "stream_options" and "only allowed when 'stream' is enabled" in \
        err.value.body["message"]
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2
    # a template that reads enable_thinking (Qwen3) gets it from reasoning_effort
    tok = served[1].provider.tokenizer
    saved = tok.chat_template
    tok.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    try:
        for effort, marked in (("none", True), ("high", False)):
            client.chat.completions.create(**ask, reasoning_effort=effort)
            assert ("NOTHINK" in _decoded(served, fake.prompts[-1])) == marked
        # the Responses dialect's reasoning.effort is the same switch
        client.responses.create(model=MODEL, input="x", reasoning={"effort": "none"})
        assert "NOTHINK" in _decoded(served, fake.prompts[-1])
    finally:
        tok.chat_template = saved
    # Ollama's think: the same switch (false asks nothing of a model without one; true is refused there)
    o = _ollama(url)
    tok.chat_template = ("{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}"
                         "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    try:
        for think, marked in ((False, True), (True, False)):
            o.chat(model=MODEL, messages=USER, think=think, options={"num_predict": 2})
            assert ("NOTHINK" in _decoded(served, fake.prompts[-1])) == marked
    finally:
        tok.chat_template = saved
    assert o.chat(model=MODEL, messages=USER, think=False, options={"num_predict": 2}).message.content
    with pytest.raises(ollama.ResponseError) as err:
        o.chat(model=MODEL, messages=USER, think=True, options={"num_predict": 2})
    assert err.value.status_code == 400
    assert client.chat.completions.create(**ask, reasoning_effort="none").choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:  # a model without the switch: refused, as in chat
        client.responses.create(model=MODEL, input="x", reasoning={"effort": "high"})
    assert err.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", reasoning={"summary": "auto"})
    assert err.value.body["param"] == "reasoning.summary"
    with pytest.raises(anthropic.BadRequestError):
        _anthropic(url).messages.create(
            model=MODEL, max_tokens=4, messages=USER, thinking={"type": "enabled", "budget_tokens": 1024})
    assert _anthropic(url).messages.create(
        model=MODEL, max_tokens=4, messages=USER, thinking={"type": "disabled"}).content[0].text == "Hello world"


# -- 6: dialect 404s and count_tokens ------------------------------------------------------------
def test_unknown_paths_answer_in_the_dialect_of_their_prefix(url):
    a = httpx.post(url + "/v1/messages/nope", json={}, timeout=30, verify=plain_http())
    assert a.status_code == 404 and a.json()["type"] == "error" and a.json()["error"]["type"] == "not_found_error"
    o = httpx.post(url + "/api/nope", json={}, timeout=30, verify=plain_http())
    assert o.status_code == 404 and isinstance(o.json()["error"], str)
    a = httpx.get(url + "/v1/messages", timeout=30, verify=plain_http())  # 405: the same rule
    assert a.status_code == 405 and a.json()["type"] == "error"
    v = httpx.get(url + "/v1/nope", timeout=30, verify=plain_http())
    assert v.status_code == 404 and v.json()["error"]["type"] == "invalid_request_error"


def test_count_tokens_counts_the_prompt_as_it_is_sent(fake, url):
    import anthropic
    client = _anthropic(url)
    tools = [{"name": "get_weather", "description": "The weather.", "input_schema": WEATHER["function"]["parameters"]}]
    for kw in ({}, {"system": "Be brief."}, {"tools": tools}):
        counted = client.messages.count_tokens(model=MODEL, messages=USER, **kw).input_tokens
        client.messages.create(model=MODEL, max_tokens=4, messages=USER, **kw)
        assert counted == len(fake.prompts[-1]) > 0, kw
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=USER)
    r = httpx.post(url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": "x"}, timeout=30,
                   verify=plain_http())
    assert r.status_code == 400 and r.json()["type"] == "error"


# -- 7: tools in every dialect ---------------------------------------------------------------------
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city.",
                  "input_schema": WEATHER["function"]["parameters"]}
ARGS = {"city": "Oslo", "unit": "C"}


def test_anthropic_tools(fake, served, url):
    fake.pieces = ["Sure.\n", CALL]
    client = _anthropic(url)
    kw = dict(model=MODEL, max_tokens=50, messages=USER, tools=[ANTHROPIC_TOOL])
    m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
    use = m.content[1]
    assert use.name == "get_weather" and use.input == ARGS and use.id.startswith("toolu_")
    assert "get_weather" in _decoded(served, fake.prompts[-1])  # the template rendered the tool
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[1].input == ARGS and final.content[0].text.strip() == "Sure."
    forced = client.messages.create(**dict(kw, tool_choice={"type": "tool", "name": "get_weather"}))
    assert forced.content[-1].type == "tool_use"
    fake.pieces = ["It is 12 C."]
    follow = client.messages.create(**dict(kw, messages=USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12 C, rain"}]}]))
    assert follow.stop_reason == "end_turn" and follow.content[0].text == "It is 12 C."
    prompt = _decoded(served, fake.prompts[-1])
    assert "<tool_response>\n12 C, rain" in prompt and '"city": "Oslo"' in prompt


def test_responses_tools(fake, served, url):
    fake.pieces = [CALL]
    client = _openai(url)
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": WEATHER["function"]["parameters"]}
    r = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool])
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS and call.call_id
    assert not [o for o in r.output if o.type == "message"]  # no text: no message item
    events = list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool], stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[0].type == "function_call" and json.loads(done[0].arguments) == ARGS
    with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[tool]) as stream:
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and final.output[0].name == "get_weather"
    fake.pieces = ["It is 12 C."]
    follow = client.responses.create(model=MODEL, tools=[tool], input=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "12 C, rain"}])
    assert follow.output_text == "It is 12 C."
    assert "<tool_response>\n12 C, rain" in _decoded(served, fake.prompts[-1])
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0].type"


def test_ollama_tools(fake, served, url):
    fake.pieces = [CALL]
    client = _ollama(url)
    r = client.chat(model=MODEL, messages=USER, tools=[WEATHER])
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and dict(call.function.arguments) == ARGS and r.done
    parts = list(client.chat(model=MODEL, messages=USER, tools=[WEATHER], stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"] and parts[-1].done
    fake.pieces = ["It is 12 C."]
    follow = client.chat(model=MODEL, tools=[WEATHER], messages=USER + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "content": "12 C, rain"}])
    assert follow.message.content == "It is 12 C."
    prompt = _decoded(served, fake.prompts[-1])
    assert "<tool_response>\n12 C, rain" in prompt and '"city": "Oslo"' in prompt


def test_parallel_tool_calls_false_keeps_one_call(fake, url):
    fake.pieces = [CALL, "\n", CALL.replace("Oslo", "Bergen")]
    client = _openai(url)
    ask = dict(model=MODEL, messages=USER, tools=[WEATHER])
    assert len(client.chat.completions.create(**ask).choices[0].message.tool_calls) == 2
    (one,) = client.chat.completions.create(**ask, parallel_tool_calls=False).choices[0].message.tool_calls
    assert json.loads(one.function.arguments) == ARGS
    m = _anthropic(url).messages.create(
        model=MODEL, max_tokens=50, messages=USER, tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.type for b in m.content] == ["tool_use"]


# -- 11: tokenising off the event loop ---------------------------------------------------------------
class _BlockingTokenizer:
    """The provider's tokenizer, except that ``encode`` of a long text waits (at most 10 s) until
    the test says ``/health`` has answered: on the event loop that wait would hold /health too."""

    def __init__(self, inner):
        self.inner = inner
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, *args, **kwargs):
        if len(text) > 10_000:
            self.entered.set()
            self.release.wait(10)
        return self.inner.encode(text, *args, **kwargs)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 20_000}]}),
    ("/v1/completions", {"prompt": "x" * 20_000}),
])
def test_tokenising_a_long_prompt_does_not_block_health(fake, served, url, path, body):
    provider = served[1].provider
    blocking = provider.tokenizer = _BlockingTokenizer(provider.tokenizer)
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, url + path, json=dict(body, model=MODEL, max_tokens=4), timeout=30,
                                  verify=plain_http())
            assert blocking.entered.wait(10)
            try:
                # times out while the loop tokenises
                health = httpx.get(url + "/health", timeout=5, verify=plain_http())
            finally:
                blocking.release.set()
            assert health.status_code == 200
            assert pending.result().status_code == 200
    finally:
        provider.tokenizer = blocking.inner


# -- 12: many parts, a non-boolean stream ---------------------------------------------------------------
def test_twenty_thousand_text_parts_are_one_prompt(fake, served, url):
    parts = [{"type": "text", "text": "ab "} for _ in range(20_000)]
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": parts}],
                                                       "max_tokens": 4}, timeout=60, verify=plain_http())
    assert r.status_code == 200
    assert _decoded(served, fake.prompts[-1]).count("ab ") == 20_000


@pytest.mark.parametrize("path,body,shape", [
    ("/api/chat", {"messages": USER}, "ollama"),
    ("/api/generate", {"prompt": "x"}, "ollama"),
    ("/v1/messages", {"messages": USER, "max_tokens": 4}, "anthropic"),
    ("/v1/responses", {"input": "x"}, "openai"),
    ("/v1/chat/completions", {"messages": USER}, "openai"),
])
def test_a_non_boolean_stream_is_400_in_the_dialects_format(url, path, body, shape):
    r = httpx.post(url + path, json=dict(body, model=MODEL, stream="yes"), timeout=30, verify=plain_http())
    assert r.status_code == 400, r.text
    err = r.json()
    if shape == "ollama":
        assert "stream" in err["error"]
    elif shape == "anthropic":
        assert err["type"] == "error" and "stream" in err["error"]["message"]
    else:
        assert err["error"]["param"] == "stream"


# -- issue 48, 4: prompt_cache_key is a string ----------------------------------------------------
_KEYED = [("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
          ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
          ("/v1/responses", {"input": "x", "max_output_tokens": 2})]


@pytest.mark.parametrize("path,body", _KEYED)
@pytest.mark.parametrize("bad", [123, {}, [], True, None.__class__])
def test_a_prompt_cache_key_that_is_not_a_string_is_400_naming_it(url, path, body, bad):
    """OpenAI's schema makes ``prompt_cache_key`` a string (schemathesis found 123 and {} accepted):
    anything else is a 400 in OpenAI's error format naming it (JSON null: absent, as OpenAI's
    optional fields)."""
    value = None if bad is type(None) else bad
    r = httpx.post(url + path, json=dict(body, model=MODEL, prompt_cache_key=value), timeout=30, verify=plain_http())
    if value is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_cache_key" and err["type"] == "invalid_request_error", err
    assert "'prompt_cache_key' must be a string" in err["message"], err


@pytest.mark.parametrize("path,body", _KEYED)
def test_a_string_prompt_cache_key_is_accepted_and_no_cache_namespace(fake, url, path, body):
    """A string key (empty too: OpenAI's schema allows it) answers as without one; it is a routing
    hint, so rank 0 gets no cache namespace from it -- only ``cache_salt`` makes one."""
    for key, salt in (("conversation-7", None), ("", None), ("conversation-7", "s1")):
        extra = {"prompt_cache_key": key, **({"cache_salt": salt} if salt else {})}
        r = httpx.post(url + path, json=dict(body, model=MODEL, **extra), timeout=30, verify=plain_http())
        assert r.status_code == 200, r.text
        assert fake.salts[-1] == (salt or "")


def test_the_provider_checks_prompt_cache_key_in_every_dialect(url, served):
    """The Anthropic dialect's schema does not name the field: it reaches the provider (as
    ``cache_salt`` does), which refuses a non-string in that dialect's error format."""
    from mlxcluster.front.provider import ProviderError

    r = httpx.post(url + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": USER,
                                               "prompt_cache_key": 5}, timeout=30, verify=plain_http())
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "'prompt_cache_key' must be a string" in r.json()["error"]["message"], r.text
    with pytest.raises(ProviderError) as err:
        served[1].provider.request_args({"prompt": "x", "prompt_cache_key": {}}, False, 4, "max_tokens")
    assert err.value.param == "prompt_cache_key"


# -- keep-alive answers: no Nagle stall ---------------------------------------------------------
def test_served_connections_have_tcp_nodelay():
    """``serve``'s listening socket (``bind_socket``) is made with ``IPPROTO_TCP``, so asyncio sets
    ``TCP_NODELAY`` on every connection it accepts: with Nagle on, uvicorn's separate header and body
    writes waited for the client's delayed ACK and every keep-alive answer took ~40 ms (1 ms now)."""
    import asyncio
    import socket

    from mlxcluster.front.api import bind_socket

    async def main():
        sock = bind_socket("127.0.0.1", 0)
        sock.listen(8)
        seen = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            assert await asyncio.wait_for(seen, 10) != 0
            writer.close()
        finally:
            server.close()
            await server.wait_closed()

    asyncio.run(main())
