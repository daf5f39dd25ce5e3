"""The capability table: for every field of the spec, what an implementation does with it.

Each implementation declares a `Capabilities` table (trainspec/jax/capabilities.py,
trainspec/torch/capabilities.py, or a third implementation's own): per field path
('batch.micro_batch', 'mesh.axes.*.size', and the flags of `trainspec train`, '--restart'), how
it honours the field and which values it refuses, each refusal one line naming the field.
Nothing is silently ignored: a schema field without an entry is found by `undeclared` (the
conformance suite fails naming it), and an implementation refuses a request through `check`
before anything starts. `markdown` renders the tables side by side (docs/adapters.md).
"""
from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Mapping

import pydantic

from trainspec.core.errors import UserInputError
from trainspec.core.mesh import ParallelDims
from trainspec.core.spec import Spec


@dataclasses.dataclass(frozen=True)
class Request:
    """What an implementation is asked to run: the spec, its mesh resolved for the job's devices
    or ranks (None for the flags alone) and the flags of `trainspec train` that were given."""

    spec: Spec | None
    dims: ParallelDims | None
    flags: Mapping[str, object] = dataclasses.field(default_factory=dict)

    @property
    def sizes(self) -> dict[str, int]:
        return self.dims.shape if self.dims is not None else {}

    def split(self, role: str) -> tuple[str, ...]:
        """The axes of `role` with more than one device."""
        return self.dims.split(role) if self.dims is not None else ()

    def value(self, field: str):
        """The field's value: a flag's (None when not given), a list over the keys for a
        '*' (mesh.axes.*.size), else the spec's."""
        if field.startswith("--"):
            return self.flags.get(field)
        return _walk(self.spec, field.split("."))


def _walk(node, parts: list[str]):
    if not parts or node is None:  # None: an optional section that is absent, and its fields
        return node
    if parts[0] == "*":
        return [_walk(v, parts[1:]) for v in node.values()]
    return _walk(getattr(node, parts[0]), parts[1:])


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Values of a field the implementation refuses: `when` says which, as the table prints
    it; `test(value, request)` finds them; `reason` is the line's text after 'field: ', a
    template of the field's `{value}` and of what `details(request)` names."""

    when: str
    test: Callable[[object, Request], bool]
    reason: str
    details: Callable[[Request], dict] | None = None

    def line(self, field: str, request: Request) -> str:
        names = {"value": request.value(field), **(self.details(request) if self.details else {})}
        return f"{field}: {self.reason.format(**names)}"

    @property
    def text(self) -> str:
        """The reason as the table prints it: each name of the template as <name>."""
        return re.sub(r"\{(\w+)[^}]*\}", r"<\1>", self.reason)


@dataclasses.dataclass(frozen=True)
class Entry:
    """How a field is honoured (a note, or none), and the values refused."""

    how: str
    refusals: tuple[Refusal, ...] = ()
    # an optional section refused whenever present: its fields need no entries of their own
    whole_section: bool = False


def honoured(how: str = "", *refusals: Refusal) -> Entry:
    return Entry(how, refusals)


def refusal(when: str, test: Callable[[object], bool], reason: str) -> Refusal:
    """A refusal that looks at the field's value only."""
    return Refusal(when, lambda value, request: test(value), reason)


def refused(when: str, test: Callable[[object], bool], reason: str) -> Entry:
    """A field honoured at its default only: refused `when`."""
    return Entry("", (refusal(when, test, reason),))


# `trainspec train --init-from` on any implementation: the file holds the reference model's
# parameters (trainspec.core.params_file); a user's model (--model) initialises its own.
INIT_FROM_WITH_MODEL = Refusal(
    "with --model", lambda value, request: value is not None and bool(request.value("--model")),
    "holds the reference model's parameters; a --model initialises its own (drop one of them)")


def roles_not_split(implementation: str, *roles: str) -> Refusal:
    """A refusal of mesh sizes that split an axis of one of `roles`, which `implementation`
    does not run."""
    def axes(request: Request) -> list[str]:
        return [a for role in roles for a in request.split(role)]

    named = " or ".join(roles) if len(roles) < 3 else f"{', '.join(roles[:-1])} or {roles[-1]}"
    return Refusal(f"when a {named} axis is split", lambda value, request: bool(axes(request)),
                   f"the {implementation} implementation does not split {named} axes, got {{axes}}",
                   lambda r: {"axes": ", ".join(f"{a}={r.sizes[a]}" for a in axes(r))})


