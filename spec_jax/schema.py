"""`python -m spec_jax.schema`: print the spec's JSON Schema (committed as docs/spec.schema.json)."""
from spec_jax.spec import schema_text

if __name__ == "__main__":
    print(schema_text(), end="")
