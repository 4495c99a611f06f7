"""Anthropic's Messages API wire protocol: request and response models.

Content blocks are parsed loosely (any ``type``), so the route can refuse a
non-text block with a message naming it rather than a union's error list.
A request's own fields are all named here, as the field table of docs/serving.md
lists them: an unknown one is a 400 naming it, as on Anthropic's API.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from semantic.serve.cachesave import CacheSaveUsage
from pydantic import BaseModel, ConfigDict, Field, model_validator


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentBlock(_In):
    type: str
    text: str | None = None  # cache_control and other fields are accepted and ignored
    id: str | None = None                     # tool_use
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None            # tool_result
    content: Union[str, list["ContentBlock"], None] = None
    is_error: bool = False
    tool_name: str | None = None              # tool_reference (a tool search's result: that tool is loaded)


class Message(_In):
    role: str
    content: Union[str, list[ContentBlock]]


class Metadata(_In):
    user_id: str | None = None


class Thinking(_In):
    """Extended thinking. A model that cannot think answers without it (docs/serving.md says so)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1024)
    display: str | None = None   # summarized, omitted, updates (Claude Code's verbose mode): no thinking to show

    @model_validator(mode="after")
    def _budget_when_enabled(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking of type 'enabled' needs budget_tokens (at least 1024)")
        return self


class ContextEdit(_In):
    type: str
    keep: Any = None


class ContextManagement(_In):
    edits: list[ContextEdit] = []


class OutputConfig(_In):
    effort: Literal["low", "medium", "high", "max"] | None = None   # steers thinking: nothing to steer here
    format: dict | None = None                                      # {"type": "json_schema", "schema": {...}}


class CountTokensRequest(_Body):
    model: str
    messages: list[Message]
    system: Union[str, list[ContentBlock], None] = None
    tools: list | None = None
    tool_choice: dict | None = None
    thinking: Thinking | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None
    output_format: dict | None = None     # the structured-outputs beta's name for output_config.format
    mcp_servers: list | None = None       # refused: this server connects to no MCP server
    container: Any = None                 # refused: no code-execution container here
    cache_control: dict | None = None     # advisory: every prefix is cached anyway
    service_tier: str | None = None       # advisory: one tier here


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _thinking_within_budget(self):
        if self.thinking is not None and self.thinking.type == "enabled" and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


# ---- responses -------------------------------------------------------------


class Usage(CacheSaveUsage):
    input_tokens: int                 # prompt tokens not read from a cache
    output_tokens: int
    cache_read_input_tokens: int      # prompt tokens read from a cache
    cache_creation_input_tokens: int = 0


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str            # this server's digest of the text (Anthropic's is opaque too; clients send it back)


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


class MessageOut(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Union[ThinkingBlock, TextBlock, ToolUseBlock]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokens(BaseModel):
    input_tokens: int
