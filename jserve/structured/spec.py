"""The grammar a request's output must follow, as the front ends describe it.

Every kind the OpenAI API offers reduces to a JSON schema: `json_object` is any object, a
named tool's call is its parameters, `tool_choice: "required"` a non-empty list of calls
of any of the tools. The spec keeps the schema as canonical JSON text, so equal requests
make equal (hashable) specs and share one compiled grammar. Keys keep their order: the
grammar writes an object's properties in the order its schema lists them."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# What a function without `parameters` takes: nothing (OpenAI's meaning).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class GrammarKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # response_format json_schema: the text follows the schema
    JSON_OBJECT = "json_object"  # response_format json_object: any JSON object
    TOOL = "tool"  # tool_choice naming a function: the text is its arguments
    TOOLS = "tools"  # tool_choice "required": a list of {"name", "arguments"} calls


@dataclass(frozen=True)
class ToolDef:
    """One function of a request's `tools`: its name and its parameters' schema."""

    name: str
    parameters: str  # canonical JSON of the parameters' schema

    @classmethod
    def of(cls, name: str, parameters: dict[str, Any] | None) -> ToolDef:
        return cls(name, canonical(NO_PARAMETERS if parameters is None else parameters))


@dataclass(frozen=True)
class ToolCall:
    """One call the output makes: the function's name and its arguments as JSON text
    (what OpenAI's `tool_calls[].function` holds)."""

    name: str
    arguments: str


def canonical(schema: dict[str, Any]) -> str:
    return json.dumps(schema, separators=(",", ":"))


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    schema: str  # canonical JSON of the schema the output follows
    function: str | None = None  # TOOL: the function called

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GrammarSpec:
        return cls(GrammarKind.JSON_SCHEMA, canonical(schema))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls(GrammarKind.JSON_OBJECT, canonical({"type": "object"}))

    @classmethod
    def tool(cls, tool: ToolDef) -> GrammarSpec:
        return cls(GrammarKind.TOOL, tool.parameters, tool.name)

    @classmethod
    def any_tools(cls, tools: Sequence[ToolDef]) -> GrammarSpec:
        """`tool_choice: "required"`: one call or more, each of any of `tools`."""
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": t.name}, "arguments": json.loads(t.parameters)}}
                 for t in tools]
        return cls(GrammarKind.TOOLS, canonical({"type": "array", "minItems": 1,
                                                 "items": {"anyOf": calls}}))

    @property
    def calls_tools(self) -> bool:
        return self.kind in (GrammarKind.TOOL, GrammarKind.TOOLS)

    def tool_calls(self, text: str) -> list[ToolCall] | None:
        """The calls an output makes, or None where it is no complete call (cut short by
        `max_tokens` or a stop string): the text is then the answer's content."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.kind is GrammarKind.TOOL:
            return [ToolCall(self.function or "", json.dumps(value))]
        if self.kind is GrammarKind.TOOLS:
            return [ToolCall(c["name"], json.dumps(c["arguments"])) for c in value]
        return None
