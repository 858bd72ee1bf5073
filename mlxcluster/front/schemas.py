"""The HTTP API's request and response models: what validates a request body and what
``/openapi.json`` publishes, from the same pydantic models.

Every POST endpoint has a request model (:data:`REQUEST_MODELS`).  A route reads its body as
before (:func:`~mlxcluster.protocol.errors.read_body`: size limit, strict JSON) and then
:func:`check` s it against its model: types, ranges and required fields.  A body the model
refuses is a 400 naming the field (``param``: ``messages[0].role``), in the endpoint's own
error format (the caller turns the :class:`~mlxcluster.protocol.errors.OpenAIError` into
OpenAI's, Anthropic's or Ollama's body), never FastAPI's 422.  The models allow fields they do
not name (``extra="allow"``): the provider and the dialect codecs still check every field in
detail (and refuse what this server does not implement).  A model refuses only malformed values
(a wrong JSON type, a limit out of range, a missing required field), which the provider refuses
too or, like ``"stream": "yes"`` (once taken as true), should have.  The sampling fields' ranges are
published here but checked once, by :func:`~mlxcluster.protocol.args.check_args` (:func:`published`).  Lists stop at their first bad
item, so a refusal costs one error whatever the body's size.

The OpenAPI side: :func:`route` gives a route decorator's ``openapi_extra`` (the request body:
a ``$ref`` to the model's schema in ``components``) and ``responses`` (200 with its schema and
media types; 400, 401, 404, 413, 429, 500, 503 with the dialect's error body); :func:`install`
adds the request models' schemas to the app's ``components``, drops the 422 FastAPI adds for
route parameters (never answered: typed parameters here cannot fail) and, with API keys, publishes
the key schemes every operation but the open ones needs.

Imports pydantic, Starlette's ``Response`` and the protocol's error (no MLX).
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, Iterable, List, Literal, Optional, Sequence, Tuple, Type, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.json_schema import models_json_schema
from pydantic_core import PydanticCustomError
from starlette.responses import Response

from ..protocol.errors import OpenAIError

__all__ = ["ANTHROPIC", "OLLAMA", "OPENAI", "REQUEST_MODELS", "check", "install", "route", "schema_ref",
           "ChatCompletionRequest", "CompletionRequest", "AnthropicMessagesRequest", "ResponsesRequest",
           "OllamaChatRequest", "OllamaGenerateRequest", "OllamaShowRequest", "AnthropicCountTokensRequest",
           "EmbeddingsRequest", "OllamaEmbedRequest", "OllamaLegacyEmbeddingRequest", "OllamaLegacyEmbedding"]

#: error formats (the ``errors`` argument of :func:`route`)
OPENAI, ANTHROPIC, OLLAMA = "openai", "anthropic", "ollama"


#: ``cache_salt``'s description (vLLM's field; issue 32)
CACHE_SALT = ("vLLM's cache salt: prompts under different salts never share prefix-cache positions, so "
              "cached_tokens and time to first token say nothing about other clients' prompts.")
#: ``prompt_cache_key``'s description (OpenAI's field, a string; issue 48)
PROMPT_CACHE_KEY = ("OpenAI's prompt cache key: a hint that requests with the same key share prompt prefixes. "
                    "The router sends them to the same provider while it has room (rendezvous hashing); it "
                    "shares or isolates no cache (cache_salt does).")

class _Request(BaseModel):
    """A request object: JSON types checked strictly (no "1" for 1, no 1 for true), fields the
    model does not name allowed (the provider checks them)."""

    model_config = ConfigDict(strict=True, extra="allow")


def _integral(value: Any) -> Any:
    """A JSON number that is an integer written with a fraction (``35804.0``) as that integer."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


#: an integer; ``35804.0`` counts (JSON Schema's ``integer`` is a mathematical integer)
Integer = Annotated[int, BeforeValidator(_integral)]


def seq(item: Any, **bounds: int) -> Any:
    """A JSON array of ``item`` (``min_length`` / ``max_length``) whose validation stops at its first
    bad item (``fail_fast``: a body of a million wrong items costs one error, not a million)."""
    return Annotated[List[item], Field(fail_fast=True, **bounds)]


