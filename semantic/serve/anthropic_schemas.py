"""Anthropic's Messages API wire protocol: request and response models.

Content blocks are parsed loosely (any ``type``), so the route can refuse a
non-text block with a message naming it rather than a union's error list.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ContentBlock(_In):
    type: str
    text: str | None = None  # cache_control and other fields are accepted and ignored
    id: str | None = None                     # tool_use
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None            # tool_result
    content: Union[str, list["ContentBlock"], None] = None
    is_error: bool = False


class Message(_In):
    role: str
    content: Union[str, list[ContentBlock]]


class Metadata(_In):
    user_id: str | None = None


class CountTokensRequest(_In):
    model: str
    messages: list[Message]
    system: Union[str, list[ContentBlock], None] = None
    tools: list | None = None
    tool_choice: dict | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None


# ---- responses -------------------------------------------------------------


class Usage(BaseModel):
    input_tokens: int                 # prompt tokens not read from a cache
    output_tokens: int
    cache_read_input_tokens: int      # prompt tokens read from a cache
    cache_creation_input_tokens: int = 0


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


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
    content: list[Union[TextBlock, ToolUseBlock]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokens(BaseModel):
    input_tokens: int
