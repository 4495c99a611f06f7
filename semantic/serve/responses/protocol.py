"""OpenAI's Responses API wire protocol: the request model (every field named) and the output's pieces.

The response object is built as plain dicts (``responses.router``): the openai
SDK parses it into its own models, and the stored copy is the same JSON.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field


class _In(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextConfig(_In):
    format: dict | None = None       # {"type": "text" | "json_object" | "json_schema", "schema": ...}
    verbosity: str | None = None


class ReasoningConfig(_In):
    effort: str | None = None        # advisory: nothing here spends more or less on reasoning
    summary: str | None = None       # advisory: the reasoning comes back whole, not summarized


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: Union[str, list[dict]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    # advisory: accepted, and they change nothing here (the field table of docs/serving.md)
    metadata: dict | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_retention: str | None = None
    truncation: str | None = None    # "disabled" (the default) or "auto": a prompt over the context is a 400 either way
    include: list[str] | None = None
    stream_options: dict | None = None
    client_metadata: dict | None = None  # Codex's session and turn ids
    # refused when set: this server cannot honour them
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