def mapping(value: Any, max_length: int) -> Any:
    """A JSON object of at most ``max_length`` ``value`` s (a longer one is refused before its values
    are looked at: one error, not one per entry)."""
    def bounded(obj: Any) -> Any:
        if isinstance(obj, dict) and len(obj) > max_length:
            raise PydanticCustomError("too_long", "too long", {"max_length": max_length})
        return obj

    return Annotated[Dict[str, value], Field(max_length=max_length), BeforeValidator(bounded)]


def published(**bounds: float) -> Dict[str, Any]:
    """``Field`` keywords that publish a sampling field's range in the OpenAPI document (``minimum``,
    ``maximum``, ``exclusiveMinimum``) without checking it here: the range is
    :func:`~mlxcluster.protocol.args.check_args`'s, the one check every dialect and rank 0's gRPC
    service share, so a value out of range gets one message whatever the endpoint."""
    names = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum"}
    return {"json_schema_extra": {names[k]: v for k, v in bounds.items()}}


def integer(**bounds: int) -> Any:
    """An integer (strictly: ``5.0`` is refused, as the provider refuses it) within ``bounds``
    (``ge``, ``le``)."""
    return Annotated[int, Field(**bounds)]


Temperature = Annotated[float, Field(description="Sampling temperature (0: greedy).", **published(ge=0, le=2))]
TopP = Annotated[float, Field(description="Nucleus sampling: the smallest set of tokens whose probabilities add up "
                                          "to top_p.", **published(gt=0, le=1))]
Penalty = Annotated[float, Field(**published(ge=-2, le=2))]
TopLogprobs = Annotated[int, Field(**published(ge=0, le=20))]
#: the largest value a ``uint32`` field of rank 0's messages carries
UINT32_MAX = 2**32 - 1
Stop = Union[str, seq(str, max_length=4)]


# -- request models: OpenAI ----------------------------------------------------------------
class ContentPart(_Request):
    """One part of a message's content (this server reads ``{"type": "text", "text": ...}``)."""

    type: str
    text: Optional[str] = None


class FunctionCall(_Request):
    name: str
    arguments: Any = None


class ToolCall(_Request):
    """A function call an assistant made (its arguments a JSON string)."""

    id: Optional[str] = None
    type: Optional[str] = None
    function: FunctionCall


class ChatMessage(_Request):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, seq(Union[str, ContentPart]), None] = Field(
        None, description="A string or a list of text parts; null for an assistant message with tool_calls.")
    name: Optional[str] = None
    tool_calls: Optional[seq(ToolCall)] = None
    tool_call_id: Optional[str] = None


class StreamOptions(_Request):
    include_usage: Optional[bool] = None


class Speculative(_Request):
    """Speculative decoding of one request (an extension: vLLM configures it per server only, with
    ``speculative_config``'s ``method`` and ``num_speculative_tokens``; these are this server's
    ``--draft`` / ``--draft-tokens``)."""

    draft: Optional[str] = Field(None, description='"ngram" or "ngram:MIN-MAX" (prompt lookup), "model:PATH" (a '
                                                   'draft model with the served model\'s tokenizer, on the '
                                                   'server), "layers:N" (the model\'s first N layers draft), '
                                                   '"remote:HOST:PORT" (a draft node\'s group), "off" (none); '
                                                   'absent or "": the server\'s --draft.')
    draft_tokens: Optional[integer(ge=0, le=16)] = Field(None, description="Most draft tokens verified per step "
                                                                          "(1..16; 0 or absent: the server's).")


