"""Seeded random JSON schemas for constrained decoding's tests and benchmark."""

from __future__ import annotations

import random


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema of nested objects, enums, arrays and numbers, every property required
    and no others, every value of bounded length (the tiny model writes digits forever where
    a grammar lets it)."""
    kinds = ["integer", "number", "enum", "string", "boolean", "array"]
    kinds += ["object"] if depth < 2 else []
    properties = {}
    for index in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        if kind == "integer":
            low = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
        elif kind == "number":
            step = rng.choice([0.5, 0.25, 0.01])  # a bound on the digits after the point
            prop = {"type": "number", "minimum": -10, "maximum": 1000, "multipleOf": step}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", "thou", "art", 7, None], 3)}
        elif kind == "string":
            prop = {"type": "string", "maxLength": rng.randint(1, 12)}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "array":
            items = rng.choice([{"type": "boolean"}, {"enum": ["a", "b", "c"]}])
            prop = {"type": "array", "items": items, "minItems": 1, "maxItems": rng.randint(1, 3)}
        else:
            prop = random_schema(rng, depth + 1)
        properties[f"{kind}_{index}"] = prop
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
