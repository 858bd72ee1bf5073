"""Tool calling: ``tools`` / ``tool_choice`` through the chat template and mlx-lm's tool parser.

Fast: the stream splitter on plain strings, validation.  Slow: a random-weight Qwen3 with a
Hermes-style (Qwen 2.5) tools template served at TP=1 and TP=3 -- with ``tool_choice``
``required`` or a named function the grammar makes even random weights answer a call whose
arguments validate against the function's schema, the same at both world sizes.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from mlxcluster.protocol.errors import OpenAIError
from mlxcluster.front.tools import ToolCalls, tool_spec

#: Qwen 2.5's tools convention (Hermes format), abridged
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "\n<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


class _Tok:
    chat_template = TEMPLATE

    def get_vocab(self):
        return {}


# -- fast ------------------------------------------------------------------------------------
def test_stream_splitter_releases_text_before_the_call_and_parses_the_call():
    spec = tool_spec({"tools": [WEATHER]}, _Tok())
    assert spec.choice == "auto" and spec.grammar == "" and spec.start == "<tool_call>"
    calls = ToolCalls(spec)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    out = "".join(calls.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    assert out == "Let me check.\n"  # a partial '<tool' was held, never streamed
    rest, made = calls.finish()
    assert rest == "" and len(made) == 1
    assert made[0]["function"]["name"] == "get_weather"
    assert json.loads(made[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    plain = ToolCalls(spec)
    assert plain.feed("No tools <tool") == "No tools "
    assert plain.feed("kit needed") == "<toolkit needed" and plain.finish() == ("", [])
    broken = ToolCalls(spec)
    broken.feed("<tool_call>\nnot json</tool_call>")
    assert broken.finish() == ("<tool_call>\nnot json</tool_call>", [])  # released as content


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
    ({"tools": "x"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_malformed_tools_are_400(body, param):
    with pytest.raises(OpenAIError) as err:
        tool_spec(body, _Tok())
    assert err.value.status == 400 and err.value.param == param


def test_template_without_tools_is_refused():
    class Plain(_Tok):
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    with pytest.raises(OpenAIError) as err:
        tool_spec({"tools": [WEATHER]}, Plain())
    assert err.value.param == "tools" and "does not render tools" in err.value.message
    assert tool_spec({"tools": [WEATHER], "tool_choice": "none"}, Plain()) is None  # nothing offered


# -- slow: a served model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    import openai

    from mlxcluster.model.synthetic import write_model
    from mlxcluster.runtime.launcher import LocalCluster, mpirun_path
    from mlxcluster.front.provider import Provider
    from test_provider import Server

    path = write_model("qwen3", str(tmp_path_factory.mktemp("tools") / "qwen3"), overrides=dict(
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=16, intermediate_size=192,
        max_position_embeddings=4096))  # TP=3; room for the tools in a byte-level prompt
    import os

    cfg_path = f"{path}/tokenizer_config.json"
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    if os.path.exists(f"{path}/chat_template.jinja"):  # newer transformers save the template apart
        with open(f"{path}/chat_template.jinja", "w") as f:
            f.write(TEMPLATE)
    one = LocalCluster(1, model=path, weights="float32")
    three = LocalCluster(3, "mpi" if mpirun_path() else "ring", model=path, weights="float32")
    with one, three:
        servers = [Server(Provider(c.address, path, "q", c.credentials)) for c in (one, three)]
        try:
            yield [openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=300) for s in servers]
        finally:
            for s in servers:
                s.stop()


def _ask(client, **kw):
    return client.chat.completions.create(model="q", messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                          tools=[WEATHER, TIME], temperature=0, max_tokens=200, **kw)


@pytest.mark.slow
def test_forced_tool_calls_parse_and_validate_identically_at_tp1_and_tp3(clients):
    import jsonschema

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(lambda c: _ask(c, tool_choice="required"), clients)
    for r in (a, b):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
        assert call.id.startswith("call_") and call.type == "function"
    assert [c.function.model_dump() for c in a.choices[0].message.tool_calls] == \
        [c.function.model_dump() for c in b.choices[0].message.tool_calls]
    named = _ask(clients[0], tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    # streamed: the call arrives as delta.tool_calls, then finish_reason tool_calls
    chunks = list(_ask(clients[1], tool_choice="required", stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.arguments for d in deltas] == [a.choices[0].message.tool_calls[0].function.arguments]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # a function whose parameters are no JSON Schema llguidance compiles: 400 naming tools (was a 500)
    import openai

    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}
    with pytest.raises(openai.BadRequestError) as err:
        clients[0].chat.completions.create(model="q", messages=[{"role": "user", "content": "x"}], tools=[bad],
                                           tool_choice="required", max_tokens=4)
    assert err.value.body["param"] == "tools" and "invalid grammar" in err.value.body["message"]
    # without a forced choice random weights do not call: the answer is text (the grammar did the work)
    free = _ask(clients[0])
    assert free.choices[0].message.tool_calls is None
    # the conversation continues with the call and its result (the template renders both)
    follow = clients[0].chat.completions.create(model="q", temperature=0, max_tokens=4, tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [a.choices[0].message.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": a.choices[0].message.tool_calls[0].id, "content": "12 C, rain"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