class _Sampling(_Request):
    """The fields the OpenAI endpoints share."""

    model: Optional[str] = Field(None, description="The served model's id (GET /v1/models).")
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    n: Optional[integer(ge=1)] = Field(None, description="Choices to generate (only 1 is supported).")
    stop: Optional[Stop] = Field(None, description="Up to 4 strings that end the answer.")
    seed: Optional[Integer] = Field(None, description="Seed of the sampler (same seed, same answer).")
    stream: Optional[bool] = Field(None, description="Answer as server-sent events (text/event-stream).")
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[mapping(float, max_length=1024)] = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit.")
    presence_penalty: Optional[Penalty] = None
    frequency_penalty: Optional[Penalty] = None
    top_k: Optional[int] = Field(None, description="Keep the k most likely tokens (0 or -1: off; vLLM's and "
                                                   "mlx-lm's extension).", **published(ge=-1))
    min_p: Optional[float] = Field(None, description="Keep tokens at least min_p times as likely as the most "
                                                     "likely (0: off).", **published(ge=0, le=1))
    repetition_penalty: Optional[float] = Field(None, description="mlx-lm's repetition penalty over the last "
                                                                  "repetition_context_size tokens (1: off).",
                                                **published(gt=0))
    repetition_context_size: Optional[int] = Field(None, description="Window of the repetition penalty in tokens "
                                                                     "(default 20).", **published(ge=0))
    speculative: Optional[Speculative] = Field(None, description="Speculative decoding (an extension): greedy "
                                                                 "answers are unchanged, several tokens per step "
                                                                 "where the answer repeats the prompt.")
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=1024, description=CACHE_SALT)
    prompt_cache_key: Optional[str] = Field(None, description=PROMPT_CACHE_KEY)
    user: Optional[str] = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions`` (OpenAI's CreateChatCompletionRequest, the fields this server reads)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16}]})

    messages: seq(ChatMessage, min_length=1)
    max_tokens: Optional[integer(ge=1)] = Field(None, description="Most tokens to generate.")
    max_completion_tokens: Optional[integer(ge=1)] = Field(None, description="Most tokens to generate "
                                                                             "(preferred over max_tokens).")
    logprobs: Optional[bool] = None
    top_logprobs: Optional[TopLogprobs] = None
    response_format: Optional[Dict[str, Any]] = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name", "schema", "strict"}}.')
    tools: Optional[seq(Dict[str, Any])] = Field(None, description='[{"type": "function", "function": '
                                                                    '{"name", "description", "parameters"}}].')
    tool_choice: Union[str, Dict[str, Any], None] = Field(None, description='"none", "auto", "required" or '
                                                                           '{"type": "function", ...}.')
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = Field(None, description="Passed to a chat template that reads it (or as "
                                                              "enable_thinking); refused for other models.")
    verbosity: Optional[Literal["low", "medium", "high"]] = Field(None, description='Only "medium" (the '
                                                                                    'default) is served.')
    metadata: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions`` (OpenAI's CreateCompletionRequest, the fields this server reads)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"prompt": "Once upon a time", "max_tokens": 16}]})

    prompt: Union[str, seq(str), seq(int), seq(seq(int))] = Field(
        description="One prompt: a string or a list of token ids (a list of one of them also).")
    max_tokens: Optional[integer(ge=1)] = Field(None, description="Most tokens to generate (default 16).")
    logprobs: Optional[integer(ge=0, le=5)] = Field(None, description="Log probabilities of the most likely "
                                                                      "tokens, per token.")
    echo: Optional[bool] = None
    best_of: Optional[Integer] = None
    suffix: Optional[str] = None


# -- request models: Anthropic, Responses, Ollama --------------------------------------------
class AnthropicBlock(_Request):
    """A content block (this server reads ``{"type": "text", "text": ...}``)."""

    type: str
    text: Optional[str] = None


class AnthropicMessage(_Request):
    role: Literal["user", "assistant"]
    content: Union[str, seq(AnthropicBlock), None] = None


class AnthropicCountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens`` (a Messages body without ``max_tokens``)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Say hi."}]}]})

    model: Optional[str] = None
    messages: seq(AnthropicMessage, min_length=1)
    system: Union[str, seq(AnthropicBlock), None] = None
    tools: Optional[seq(Dict[str, Any])] = None
    tool_choice: Union[Dict[str, Any], str, None] = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """``POST /v1/messages`` (Anthropic Messages, the fields this server reads)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"max_tokens": 16, "messages": [{"role": "user", "content": "Say hi."}]}]})

    max_tokens: integer(ge=1) = Field(description="Most tokens to generate.")
    temperature: Optional[float] = Field(None, le=1, **published(ge=0))  # Anthropic's range: above 1 refused here
    top_p: Optional[TopP] = None
    top_k: Optional[int] = Field(None, description="Keep the k most likely tokens (0: off).", **published(ge=0))
    thinking: Optional[Dict[str, Any]] = Field(None, description='Only {"type": "disabled"} is served.')
    stop_sequences: Optional[seq(str)] = None
    stream: Optional[bool] = None
    metadata: Optional[Dict[str, Any]] = None
    output_config: Optional[Dict[str, Any]] = Field(None, description='{"format": {"type": "json_schema", '
                                                                      '"schema": {...}}} (structured output).')


class ResponsesRequest(_Request):
    """``POST /v1/responses`` (OpenAI Responses, the fields this server reads)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"input": "Say hi.", "max_output_tokens": 16}]})

    model: Optional[str] = None
    input: Union[str, seq(Dict[str, Any], min_length=1)] = Field(
        description="A string or a list of messages ({role, content}).")
    instructions: Optional[str] = None
    max_output_tokens: Optional[integer(ge=1)] = None
    temperature: Optional[Temperature] = None
    top_p: Optional[TopP] = None
    top_logprobs: Optional[TopLogprobs] = None
    stream: Optional[bool] = None
    text: Optional[Dict[str, Any]] = Field(None, description='{"format": {"type": "text" | "json_object" | '
                                                             '"json_schema", ...}}.')
    tools: Optional[seq(Dict[str, Any])] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    metadata: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=1024, description=CACHE_SALT)
    prompt_cache_key: Optional[str] = Field(None, description=PROMPT_CACHE_KEY)
    user: Optional[str] = None


