"""tool_choice "none" on a model with no native tool format: the prompt stays the same, and no call is written."""

from __future__ import annotations

import pytest

from semantic.decode.constraint import Constraint
from semantic.chat.toolformat import GENERIC, ToolFormat, Tools, generic_messages, reading
from tests.tiny_models import byte_tokenizer

pytestmark = pytest.mark.compat

SPECS = ({"type": "function", "function": {"name": "lookup", "description": "Look it up.",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}},)
MESSAGES = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Find the wind."},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"q": "wind"}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "NW 12 knots"}]


def test_the_tools_note_stays_in_the_system_turn_whatever_the_choice():
    # an agent's last turn (choice "none", for its answer) must not rewrite the system turn its cache starts with
    rendered = {choice: generic_messages(MESSAGES, Tools(SPECS, choice)) for choice in ("auto", "required", "none")}
    assert rendered["none"] == rendered["auto"] == rendered["required"]
    assert "lookup" in rendered["none"][0]["content"]


def test_choice_none_answers_and_cannot_open_a_call():
    p = reading(Tools(SPECS, "none"), ToolFormat(GENERIC), None)
    assert not p.reads_calls and p.grammar is not None
    allowed = Constraint(p.grammar, byte_tokenizer(), 256).allowed()
    assert not allowed[ord("{")] and not allowed[ord(" ")] and allowed[ord("T")]