PIPELINE_FIELDS = ("pipeline.microbatches", "pipeline.schedule", "pipeline.virtual_stages",
                   "pipeline.layers_per_stage")


def pipeline_fields_unused() -> dict[str, Entry]:
    """The `[pipeline]` fields of an implementation that refuses a split pipeline axis: they
    have no effect on one stage."""
    return {f: honoured("no effect on one stage (a split pipeline axis is refused)")
            for f in PIPELINE_FIELDS}


def refused_section(reason: str) -> Entry:
    return Entry("", (refusal("when present", lambda v: v is not None, reason),),
                 whole_section=True)


class Capabilities:
    """One implementation's table: field path -> Entry."""

    def __init__(self, implementation: str, entries: Mapping[str, Entry]):
        self.implementation, self.entries = implementation, dict(entries)

    def refusals(self, request: Request, fields: Callable[[str], bool] | None = None) -> list[str]:
        """One line per refused field of `request` (of the `fields` chosen), in table order."""
        return [r.line(field, request) for field, entry in self.entries.items()
                if fields is None or fields(field)
                for r in entry.refusals if r.test(request.value(field), request)]

    def check(self, request: Request, fields: Callable[[str], bool] | None = None) -> None:
        """UserInputError with the first refusal's line, if the request has one."""
        lines = self.refusals(request, fields)
        if lines:
            raise UserInputError(lines[0])

    def check_flags(self, flags: Mapping[str, object]) -> None:
        """The flags of `trainspec train` alone, before a spec is loaded."""
        self.check(Request(None, None, flags), lambda field: field.startswith("--"))

    def declares(self, field: str) -> bool:
        parts = field.split(".")
        sections = (".".join(parts[:i]) for i in range(1, len(parts)))
        return field in self.entries or any(
            s in self.entries and self.entries[s].whole_section for s in sections)


def schema_fields(model: type[pydantic.BaseModel] = Spec, prefix: str = "") -> list[str]:
    """Every leaf field of the schema as a dotted path; a table of sections keyed by name
    (mesh.axes) gives '*' for the key."""
    fields = []
    for name, info in model.model_fields.items():
        path, section = f"{prefix}{name}", _section(info.annotation)
        if section is None:
            fields.append(path)
        else:
            model_, keyed = section
            fields += schema_fields(model_, f"{path}.{'*.' if keyed else ''}")
    return fields


def _section(annotation) -> tuple[type[pydantic.BaseModel], bool] | None:
    """(the model of a section field, whether it is a table of sections keyed by name)."""
    def is_model(t) -> bool:
        return isinstance(t, type) and issubclass(t, pydantic.BaseModel)

    if typing.get_origin(annotation) is dict:
        value = typing.get_args(annotation)[1]
        return (value, True) if is_model(value) else None
    models = [t for t in (annotation, *typing.get_args(annotation)) if is_model(t)]
    return (models[0], False) if models else None  # Model, or Model | None


def undeclared(table: Capabilities, fields: list[str]) -> list[str]:
    """The fields the table has no entry for."""
    return [f for f in fields if not table.declares(f)]


def markdown(tables: list[Capabilities], fields: list[str]) -> str:
    """The tables side by side, one row per field (and one per whole section refused)."""
    rows = ["| field | " + " | ".join(t.implementation for t in tables) + " |",
            "|---" * (len(tables) + 1) + "|"]
    for field in fields:
        rows.append(f"| `{field}` | " + " | ".join(_cell(t, field) for t in tables) + " |")
    return "\n".join(rows) + "\n"


def _cell(table: Capabilities, field: str) -> str:
    if not table.declares(field):  # a flag: only for the implementations `train` runs
        return "-" if field.startswith("--") else "**not declared**"
    entry = table.entries.get(field)
    if entry is None:  # a field of a section refused whole
        section = next(s for s in table.entries if field.startswith(s + "."))
        return f"refused with `{section}`: {table.entries[section].refusals[0].text}"
    honours = f"honoured: {entry.how}" if entry.how else "honoured" if not entry.refusals else ""
    parts = [honours] if honours else []
    parts += [f"refused {r.when}: {r.text}" for r in entry.refusals]
    return "; ".join(parts).replace("|", "\\|")
