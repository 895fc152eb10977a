"""Tool calling's request side: OpenAI's `tools` and `tool_choice`, what the chat template sees of them, and
the structured output that `required` and a named function turn into (the model must call a tool, so its
output is constrained to the tools' argument schemas)."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .. import limits
from ..sampling.grammar import StructuredOutput
from ..sampling.sampling_params import InvalidRequestError
from .json_values import Name, Text, bounded_json

FunctionName = Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]  # OpenAI's rule
Parameters = Annotated[dict[str, Any], AfterValidator(bounded_json)]


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Fields):
    name: FunctionName
    description: Text | None = None
    parameters: Parameters | None = None
    strict: bool | None = None


class Tool(_Fields):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Fields):
    name: FunctionName


class NamedToolChoice(_Fields):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Fields):
    name: FunctionName
    arguments: Annotated[Text, Field(max_length=limits.MAX_GRAMMAR_CHARS)]


class ToolCall(_Fields):
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


def parameters_schema(tool: Tool) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def template_tools(tools: list[Tool] | None) -> list[dict] | None:
    """The tools as chat templates expect them (transformers' shape: OpenAI's tool dicts)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def parse_arguments(text: str, field: str) -> Any:
    """An earlier call's arguments (JSON text) as the template renders them: valid JSON, nested no deeper than
    bounded_json allows (Python's decoder would otherwise recurse until it fails)."""
    try:
        return bounded_json(json.loads(text))
    except json.JSONDecodeError as e:
        raise InvalidRequestError(f"{field}: not valid JSON", field) from e
    except (RecursionError, ValueError) as e:
        why = str(e) if isinstance(e, ValueError) else "nests too deep"
        raise InvalidRequestError(f"{field}: {why}", field) from e


def template_tool_calls(calls: list[ToolCall]) -> list[dict]:
    """An assistant message's tool calls for the template: arguments as objects, as templates render them."""
    out = []
    for i, call in enumerate(calls):
        arguments = parse_arguments(call.function.arguments, f"tool_calls[{i}].function.arguments")
        out.append(
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}
        )
    return out


def forced_tool_output(
    tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool
) -> tuple[StructuredOutput | None, str | None]:
    """For `required` and a named function: the structured output the model must follow, and the named
    function (whose output is its arguments). `auto` and `none` constrain nothing."""
    if choice is None or choice in ("auto", "none"):
        return None, None
    if not tools:
        raise InvalidRequestError("tool_choice: needs `tools`", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        named = {t.function.name: t for t in tools}
        tool = named.get(choice.function.name)
        if tool is None:
            raise InvalidRequestError(
                f"tool_choice.function.name: no tool named {choice.function.name!r} in `tools`",
                "tool_choice.function.name",
            )
        return StructuredOutput("json", parameters_schema(tool), "tools"), tool.function.name
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "parameters": parameters_schema(t)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
    schema = {
        "type": "array",
        "items": calls,
        "minItems": 1,
        "maxItems": limits.MAX_PARALLEL_TOOL_CALLS if parallel else 1,
    }
    return StructuredOutput("json", schema, "tools"), None
