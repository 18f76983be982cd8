"""Tool calling, as vLLM answers it. A named `tool_choice` ({"type": "function", "function":
{"name": ...}}) constrains the reply to that function's arguments (its `parameters` JSON
schema), "required" to a JSON array of one or more calls [{"name": ..., "parameters": {...}}];
the answer carries them as `tool_calls`. "auto" (the default when tools are given) leaves the
reply free and needs a parser for the model's own call syntax (tool_parsers.py, `serve
--enable-auto-tool-choice --tool-call-parser`; without them it is a 400). With any choice,
"none" included, the tools reach the chat template (PromptOptions.tools)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from pagedserve.actors.messages import StructuredOutputsParams


class FunctionDefinition(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDefinition


@dataclass(frozen=True)
class ToolPlan:
    """How the reply is constrained, and how it becomes tool calls."""

    named: str | None  # the one function of a named choice; None: "required"
    constraint: StructuredOutputsParams

    def calls(self, text: str) -> list[dict] | None:
        """OpenAI's `tool_calls` from the reply's text; None when the text is no complete
        call (the reply hit max_tokens first)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.named is not None:
            return [tool_call(self.named, text)] if isinstance(value, dict) else None
        if not isinstance(value, list):
            return None
        return [tool_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                for c in value]  # fmt: skip

    @property
    def finish_reason(self) -> str | None:
        """The finish of a reply that is complete calls: vLLM's "tool_calls" for "required";
        a named choice keeps the engine's ("stop"), as OpenAI answers a forced function."""
        return None if self.named is not None else "tool_calls"


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def plan_tools(tools: list[Tool] | None, tool_choice: Any) -> ToolPlan | None:
    """The plan of a request's tools and tool_choice (None: no constraint: content, or with
    "auto" calls a tool-call parser finds in it); ValueError (a 400) for what cannot be
    answered."""
    if tool_choice is None and tools:
        tool_choice = "auto"  # OpenAI's default when tools are given
    if tool_choice in (None, "none", "auto"):  # "auto": free text, for a tool-call parser
        return None
    if not tools:
        raise ValueError("tool_choice needs tools")
    for tool in tools:
        if tool.type != "function":
            raise ValueError(f"tools of type {tool.type!r} are not supported")
    by_name = {tool.function.name: tool.function for tool in tools}
    if tool_choice == "required":
        calls = [call_schema(name, function) for name, function in by_name.items()]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return ToolPlan(None, StructuredOutputsParams(json=json.dumps(schema)))
    name = named_choice(tool_choice)
    if name not in by_name:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    return ToolPlan(name, StructuredOutputsParams(json=json.dumps(arguments_schema(by_name[name]))))


def named_choice(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (
        isinstance(tool_choice, dict)
        and tool_choice.get("type") == "function"
        and isinstance(function, dict)
        and isinstance(function.get("name"), str)
    ):
        raise ValueError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    return function["name"]


def arguments_schema(function: FunctionDefinition) -> dict:
    """The JSON schema of a function's arguments (any object when it declares none)."""
    return function.parameters if function.parameters is not None else {"type": "object"}


def call_schema(name: str, function: FunctionDefinition) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"enum": [name]}, "parameters": arguments_schema(function)},
        "required": ["name", "parameters"],
        "additionalProperties": False,  # a call is its name and arguments only
    }
