"""Tool-call parsers for `tool_choice: auto`, one per model family's format, chosen like vLLM's
`--tool-call-parser`: `hermes` (Hermes, Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks
after optional text) and `llama3_json` (Llama 3.x: the whole answer is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several separated by `;`). Text that is not a well-formed call stays content."""

from __future__ import annotations

import dataclasses
import json
import re


@dataclasses.dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends function.arguments


def _call(obj, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments: object = next((obj[k] for k in argument_keys if k in obj), {})
    if not isinstance(arguments, (dict, str)):
        return None
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(obj["name"], text)


class HermesParser:
    name = "hermes"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    opening = "<tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call(json.loads(body), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # a malformed block: the whole answer is content, as the model wrote it
            calls.append(call)
        if not calls:
            return text, []
        content = text[: text.index(self.opening)].strip()
        return content or None, calls

    def may_call(self, text: str) -> bool:
        """Whether `text` holds, or ends with the start of, a call opening (a stream holds it back)."""
        return self.opening in text or any(text.endswith(self.opening[:k]) for k in range(1, len(self.opening)))


class Llama3JSONParser:
    name = "llama3_json"
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self._tag):
            body = body[len(self._tag) :].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return None, calls

    def may_call(self, text: str) -> bool:
        stripped = text.lstrip()
        return (
            not stripped
            or stripped.startswith("{")
            or self._tag.startswith(stripped[: len(self._tag)])
            or stripped.startswith(self._tag)
        )


PARSERS = {p.name: p for p in (HermesParser, Llama3JSONParser)}


def parser_for(name: str | None, tokenizer) -> HermesParser | Llama3JSONParser:
    """The named parser; with none named, the one whose markers the served tokenizer has (Hermes otherwise)."""
    if name is not None:
        return PARSERS[name]()
    if tokenizer.token_to_id("<|python_tag|>") is not None and tokenizer.token_to_id("<tool_call>") is None:
        return Llama3JSONParser()
    return HermesParser()
