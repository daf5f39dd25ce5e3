"""`python -m trainspec.core.schema [spec|metrics]`: print a JSON Schema of the spec.

`spec` (the default) is the spec file's schema, generated from trainspec/core/spec.py and
committed as docs/spec.schema.json; `metrics` is the metrics record's, the file the package
ships (trainspec/core/metrics.schema.json).
"""
import sys

from trainspec.core import records, spec

SCHEMAS = {"spec": spec.schema_text, "metrics": records.schema_text}

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "spec"
    if which not in SCHEMAS:
        sys.exit(f"usage: python -m trainspec.core.schema [{'|'.join(SCHEMAS)}]")
    sys.stdout.write(SCHEMAS[which]())
