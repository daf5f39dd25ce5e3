"""Metric records written by hand for tests of the commands that read them (report, advise):
every required field of the schema present, with a value of its first schema type, so that
`read_jsonl` reads them back as it reads a writer's; a test sets the fields it is about."""
from trainspec.core import records

_VALUE_OF_TYPE = {"number": 0.0, "integer": 1, "string": "", "object": {}, "array": [],
                  "boolean": False, "null": None}


def _value(field: dict):
    types = field.get("type", "null")
    return _VALUE_OF_TYPE[types if isinstance(types, str) else types[0]]


def record(step: int, **fields) -> dict:
    """A record of `step` that the schema accepts, with `fields` set."""
    return {**{name: _value(f) for name, f in records.FIELDS.items()},
            "schema": records.SCHEMA_ID, "step": step, **fields}
