"""The numbers a notebook demonstrates (notebooks/), shown with how closely a new run must repeat
them.

`claim("loss {first:.3f} -> {last:.3f}", rtol=1e-3, first=..., last=...)` shows the line
`loss 5.546 -> 2.345` as the cell's output, and keeps the exact values, the template and the
tolerance in that output's metadata (invisible to a reader). tests/cli/test_notebooks.py re-executes
each notebook and reports every stored value that the fresh run no longer gives within the
tolerance the notebook's code states now, and every shown line that is not what its stored values
give (a number edited by hand).

rtol, atol: numbers agree when |fresh - stored| <= atol + rtol * |stored|; by default exactly.
Strings, booleans, lists and dicts compare element by element. `timing` names the values that
depend on the machine's speed or load (tokens/s, bandwidth, when a kill lands): shown and kept,
never compared.
"""
METADATA_KEY = "trainspec_claim"


def claim(template: str, *, rtol: float = 0.0, atol: float = 0.0, timing: tuple[str, ...] = (),
          **values) -> None:
    """Show `template.format(**values)` and record the values with their tolerance."""
    from IPython.display import display  # a notebook's kernel has IPython; the package needs none
    if unknown := set(timing) - values.keys():
        raise ValueError(f"claim: timing names no value of the line: {sorted(unknown)}")
    record = {"template": template, "values": {k: plain(v) for k, v in values.items()},
              "rtol": rtol, "atol": atol, "timing": list(timing)}
    display({"text/plain": render(record)}, raw=True, metadata={METADATA_KEY: record})


def render(record: dict) -> str:
    """The line a claim shows, from its record."""
    return record["template"].format(**record["values"])


def plain(value):
    """`value` as the stored notebook keeps it (JSON, objects in key order), so that the line
    shown now is the line its stored values give; numpy scalars and arrays, tuples and sets
    included."""
    if hasattr(value, "tolist"):          # numpy and jax scalars and arrays
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in sorted((str(k), v) for k, v in value.items())}
    if isinstance(value, (set, frozenset)):
        return sorted(plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