class OllamaMessage(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[str, seq(ContentPart), None] = None


class _Ollama(_Request):
    model: Optional[str] = Field(None, description="A served model's name (a ':latest' tag is the name).")
    stream: Optional[bool] = Field(None, description="NDJSON stream unless false (Ollama's default: true).")
    format: Union[str, Dict[str, Any], None] = Field(None, description='"json" or a JSON schema.')
    options: Optional[Dict[str, Any]] = Field(None, description="Ollama's runtime options: num_predict, "
                                              "temperature, top_p, top_k, min_p, seed, stop, repeat_penalty, "
                                              "repeat_last_n, presence_penalty, frequency_penalty (mapped); "
                                              "resource options and values that ask for nothing (mirostat 0, "
                                              "tfs_z 1, typical_p 1) accepted; others refused with a 400.")
    keep_alive: Union[str, float, None] = None


class OllamaChatRequest(_Ollama):
    """``POST /api/chat``."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Say hi."}], "stream": False}]})

    messages: seq(OllamaMessage, min_length=1)
    tools: Optional[seq(Dict[str, Any])] = None


class OllamaGenerateRequest(_Ollama):
    """``POST /api/generate``."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Why is the sky blue?", "stream": False}]})

    prompt: Optional[str] = Field(None, description="The prompt.  Absent or empty on a serve of several models: "
                                  "load the model (keep_alive 0: unload it), as Ollama does.")
    system: Optional[str] = None
    raw: Optional[bool] = Field(None, description="The prompt as it is, without the chat template.")
    suffix: Optional[str] = None
    template: Optional[str] = None
    context: Optional[seq(int)] = None


