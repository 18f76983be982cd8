"""The request fields that ask for constrained decoding, and their `StructuredOutputsParams`.

OpenAI's `response_format` ({"type": "json_object"}, or {"type": "json_schema", "json_schema":
{"name": ..., "schema": {...}}}), vLLM's `structured_outputs` ({"json": ...}, {"regex": ...},
{"choice": [...]}, {"json_object": true}) and its older `guided_json`, `guided_regex` and
`guided_choice` and `guided_grammar` (Lark or GBNF), and structural tags (response_format
{"type": "structural_tag", "structures": [...], "triggers": [...]}, or structured_outputs'
`structural_tag`). A request gives one of them; two at once is a ValueError, which the server
answers with a 400. Whether a schema, regex or grammar can be compiled is the engine's check
(actors/grammars.py), before the request is scheduled.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pagedserve.actors.messages import StructuredOutputsParams


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None
    structures: list[Any] | None = None  # type "structural_tag"
    triggers: list[Any] | None = None


class StructuredOutputsField(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs` request field."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None


class StructuredOutputFields(msgspec.Struct, kw_only=True):
    """The fields, mixed into both endpoints' request bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output_params(self) -> StructuredOutputsParams | None:
        """The constraint the request asks for (None: none)."""
        given = [
            *response_format_params(self.response_format),
            *structured_outputs_params(self.structured_outputs),
            *guided_params(
                self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar
            ),
        ]
        if len(given) > 1:
            raise ValueError(
                "give one of response_format, structured_outputs, guided_json, guided_regex, "
                "guided_choice and guided_grammar"
            )
        return given[0] if given else None


def schema_text(schema: Any) -> str:
    """A JSON schema as JSON text: given as an object, or as text (checked to be JSON)."""
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError:
            raise ValueError("the JSON schema is not valid JSON") from None
        return schema
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object")
    return json.dumps(schema)


def response_format_params(value: ResponseFormat | None) -> list[StructuredOutputsParams]:
    if value is None or value.type == "text":
        return []
    if value.type == "json_object":
        return [StructuredOutputsParams(json_object=True)]
    if value.type == "structural_tag":
        tag = {"structures": value.structures or [], "triggers": value.triggers or []}
        return [StructuredOutputsParams(structural_tag=tag)]
    if value.type != "json_schema":
        raise ValueError(f"response_format {value.type!r} is not supported")
    if value.json_schema is None or value.json_schema.schema is None:
        raise ValueError("response_format json_schema needs json_schema.schema")
    return [StructuredOutputsParams(json=schema_text(value.json_schema.schema))]


def structured_outputs_params(
    value: StructuredOutputsField | None,
) -> list[StructuredOutputsParams]:
    if value is None:
        return []
    json_text = None if value.json is None else schema_text(value.json)
    return [
        StructuredOutputsParams(
            json=json_text, regex=value.regex, choice=value.choice,
            json_object=bool(value.json_object), grammar=value.grammar,
            structural_tag=value.structural_tag,
        )
    ]  # fmt: skip


def guided_params(
    guided_json: Any,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    guided_grammar: str | None,
) -> list[StructuredOutputsParams]:
    given = []
    if guided_json is not None:
        given.append(StructuredOutputsParams(json=schema_text(guided_json)))
    if guided_regex is not None:
        given.append(StructuredOutputsParams(regex=guided_regex))
    if guided_choice is not None:
        given.append(StructuredOutputsParams(choice=guided_choice))
    if guided_grammar is not None:
        given.append(StructuredOutputsParams(grammar=guided_grammar))
    return given
