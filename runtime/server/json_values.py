"""Checks on text and free-form JSON from request bodies: valid Unicode, bounded nesting.

JSON may carry lone UTF-16 surrogates ("\\ud800"), which Python decodes into strings that no encoder accepts:
refused here, before a tokenizer, a template, a log line or an error body meets them."""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from ..limits import MAX_JSON_DEPTH, MAX_NAME_CHARS


def valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"contains a lone surrogate (U+{ord(text[e.start]):04X}) at character {e.start}, which is not valid Unicode"
        ) from None
    return text


def bounded_json(value: Any) -> Any:
    """A JSON value nested at most MAX_JSON_DEPTH deep, whose strings (keys too) are valid Unicode."""
    stack = [(value, 1)]  # iterative: a deep value must not exhaust Python's recursion limit
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            valid_unicode(item)
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    valid_unicode(key)
                    stack.append((child, depth + 1))
            else:
                stack.extend((child, depth + 1) for child in item)
        elif isinstance(item, float) and not math.isfinite(item):
            raise ValueError("numbers must be finite (NaN and Infinity are not JSON)")
    return value


# Text that reaches the tokenizer, a template or a log line: valid Unicode only (a JSON "\ud800" is not).
Text = Annotated[str, AfterValidator(valid_unicode)]
Name = Annotated[Text, Field(max_length=MAX_NAME_CHARS)]  # model, user, name, ids: identifiers, not text
