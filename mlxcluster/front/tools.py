"""OpenAI tool calling (``tools``, ``tool_choice``) through the model's own chat template.

The tools are rendered into the prompt by the chat template (``apply_chat_template(...,
tools=...)``, the Hugging Face convention); the model answers a call in its own format, which
mlx-lm's tool parsers read (``mlx_lm/tool_parsers``: the parser is inferred from the
template as mlx-lm's ``tokenizer_utils`` does, e.g. ``json_tools`` for the Hermes / Qwen
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format).  A template that does not
render tools is refused with 400: a model never told about the tools cannot call them.

``tool_choice``: ``"none"`` (the tools are not offered), ``"auto"`` (the model decides; its
calls are parsed out of the text), ``"required"`` or a named function: the answer is
constrained (llguidance grammar) to one call in the template's JSON format whose arguments
validate against the function's ``parameters`` schema -- formats whose calls are not JSON
refuse these two choices.

Streaming: text before the first call marker streams as ``content``; from the marker on the
text is held, and at the end the calls come out as ``delta.tool_calls`` with
``finish_reason: "tool_calls"`` (held text that parses as no call is released as content).
"""

from __future__ import annotations

import importlib
import json
import re
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..protocol.errors import OpenAIError

__all__ = ["ToolCalls", "ToolSpec", "tool_spec", "stop_hold", "StopScan"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _bad(message: str, param: str, code: Optional[str] = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


class ToolSpec:
    """A request's validated tools: ``tools`` (for the template), ``choice`` (``auto``,
    ``required`` or a function name), the template's parser module, and the grammar of a
    forced call (``""`` when the model chooses)."""

    def __init__(self, tools: List[Dict[str, Any]], choice: str, parser, grammar: str):
        self.tools, self.choice, self.parser, self.grammar = tools, choice, parser, grammar

    @property
    def start(self) -> str:
        return self.parser.tool_call_start

    @property
    def end(self) -> str:
        return self.parser.tool_call_end


def _parser_of(tokenizer):
    """mlx-lm's tool parser module for this tokenizer's chat template, or ``None``."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return None
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        name = _infer_tool_parser(tokenizer)
        return importlib.import_module(f"mlx_lm.tool_parsers.{name}") if name else None
    except (ImportError, AttributeError):
        return None


def tool_spec(body: Dict[str, Any], tokenizer) -> Optional[ToolSpec]:
    """The request's tools, checked, or ``None`` when none are offered (no ``tools``, or
    ``tool_choice: "none"``).

    Raises:
        OpenAIError: 400 naming ``tools`` / ``tool_choice`` (malformed; a template without tool
            support; a forced call in a format that is not JSON).
    """
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise _bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of function tools", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
            raise _bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": [A-Za-z0-9_-]{{1,64}}, "
                       "...}}", f"tools[{i}]")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters must be a JSON Schema object", f"tools[{i}]")
        names.append(fn["name"])
    if choice in (None, "auto", "none", "required"):
        choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and choice["function"].get("name") in names:
        choice = choice["function"]["name"]
    else:
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                   "{\"name\": <one of the tools>}}", "tool_choice")
    if choice == "none":
        return None
    parser = _parser_of(tokenizer)
    if parser is None:
        raise _bad("'tools' is not supported by this model: its chat template does not render tools", "tools",
                   "unsupported_parameter")
    grammar = ""
    if choice != "auto":
        if parser.__name__.rsplit(".", 1)[-1] != "json_tools":
            raise _bad(f"'tool_choice' {choice!r} needs a model whose tool calls are JSON", "tool_choice",
                       "unsupported_parameter")
        grammar = _call_grammar(parser, [t["function"] for t in tools if choice == "required"
                                         or t["function"]["name"] == choice])
    return ToolSpec(tools, choice, parser, grammar)


def _call_grammar(parser, functions: List[Dict[str, Any]]) -> str:
    """llguidance Lark grammar of one call: ``start`` marker, ``{"name": ..., "arguments": {...}}``
    valid against the function's ``parameters``, ``end`` marker."""
    variants = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  "arguments": f.get("parameters") or {"type": "object"}},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {"x-guidance": {"whitespace_flexible": False}, "anyOf": variants}
    return (f"start: {json.dumps(parser.tool_call_start + chr(10))} call {json.dumps(chr(10) + parser.tool_call_end)}\n"
            f"call: %json {json.dumps(schema)}\n")


class ToolCalls:
    """Splits a streamed answer into content and tool calls (see the module doc)."""

    def __init__(self, spec: ToolSpec):
        self.spec = spec
        self.text = ""      # everything generated
        self.emitted = 0    # characters released as content
        self.calling = -1   # where the first call marker starts, once seen

    def feed(self, piece: str) -> str:
        """Content to stream now (possibly ""), after ``piece`` of generated text."""
        self.text += piece
        if self.calling < 0:
            i = self.text.find(self.spec.start, self.emitted)
            if i >= 0:
                self.calling = i
                upto = i
            else:
                upto = len(self.text) - stop_hold(self.text, [self.spec.start])
        else:
            upto = self.emitted
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out

    def finish(self) -> Tuple[str, List[Dict[str, Any]]]:
        """``(content still held, calls)`` at the end; calls in OpenAI's ``tool_calls`` shape
        (``arguments`` a JSON string)."""
        if self.calling < 0:
            return self.text[self.emitted:], []
        calls = []
        rest = self.text[self.calling:]
        start, end = self.spec.start, self.spec.end
        for block in rest.split(start)[1:]:
            inner = block.split(end, 1)[0] if end else block
            try:
                call = self.spec.parser.parse_tool_call(inner, self.spec.tools)
            except Exception:
                return self.text[self.emitted:], []  # not a call after all: the text as it is
            for c in call if isinstance(call, list) else [call]:
                if not isinstance(c, dict) or not isinstance(c.get("name"), str):
                    return self.text[self.emitted:], []
                args = c.get("arguments", {})
                calls.append({"index": len(calls), "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                              "function": {"name": c["name"],
                                           "arguments": args if isinstance(args, str) else json.dumps(args)}})
        return self.text[self.emitted:self.calling].rstrip() if calls else self.text[self.emitted:], calls


def template_messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """OpenAI messages as chat templates read them: an assistant's ``tool_calls`` with
    ``arguments`` parsed into objects (Hugging Face's convention), a tool result's
    ``tool_call_id`` kept."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = dict(tc.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        pass
                calls.append({"id": tc.get("id"), "type": "function", "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out

def stop_hold(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class StopScan:
    """Stop strings over a streamed answer: feed each token's text piece, get back the text that
    may be sent now.  Text that may be the start of a stop string is held back until it is not
    (or the answer ends); a stop string found cuts the answer just before it (OpenAI's ``stop``:
    the stop string itself is not returned).

    Attributes:
        text: every piece fed so far (str).
        emitted: characters of :attr:`text` already returned (int)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = list(stops)
        self.text, self.emitted = "", 0

    def feed(self, piece: str, final: bool = False) -> Tuple[str, Optional[str]]:
        """Add ``piece``; returns ``(out, matched)``: the text that may be sent now (possibly "")
        and the stop string that ended the answer (``None``: none yet).  ``final``: the answer
        ends with this piece (nothing is held back)."""
        self.text += piece
        text, cut = self.text, -1
        for s in self.stops:
            i = text.find(s, self.emitted)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        upto = cut if cut >= 0 else len(text) if final else len(text) - stop_hold(text, self.stops)
        out, self.emitted = text[self.emitted:upto], max(self.emitted, upto)
        return out, (next(s for s in self.stops if text.startswith(s, cut)) if cut >= 0 else None)
