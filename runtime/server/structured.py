"""The request fields that ask for structured outputs, OpenAI's and vLLM's, mapped onto one StructuredOutput:
`response_format` (json_object, json_schema), vLLM's `structured_outputs` (json, regex, choice, grammar,
json_object) and its older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from .. import limits
from ..sampling.grammar import Kind, StructuredOutput
from ..sampling.sampling_params import InvalidRequestError
from .json_values import Name, Text, bounded_json

GrammarText = Annotated[Text, Field(min_length=1, max_length=limits.MAX_GRAMMAR_CHARS)]
Schema = Annotated[dict[str, Any] | Text, AfterValidator(bounded_json)]
Choices = Annotated[
    list[Annotated[Text, Field(max_length=limits.MAX_STOP_STRING_CHARS)]],
    Field(min_length=1, max_length=limits.MAX_CHOICES),
]


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JSONSchemaFormat(_Fields):
    name: Name | None = None
    description: Text | None = None
    json_schema: Schema | None = Field(default=None, alias="schema")
    strict: bool | None = None  # outputs always follow the schema here, strict or not


class ResponseFormat(_Fields):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(_Fields):
    json_schema: Schema | None = Field(default=None, alias="json")
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None


class StructuredFields(_Fields):
    """Mixed into the completion and chat requests."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Schema | None = None
    guided_regex: GrammarText | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the request asks for (two or more: a 400 naming them)."""
        found: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(StructuredOutput("json_object", param="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise InvalidRequestError(
                    "response_format.json_schema: a `schema` is required for type json_schema",
                    "response_format.json_schema",
                )
            found.append(StructuredOutput("json", rf.json_schema.json_schema, "response_format.json_schema.schema"))
        so = self.structured_outputs
        if so is not None:
            named: tuple[tuple[Kind, Any, str], ...] = (
                ("json", so.json_schema, "json"),
                ("regex", so.regex, "regex"),
                ("choice", so.choice, "choice"),
                ("grammar", so.grammar, "grammar"),
            )
            for kind, value, name in named:
                if value is not None:
                    found.append(StructuredOutput(kind, value, f"structured_outputs.{name}"))
            if so.json_object:
                found.append(StructuredOutput("json_object", param="structured_outputs.json_object"))
        guided: tuple[tuple[Kind, Any, str], ...] = (
            ("json", self.guided_json, "guided_json"),
            ("regex", self.guided_regex, "guided_regex"),
            ("choice", self.guided_choice, "guided_choice"),
            ("grammar", self.guided_grammar, "guided_grammar"),
        )
        for kind, value, name in guided:
            if value is not None:
                found.append(StructuredOutput(kind, value, name))
        if len(found) > 1:
            names = ", ".join(c.param for c in found)
            raise InvalidRequestError(
                f"{found[1].param}: only one structured output per request, got {names}", found[1].param
            )
        return found[0] if found else None
