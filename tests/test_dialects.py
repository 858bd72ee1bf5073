"""The Anthropic Messages, Ollama and OpenAI Responses dialects, driven by their own official
client packages (``anthropic``, ``ollama``, ``openai``) against a real provider on the real
model: chat, streaming, stop sequences, seed reproducibility, errors; and the same answers as
OpenAI's chat completions (one scheduler under every dialect).  Translation rules are tested
fast on plain dicts at the top.
"""

import json

import httpx
import pytest

from mlxcluster.protocol.errors import OpenAIError
from mlxcluster.front.dialects import ANTHROPIC, OLLAMA_CHAT, RESPONSES, OllamaGenerate

MODEL = "smollm2"
PROMPT = "Tell me a long story about a dragon."
#: the reference's length: a few words, enough for a stop sequence inside it (its 2nd word) and an
#: answer cut at max_tokens; every dialect must say these same tokens
TOKENS = 8
#: a prompt SmolLM2 answers with a short JSON object when its answer must be JSON
JSON_PROMPT = "What is 2+2? Answer in JSON."


# -- translation, fast -------------------------------------------------------------------
def test_anthropic_request_becomes_a_chat_request():
    req = ANTHROPIC.to_openai({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "Be brief."}],
                               "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                               "stop_sequences": ["\n"], "temperature": 0})
    assert req["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert req["stop"] == ["\n"] and req["max_tokens"] == 5 and req["temperature"] == 0 and req["stream"]


@pytest.mark.parametrize("dialect,body,param", [
    (ANTHROPIC, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    (ANTHROPIC, {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                 "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    (ANTHROPIC, {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                 "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    (ANTHROPIC, {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, "messages[0].content"),
    (OLLAMA_CHAT, {"model": "m", "messages": [{"role": "user", "content": "x"}], "options": {"mirostat": 2}},
     "options.mirostat"),
    (OLLAMA_CHAT, {"model": "m", "messages": []}, "messages"),
    (RESPONSES, {"model": "m", "input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    (RESPONSES, {"model": "m", "input": 5}, "input"),
])
def test_unsupported_or_malformed_fields_are_refused(dialect, body, param):
    with pytest.raises(OpenAIError) as err:
        dialect.to_openai(body)
    assert err.value.status == 400 and err.value.param == param


def test_ollama_options_map_and_resource_options_are_accepted():
    req = OLLAMA_CHAT.to_openai({"model": "m:latest", "messages": [{"role": "user", "content": "x"}], "format": "json",
                                 "options": {"num_predict": 7, "temperature": 0, "seed": 3, "num_ctx": 4096,
                                             "stop": ["."]}})
    assert req["model"] == "m" and req["max_tokens"] == 7 and req["seed"] == 3 and req["stop"] == ["."]
    assert req["response_format"] == {"type": "json_object"} and req["temperature"] == 0
    raw = OllamaGenerate()
    assert raw.to_openai({"model": "m", "prompt": "abc", "raw": True})["prompt"] == "abc" and not raw.chat


# -- the real model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(real_model_path, tp1_group):
    from mlxcluster.front.provider import Provider
    from test_provider import Server

    s = Server(Provider(tp1_group.address, real_model_path, MODEL, tp1_group.credentials))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(server):
    """The OpenAI chat completion of PROMPT at temperature 0 (what every dialect must say)."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=0,
                                       max_tokens=TOKENS)
    return r.choices[0].message.content


@pytest.mark.slow
def test_anthropic_client(server, reference):
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    # (this client has no temperature argument any more; older ones send the field, which is honoured)
    kw = dict(model=MODEL, max_tokens=TOKENS, messages=[{"role": "user", "content": PROMPT}],
              extra_body={"temperature": 0})
    m = client.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.content[0].text == reference
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == TOKENS
    # the reference asked the same prompt: all but its last position come from the prefix cache,
    # which Anthropic's usage counts apart (input_tokens: the positions prefilled)
    assert m.usage.input_tokens == 1 and m.usage.cache_read_input_tokens > 5
    with client.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == reference and final.usage.output_tokens == TOKENS
    assert final.usage.input_tokens == m.usage.input_tokens
    # a stop sequence: cut there, named in stop_sequence
    word = reference.split()[1]
    s = client.messages.create(**dict(kw, stop_sequences=[word]))
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == word and word not in s.content[0].text
    # a system prompt changes the answer; a seed at temperature 1 reproduces it (through metadata-free extra)
    sys_answer = client.messages.create(**dict(kw, system="Answer in French.")).content[0].text
    assert sys_answer != reference
    a, b = (client.messages.create(**dict(kw, extra_body={"temperature": 1.0, "seed": 7})).content[0].text
            for _ in range(2))
    assert a == b
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(**dict(kw, extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}}))
    assert "thinking" in str(err.value)
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    js = client.messages.create(**dict(kw, max_tokens=40, output_config={"format": {"type": "json_schema",
                                                                                   "schema": schema}}))
    assert json.loads(js.content[0].text)["color"] in ("red", "blue")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(**dict(kw, model="nope"))
    r = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"


@pytest.mark.slow
def test_ollama_client(server, reference):
    import ollama

    client = ollama.Client(host=server.url)
    assert client.version if hasattr(client, "version") else True
    names = [m.model for m in client.list().models]
    assert names == [f"{MODEL}:latest"]
    shown = client.show(MODEL)
    assert shown.modelinfo["general.architecture"] == "llama"
    opts = {"temperature": 0, "num_predict": TOKENS}
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": PROMPT}], options=opts)
    assert r.message.content == reference and r.done and r.done_reason == "length" and r.eval_count == TOKENS
    parts = list(client.chat(model=MODEL, messages=[{"role": "user", "content": PROMPT}], options=opts, stream=True))
    assert "".join(p.message.content for p in parts) == reference and parts[-1].done and not parts[0].done
    word = reference.split()[1]
    stopped = client.chat(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                          options=dict(opts, stop=[word]))
    assert word not in stopped.message.content and stopped.done_reason == "stop"
    a, b = (client.chat(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                        options={"temperature": 1.0, "seed": 11, "num_predict": TOKENS}).message.content
            for _ in range(2))
    assert a == b
    # a prompt whose JSON answer is short (13 tokens; one about a cat ran 45 grammar-constrained steps);
    # unconstrained, its answer is prose, not JSON
    js = client.chat(model=MODEL, messages=[{"role": "user", "content": JSON_PROMPT}],
                     options={"temperature": 0, "num_predict": 60}, format="json")
    assert isinstance(json.loads(js.message.content), dict)
    g = client.generate(model=MODEL, prompt=PROMPT, options=opts)
    assert g.response == reference and g.done
    raw = list(client.generate(model=MODEL, prompt="The capital of France is", raw=True, stream=True,
                               options={"temperature": 0, "num_predict": 4}))
    assert raw[-1].done and "".join(p.response for p in raw).strip()
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert err.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}], options={"mirostat": 2})
    assert err.value.status_code == 400 and "mirostat" in err.value.error
    assert httpx.get(server.url + "/api/version", timeout=30).json()["version"]


@pytest.mark.slow
def test_openai_responses(server, reference):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.responses.create(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=TOKENS)
    assert r.output_text == reference and r.status == "incomplete" and r.usage.output_tokens == TOKENS
    assert r.usage.input_tokens_details.cached_tokens == r.usage.input_tokens - 1  # the reference's prompt
    assert r.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model=MODEL, input=PROMPT, temperature=0, max_output_tokens=TOKENS,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reference
    done = client.responses.create(model=MODEL, instructions="Be brief.", temperature=0, max_output_tokens=200,
                                   input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}])
    assert done.status == "completed" and done.output_text
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=PROMPT, previous_response_id="resp_x")
    assert err.value.body["param"] == "previous_response_id"
