"""`python -m spec_jax.metrics.schema > docs/metrics.schema.json`: the record format's schema."""
import sys

from spec_jax.metrics.records import schema_text

if __name__ == "__main__":
    sys.stdout.write(schema_text())
