"""What the structured-output tests share: a JSON schema of a movie, which the bundled model
answers under (tests/layers/test_structured_output*.py)."""
from __future__ import annotations

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "genre": {"enum": ["drama", "comedy", "horror", "documentary"]},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "studio": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
                   "required": ["name"], "additionalProperties": False},
    },
    "required": ["title", "genre", "year", "rating", "cast", "studio"],
    "additionalProperties": False,
}
