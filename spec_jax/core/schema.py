"""`python -m spec_jax.core.schema [spec|metrics]`: print a JSON Schema of the spec.

`spec` (the default) is the spec file's schema, generated from spec_jax/core/spec.py and
committed as docs/spec.schema.json; `metrics` is the metrics record's, the file the package
ships (spec_jax/core/metrics.schema.json).
"""
import sys

from spec_jax.core import records, spec

SCHEMAS = {"spec": spec.schema_text, "metrics": records.schema_text}

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "spec"
    if which not in SCHEMAS:
        sys.exit(f"usage: python -m spec_jax.core.schema [{'|'.join(SCHEMAS)}]")
    sys.stdout.write(SCHEMAS[which]())