class EmbeddingsRequest(_Request):
    """``POST /v1/embeddings`` (OpenAI's CreateEmbeddingRequest)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"input": "The food was delicious."}]})

    model: Optional[str] = None
    input: Union[str, seq(str), seq(int), seq(seq(int))] = Field(
        description="A string, a list of strings, a list of token ids or a list of token id lists.")
    dimensions: Optional[integer(ge=1, le=UINT32_MAX)] = Field(
        None, description="Length of each embedding (models that allow a shorter one).")
    encoding_format: Optional[Literal["float", "base64"]] = None
    user: Optional[str] = None


class OllamaEmbedRequest(_Request):
    """``POST /api/embed``."""

    model: str
    input: Union[str, seq(str)]
    truncate: Optional[bool] = Field(None, description="Cut inputs longer than the context (default true).")
    dimensions: Optional[integer(ge=1, le=UINT32_MAX)] = None
    options: Optional[Dict[str, Any]] = None
    keep_alive: Union[str, float, None] = None


class OllamaLegacyEmbeddingRequest(_Request):
    """``POST /api/embeddings`` (Ollama's older endpoint: one ``prompt``, one ``embedding``)."""

    model: str
    prompt: str
    options: Optional[Dict[str, Any]] = None
    keep_alive: Union[str, float, None] = None


class OllamaShowRequest(_Request):
    """``POST /api/show`` (``model``, or the older ``name``)."""

    model: Optional[str] = None
    name: Optional[str] = None
    verbose: Optional[bool] = None


#: every request model, for ``components`` (:func:`install`)
REQUEST_MODELS: List[Type[BaseModel]] = [ChatCompletionRequest, CompletionRequest, AnthropicMessagesRequest,
                                         ResponsesRequest, OllamaChatRequest, OllamaGenerateRequest,
                                         OllamaShowRequest, AnthropicCountTokensRequest, EmbeddingsRequest,
                                         OllamaEmbedRequest, OllamaLegacyEmbeddingRequest]


# -- response models (documentation) ---------------------------------------------------------
class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class OpenAIErrorBody(BaseModel):
    """OpenAI's error: ``{"error": {message, type, param, code}}``."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """Anthropic's error: ``{"type": "error", "error": {type, message}}``."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class OllamaErrorBody(BaseModel):
    """Ollama's error: ``{"error": "..."}``."""

    error: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionMessage(BaseModel):
    role: str
    content: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: Optional[Dict[str, Any]] = None
    finish_reason: Optional[Literal["stop", "length", "tool_calls", "content_filter", "function_call"]] = None


class ChatCompletion(BaseModel):
    """A ``chat.completion`` object (streamed: ``chat.completion.chunk`` events, then ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: List[ChatCompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[Dict[str, Any]] = None
    finish_reason: Optional[Literal["stop", "length", "content_filter"]] = None


class Completion(BaseModel):
    """A ``text_completion`` object (streamed: ``text_completion`` events, then ``data: [DONE]``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Optional[Usage] = None


class AnthropicMessageResponse(BaseModel):
    """An Anthropic ``message`` object."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: Optional[str] = None
    content: List[Dict[str, Any]]
    stop_reason: Optional[str] = None
    stop_sequence: Optional[str] = None
    usage: Dict[str, int]


class ResponseObject(BaseModel):
    """An OpenAI Responses ``response`` object."""

    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: Optional[str] = None
    output: List[Dict[str, Any]]
    usage: Optional[Dict[str, Any]] = None


class OllamaAnswer(BaseModel):
    """The last (``done: true``) object of an Ollama answer: ``message`` (chat) or ``response`` (generate)."""

    model: Optional[str] = None
    created_at: str
    done: bool
    done_reason: Optional[str] = None
    message: Optional[Dict[str, Any]] = None
    response: Optional[str] = None
    total_duration: Optional[int] = None
    prompt_eval_count: Optional[int] = None
    prompt_eval_duration: Optional[int] = None
    eval_count: Optional[int] = None
    eval_duration: Optional[int] = None


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: Union[List[float], str] = Field(description="Floats, or base64 of little-endian float32s.")


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: List[Embedding]
    model: str
    usage: Dict[str, int]


class OllamaEmbeddings(BaseModel):
    model: str
    embeddings: List[List[float]]
    total_duration: Optional[int] = None
    load_duration: Optional[int] = None
    prompt_eval_count: Optional[int] = None


class OllamaLegacyEmbedding(BaseModel):
    embedding: List[float]


class TokenCount(BaseModel):
    input_tokens: int


class OllamaShow(BaseModel):
    modelfile: str
    details: Dict[str, Any]
    model_info: Dict[str, Any]
    capabilities: List[str]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: List[ModelCard]


class Health(BaseModel):
    """``/health``: ``status`` ``ok`` (200); ``restarting``, ``failed`` or ``unavailable`` (503)."""

    status: str
    model: Optional[str] = None
    group: Optional[Dict[str, Any]] = None
    queue: Optional[Dict[str, Any]] = None
    error: Optional[str] = None


class OllamaModels(BaseModel):
    models: List[Dict[str, Any]]


class OllamaVersion(BaseModel):
    version: str


# -- validation ---------------------------------------------------------------------------
def _num(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _phrase(err: Dict[str, Any]) -> str:
    """A pydantic error as the provider words its own: ``must be at most 2, got 3``."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    shown = repr(value) if isinstance(value, str) and len(value) <= 40 else None
    if kind == "missing":
        return "is required"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "must be an integer"
    if kind in ("float_type", "float_parsing", "finite_number"):
        return "must be a number"
    if kind in ("bool_type", "bool_parsing"):
        return "must be a boolean"
    if kind == "string_type":
        return "must be a string"
    if kind == "list_type":
        return "must be a list"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return "must be an object"
    if kind == "none_required":
        return "must be null"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}" + (f", got {shown}" if shown else "")
    if kind == "less_than_equal":
        return f"must be at most {_num(ctx.get('le'))}, got {value}"
    if kind == "less_than":
        return f"must be less than {_num(ctx.get('lt'))}, got {value}"
    if kind == "greater_than_equal":
        return f"must be at least {_num(ctx.get('ge'))}, got {value}"
    if kind == "greater_than":
        return f"must be greater than {_num(ctx.get('gt'))}, got {value}"
    if kind == "too_short":
        n = ctx.get("min_length")
        return "must not be empty" if n == 1 else f"must have at least {n} items"
    if kind == "too_long":
        return f"takes at most {ctx.get('max_length')} items"
    return str(err.get("msg", "is invalid")).splitlines()[0][:200].lower()


_TYPE_ERRORS = {"int_type", "float_type", "bool_type", "string_type", "list_type", "dict_type", "model_type",
                "model_attributes_type", "none_required"}


def _param(loc: Sequence[Any], body: Any, missing: bool) -> Tuple[str, int]:
    """``loc`` as a request field path (``messages[0].content``) and its depth: the parts that
    index the body (object keys, list positions); pydantic's union-member tags (``str``,
    ``list[str]``) are left out.  A missing field's own name is kept."""
    out, node, depth = "", body, 0
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            out, node, depth = f"{out}[{part}]", node[part], depth + 1
        elif isinstance(part, str) and isinstance(node, dict) and (
                part in node or (missing and i == len(loc) - 1)):
            out, node, depth = (f"{out}.{part}" if out else part), node.get(part), depth + 1
    return out, depth


def check(model: Type[BaseModel], body: Dict[str, Any]) -> None:
    """Validate a request ``body`` (a parsed JSON object) against its request ``model``.

    Raises:
        OpenAIError: 400 ``invalid_request_error``, ``param`` the refused field
            (``messages[0].role``), one line: ``'param' must be ...``.  Where a field may take
            several shapes (a string or a list), the error of the shape the value came closest
            to (the deepest into the value, then not a wrong type) is named; when the value has
            none of the shapes, all are ("must be a string or a list").
    """
    try:
        model.model_validate(body)
    except ValidationError as exc:
        errors = [(err, *_param(err["loc"], body, err["type"] == "missing"))
                  for err in exc.errors(include_url=False)]
        first, param, _ = min(enumerate(errors), key=lambda e: (-e[1][2], e[1][0]["type"] in _TYPE_ERRORS,
                                                                 e[0]))[1]
        same = [err for err, p, _ in errors if p == param]
        if first["type"] in _TYPE_ERRORS and all(err["type"] in _TYPE_ERRORS for err in same):
            musts = []
            for err in same:
                phrase = _phrase(err)[len("must be "):]
                if phrase not in musts:
                    musts.append(phrase)
            text = "must be " + " or ".join(musts)
        else:
            text = _phrase(first)
        where = f"'{param}'" if param else "the request body"
        raise OpenAIError(400, f"{where} {text}", "invalid_request_error", param or None) from None


# -- OpenAPI ------------------------------------------------------------------------------
_ERROR_MODELS = {OPENAI: OpenAIErrorBody, ANTHROPIC: AnthropicErrorBody, OLLAMA: OllamaErrorBody}
_REASONS = {400: "Bad request: a field refused (param names it), or the body is not a JSON object",
            401: "No or a wrong API key", 404: "Unknown model (or path)",
            413: "The request body is larger than the limit", 429: "The queue is full (Retry-After says when to "
                                                                    "retry)",
            500: "The model's group failed on this request",
            503: "The tensor-parallel group is unavailable or restarting (Retry-After)"}
#: the ``Retry-After`` header of a 429 / 503 (when the server can tell)
RETRY_AFTER = {"description": "Seconds to wait before retrying", "schema": {"type": "integer", "minimum": 1}}
#: the error statuses of a POST endpoint that generates
POST_ERRORS = (400, 401, 404, 413, 429, 500, 503)
#: ... and of a GET endpoint
GET_ERRORS = (401, 500)


def schema_ref(model: Type[BaseModel]) -> Dict[str, str]:
    """``{"$ref": "#/components/schemas/<model>"}``."""
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def route(request: Optional[Type[BaseModel]] = None, *, errors: str = OPENAI,
          ok: Optional[Type[BaseModel]] = None, ok_media: Iterable[str] = (), ok_description: str = "The answer",
          statuses: Iterable[int] = POST_ERRORS, extra: Optional[Dict[int, Dict[str, Any]]] = None,
          ) -> Dict[str, Any]:
    """Keyword arguments of a FastAPI route decorator documenting the route.

    Args:
        request: the request body's model (required JSON body), or ``None`` (no body).
        errors: the error format (:data:`OPENAI`, :data:`ANTHROPIC`, :data:`OLLAMA`).
        ok: the 200 JSON answer's model, or ``None`` (any JSON).
        ok_media: other media types of a 200 (``text/event-stream``: a string of events).
        statuses: the error statuses the route answers, each with the ``errors`` body.
        extra: more responses, as FastAPI's ``responses`` takes them.

    Returns:
        ``{"responses": ..., "openapi_extra": ...}`` (``openapi_extra`` only with ``request``;
        ``response_class`` when the 200 is only ``ok_media``: the route returns its own response).
    """
    ok_entry: Dict[str, Any] = {"description": ok_description}
    if ok is not None:
        ok_entry["model"] = ok
    if ok_media:
        ok_entry["content"] = {m: {"schema": {"type": "string"}} for m in ok_media}
    responses: Dict[Union[int, str], Dict[str, Any]] = {200: ok_entry}
    for status in statuses:
        responses[status] = {"model": _ERROR_MODELS[errors], "description": _REASONS[status]}
        if status in (429, 503):
            responses[status]["headers"] = {"Retry-After": RETRY_AFTER}
    responses.update(extra or {})
    out: Dict[str, Any] = {"responses": responses}
    if ok is None and ok_media:  # not JSON: FastAPI's default JSON 200 would be documented too
        out["response_class"] = Response
    if request is not None:
        out["openapi_extra"] = {"requestBody": {"required": True, "content": {
            "application/json": {"schema": schema_ref(request)}}}}
    return out


def _components(models: Sequence[Type[BaseModel]]) -> Dict[str, Any]:
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    return defs.get("$defs", {})


#: how an API key is sent (``serve --api-key``): ``Authorization: Bearer KEY`` or ``x-api-key: KEY``
SECURITY_SCHEMES = {"bearer": {"type": "http", "scheme": "bearer", "description": "Authorization: Bearer KEY"},
                    "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}


def install(app, models: Sequence[Type[BaseModel]] = (), *, secured: bool = False,
            open_paths: Iterable[str] = ()) -> None:
    """Publish the request models in ``app``'s OpenAPI document: their schemas join
    ``components.schemas`` (:data:`REQUEST_MODELS` and ``models``, which may be added by later
    calls), and the 422 answers FastAPI documents for route parameters are dropped (never
    answered here).  ``secured`` (the app needs an API key): :data:`SECURITY_SCHEMES` are
    published and required by every operation but those of ``open_paths`` (which also lose their
    documented 401).  Idempotent; a later call never unsets ``secured``."""
    state = getattr(app.state, "request_models", None)
    if state is None:
        state = app.state.request_models = {"models": list(REQUEST_MODELS), "secured": False, "open": set()}
        original = app.openapi

        def openapi() -> Dict[str, Any]:
            if app.openapi_schema:
                return app.openapi_schema
            doc = original()
            components = doc.setdefault("components", {})
            components.setdefault("schemas", {}).update(_components(state["models"]))
            for path, item in doc.get("paths", {}).items():
                for op in item.values():
                    if not isinstance(op, dict):
                        continue
                    op.get("responses", {}).pop("422", None)
                    if state["secured"] and path in state["open"]:
                        op["security"] = []
                        op.get("responses", {}).pop("401", None)
            for name in ("HTTPValidationError", "ValidationError"):
                if not any(name in str(op) for item in doc.get("paths", {}).values() for op in item.values()):
                    components["schemas"].pop(name, None)
            if state["secured"]:
                components["securitySchemes"] = dict(SECURITY_SCHEMES)
                doc["security"] = [{name: []} for name in SECURITY_SCHEMES]
            return doc

        app.openapi = openapi
    state["models"].extend(m for m in models if m not in state["models"])
    if secured:
        state["secured"] = True
        state["open"].update(open_paths)
