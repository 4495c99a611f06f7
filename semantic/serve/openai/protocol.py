"""OpenAI's wire protocol: request and response models for chat and text completions.

A request's own fields are all named here, as the field table of docs/serving.md lists
them: an unknown one is a 400 naming it, as on OpenAI's API. Those that
change nothing here (``store``, ``metadata``, ...) are accepted as advisory;
those that would change the output and that this server cannot honour are
named in ``REFUSED`` and refused by the routes with a 400 that names them.
"""

from __future__ import annotations

from typing import Literal, Union

from semantic.serve.cachesave import CacheSaveUsage
from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(_In):
    type: str
    text: str | None = None


class ChatMessage(_In):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None   # an assistant's calls: {"id", "type": "function", "function": {...}}
    tool_call_id: str | None = None        # a tool message: the call it answers


class StreamOptions(_In):
    include_usage: bool = False


class _Sampling(_Body):
    """The fields both endpoints share (sampling ranges checked by SamplingParams)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    cache_salt: str | None = None
    # advisory: accepted, and they change nothing here
    store: bool | None = None                 # every named agent's cache is stored anyway
    metadata: dict | None = None
    service_tier: str | None = None           # one tier here
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None  # caches live until the disk budget evicts them


# fields that would change the output, which this server does not implement: refused, never ignored
REFUSED = ("logit_bias", "functions", "function_call", "audio", "prediction", "web_search_options")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    logit_bias: dict | None = None
    functions: list | None = None
    function_call: Union[str, dict, None] = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None       # advisory for a model that does not reason (docs/serving.md says so)
    verbosity: str | None = None              # refused unless "medium": nothing here steers a reply's length


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logit_bias: dict | None = None


# ---- responses -------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(CacheSaveUsage):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: list[TokenLogprobOut] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str           # the arguments as JSON text, as OpenAI sends them


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _CallsWhenAny(BaseModel):
    """``tool_calls`` appears only when there are calls, as in OpenAI's own answers, and a thinking
    model's reasoning only when there is some: ``reasoning_content`` (llama.cpp's, vLLM's name) and
    ``reasoning`` (mlx_lm.server's), the same text."""

    @model_serializer(mode="wrap")
    def _drop_empty_calls(self, handler):
        out = handler(self)
        for name in ("tool_calls", "reasoning_content"):
            if out.get(name) is None:
                out.pop(name, None)
        if out.get("reasoning_content") is not None:
            out["reasoning"] = out["reasoning_content"]
        return out


class AssistantMessage(_CallsWhenAny):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChunkDelta(_CallsWhenAny):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "semantic"
    cache_kinds: list[str] | None = None  # the model's layer kinds: global, sliding, recurrent (once loaded)
    speculation: bool | None = None       # whether greedy turns may draft (/v1/cache/stats says why not)
    # the server's own: loaded, loading, unloaded, unloading or failed (with its error); the names that
    # reach it; the context a request can use (its config's until it loads, then no more than the pool
    # holds); weights + pool bytes (estimated until it loads)
    state: str | None = None
    aliases: list[str] | None = None
    context_length: int | None = None
    memory_bytes: int | None = None
    pinned: bool | None = None
    idle_ttl_s: float | None = None
    error: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
