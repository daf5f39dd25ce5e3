"""The trainspec schema: fields, defaults and validation in one place (with the sections of what
is trained and kept in spec_job.py, its `[health]` sections in spec_health.py, `[context]` and
`[model.moe]` in spec_sequence.py, and the sections' common base in spec_section.py).

One pydantic definition gives both the validation (with the path of the offending field in every
message) and the JSON Schema committed as docs/spec.schema.json. docs/spec.md states the same
fields normatively; tests/core/test_spec.py fails when the committed schema and this module drift.

Checks that need the device count (inferred axis sizes, batch divisibility by the data axes)
live in core/mesh.py, because only there is the device count known.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field, field_validator, model_validator

from trainspec.core.compression import BLOCK_ALIGN
from trainspec.core.errors import UserInputError
from trainspec.core.pipeline import stages as pipeline_stages
from trainspec.core.spec_bounds import (
    AXIS_NAME, MAX_DEVICES, MAX_SEQUENCES, MAX_TIMEOUT_S, MAX_WIDTH)
from trainspec.core.spec_health import HealthSpec
from trainspec.core.spec_job import (  # noqa: F401 (re-exported: the spec's sections)
    CheckpointSpec, EvalSpec, MetricsSpec, ModelSpec, OptimizerSpec, ProfileSpec, TrainSpec,
    reference_parameters)
from trainspec.core.spec_messages import validation_message
from trainspec.core.spec_section import Section
from trainspec.core.spec_sequence import ContextSpec, sequence_and_expert_errors
from trainspec.core.spec_source import apply_overrides, read_source

SPEC_VERSION = 1
ROLES = ("data", "fsdp", "tensor", "context", "expert", "pipeline")
LOGICAL_AXES = ("batch", "length", "embed", "mlp", "heads", "kv", "vocab", "layers")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble_v")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
DTYPES = Literal["float32", "bfloat16", "float16"]
DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0  # the spec's default, and a collective's outside a spec




class MeshAxis(Section):
    """One named axis of the device mesh."""

    role: Literal[ROLES] | None = Field(
        None, description="What the axis does. Defaults to the axis name when that names a role."
    )
    size: int = Field(
        -1, le=MAX_DEVICES,
        description="Devices along the axis, cross-host factor included; -1 = infer "
        "(at most one axis)."
    )
    dcn: int = Field(
        1, ge=1, le=MAX_DEVICES,
        description="Cross-host (DCN) factor of `size`: how many processes the axis "
        "spans. `size` must be a multiple of it."
    )

    @model_validator(mode="after")
    def _size(self):
        if self.size == 0 or self.size < -1:
            raise ValueError(f"size must be a positive integer or -1 (infer), got {self.size}")
        if self.size > 0 and self.size % self.dcn:
            raise ValueError(f"size {self.size} is not a multiple of dcn {self.dcn}")
        return self


def _default_axes() -> dict[str, MeshAxis]:
    return {"data": MeshAxis(size=-1), "fsdp": MeshAxis(size=1), "tensor": MeshAxis(size=1)}


class MeshSpec(Section):
    """The device mesh: its axes, their sizes and roles, and devices left out."""

    axes: dict[str, MeshAxis] = Field(
        default_factory=_default_axes,
        description="Mesh axes in order (major to minor), keyed by axis name.",
    )
    exclude_devices: list[Annotated[int, Field(ge=0, lt=MAX_DEVICES)]] = Field(
        default_factory=list, description="Device ids the mesh must not use."
    )

    @model_validator(mode="after")
    def _axes(self):
        if not self.axes:
            raise ValueError("at least one axis is required")
        inferred = [name for name, axis in self.axes.items() if axis.size == -1]
        if len(inferred) > 1:
            raise ValueError(f"at most one axis may have size -1, got {inferred}")
        for name, axis in self.axes.items():
            if not AXIS_NAME.match(name):
                raise ValueError(f"axis name {name!r} is not an ASCII identifier (letters, "
                                 "digits and _, not starting with a digit)")
            if axis.role is None and name not in ROLES:
                raise ValueError(
                    f"axis '{name}' needs a role (one of {', '.join(ROLES)}): its name is not one"
                )
        if len(self.axes_with_role("pipeline")) > 1:
            raise ValueError(f"at most one axis may have role pipeline (the stages lie along "
                             f"it), got {list(self.axes_with_role('pipeline'))}")
        return self

    def role_of(self, name: str) -> str:
        return self.axes[name].role or name

    def axes_with_role(self, role: str) -> tuple[str, ...]:
        return tuple(name for name in self.axes if self.role_of(name) == role)


class LayoutSpec(Section):
    """How parameters and optimizer state are split over the mesh axes."""

    rules: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Logical axis name -> mesh axis names it is sharded over ([] = replicated). "
        "Merged over the defaults derived from the axis roles (docs/spec.md).",
    )
    optimizer_state: Literal["like_params", "shard_over_data"] = Field(
        "like_params",
        description="`like_params`: optimizer state is laid out like its parameter; "
        "`shard_over_data`: additionally sharded over the data axes (ZeRO-1).",
    )


class PrecisionSpec(Section):
    """Dtypes of storage, arithmetic and gradient reduction."""

    param: DTYPES = Field("float32", description="Storage dtype of parameters.")
    compute: DTYPES = Field("float32", description="Dtype of forward and backward arithmetic.")
    grad_reduce: DTYPES = Field(
        "float32", description="Dtype gradients are summed in across micro-batches and replicas."
    )


class BatchSpec(Section):
    """The global batch, its micro-batches (accumulation) and its sequence length."""

    global_batch: int = Field(32, ge=1, le=MAX_SEQUENCES,
                              description="Sequences per optimizer step, all replicas.")
    micro_batch: int | None = Field(
        None, ge=1, le=MAX_SEQUENCES, description="Sequences per micro-batch, all replicas; accumulation steps = "
        "global_batch / micro_batch. Default: global_batch (no accumulation)."
    )
    seq_len: int = Field(128, ge=1, le=MAX_WIDTH, description="Tokens per sequence.")

    @model_validator(mode="after")
    def _divides(self):
        if self.micro_batch is not None and self.global_batch % self.micro_batch:
            raise ValueError(
                f"global_batch {self.global_batch} is not a multiple of micro_batch "
                f"{self.micro_batch}"
            )
        return self

    @property
    def micro(self) -> int:
        return self.micro_batch or self.global_batch

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch // self.micro


class RematSpec(Section):
    """What the backward pass recomputes instead of keeping."""

    policy: Literal[REMAT_POLICIES] = Field(
        "none", description="Activation rematerialisation per model block."
    )


class CollectivesSpec(Section):
    """Which implementation moves the gradients, and what it sends."""

    backend: Literal["xla", "ext", "hierarchical"] = Field(
        "xla", description="Implementation of the collectives: `xla` (native), `ext` (the "
        "xla_ext custom calls; the gradient reduction over the data axes goes through it) or "
        "`hierarchical` (ext within a process, native across processes; docs/scale-out.md)."
    )
    timeout_s: float = Field(
        DEFAULT_COLLECTIVE_TIMEOUT_S, gt=0, le=MAX_TIMEOUT_S,
        description="A collective whose peers do not all arrive fails after this."
    )
    compression: Literal["none", "bf16", "int8"] = Field(
        "none", description="What the gradient reduction over the data axes sends: float32 "
        "(`none`), bfloat16, or int8 with a float32 scale per block, with error feedback "
        "(docs/communication.md). `xla` or `ext` backend."
    )
    error_feedback: bool = Field(
        True, description="With a compression: each replica keeps what compression lost in a "
        "residual (train state) and sends it with its next gradient. `false` drops it; for "
        "measuring what error feedback is worth (docs/communication.md)."
    )
    compression_block: int = Field(
        256, ge=BLOCK_ALIGN, le=MAX_WIDTH,
        description=f"Elements per int8 scale block; a multiple of {BLOCK_ALIGN} (keeps the "
        "packed buffer of scales and payload a whole number of 4-byte words: docs/xla_ext.md)."
    )

    @field_validator("compression_block")
    @classmethod
    def _block_aligned(cls, block: int) -> int:
        if block % BLOCK_ALIGN:
            raise ValueError(f"{BLOCK_ALIGN} does not divide block size {block}")
        return block


class SemiSyncSpec(Section):
    """Semi-synchronous training (DiLoCo, Douillard et al. 2023; docs/communication.md)."""

    inner_steps: int = Field(
        ..., ge=1, le=2**20, description="H: steps each data-parallel group takes with the inner "
        "optimizer, exchanging nothing with the other groups, between two outer steps."
    )
    outer_optimizer: Literal["nesterov"] = Field(
        "nesterov", description="The outer step on the groups' mean parameter delta: SGD with "
        "Nesterov momentum."
    )
    outer_lr: float = Field(0.7, gt=0, le=10.0, description="Outer learning rate.")
    outer_momentum: float = Field(0.9, ge=0, lt=1.0, description="Outer Nesterov momentum.")


class PipelineSpec(Section):
    """Pipeline parallelism over the `pipeline`-role axis (docs/spec.md, `pipeline`)."""

    microbatches: int | None = Field(
        None, ge=1, le=MAX_SEQUENCES, description="Pipeline micro-batches each accumulation "
        "micro-batch (batch.micro_batch) is split into. Default: the number of stages."
    )
    schedule: Literal[PIPELINE_SCHEDULES] = Field(
        "1f1b", description="`gpipe` (all forwards, then all backwards), `1f1b` (one forward "
        "one backward: PipeDream-flush), `interleaved_1f1b` (1f1b over `virtual_stages` "
        "chunks per stage) or `zero_bubble_v` (ZBV; implementations without it refuse it)."
    )
    virtual_stages: int = Field(
        1, ge=1, le=2**12, description="Model chunks per stage (interleaved_1f1b: at least 2)."
    )
    layers_per_stage: list[int] = Field(
        default_factory=list, description="Layers of each chunk in order (stages x "
        "virtual_stages entries, summing to model.n_layers). Empty: an even split."
    )


class FieldError(ValueError):
    """A check across sections, naming the field it is about: pydantic locates an error raised
    by a whole-spec check nowhere."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class Spec(Section):
    """How a training job sits on the hardware (docs/spec.md)."""

    spec_version: Literal[1] = Field(SPEC_VERSION, description="Version of this format.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed of parameter init and data order.")
    mesh: MeshSpec = MeshSpec()
    layout: LayoutSpec = LayoutSpec()
    precision: PrecisionSpec = PrecisionSpec()
    batch: BatchSpec = BatchSpec()
    remat: RematSpec = RematSpec()
    pipeline: PipelineSpec = PipelineSpec()
    collectives: CollectivesSpec = CollectivesSpec()
    metrics: MetricsSpec = MetricsSpec()
    model: ModelSpec = ModelSpec()
    optimizer: OptimizerSpec = OptimizerSpec()
    train: TrainSpec = TrainSpec()
    checkpoint: CheckpointSpec = CheckpointSpec()
    eval: EvalSpec = EvalSpec()
    profile: ProfileSpec = ProfileSpec()
    health: HealthSpec = HealthSpec()
    semi_sync: SemiSyncSpec | None = Field(
        None, description="Semi-synchronous (DiLoCo) training; absent = synchronous.")
    context: ContextSpec = ContextSpec()

    @field_validator("spec_version", mode="before")
    @classmethod
    def _not_a_bool(cls, version):
        if isinstance(version, bool):  # True == 1 passes Literal[1]
            raise ValueError(f"expected the integer {SPEC_VERSION}, not a boolean")
        return version

    @model_validator(mode="after")
    def _sequence_and_experts(self):
        sizes = {name: axis.size for name, axis in self.mesh.axes.items()}
        for field, message in sequence_and_expert_errors(self, sizes)[:1]:
            raise FieldError(field, message)
        return self

    @model_validator(mode="after")
    def _rules_name_axes(self):
        for logical, mesh_axes in self.layout.rules.items():
            for axis in mesh_axes:
                if axis not in self.mesh.axes:
                    raise FieldError(f"layout.rules.{logical}", f"names mesh axis '{axis}', "
                                     f"which is not in mesh.axes ({', '.join(self.mesh.axes)})")
        return self

    @model_validator(mode="after")
    def _pipeline_fits(self):
        """The section against the mesh's stage count, where the spec fixes it (an inferred
        pipeline axis is checked when the mesh is resolved: trainspec.core.mesh)."""
        axes = self.mesh.axes_with_role("pipeline")
        if axes and self.mesh.axes[axes[0]].size != -1:
            check_pipeline(self, self.mesh.axes[axes[0]].size)
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def check_pipeline(spec: Spec, stages: int) -> None:
    """FieldError naming the first field that cannot run on `stages` pipeline stages."""
    p = spec.pipeline
    found = pipeline_stages.problems(
        stages=stages, virtual_stages=p.virtual_stages, schedule=p.schedule,
        microbatches=p.microbatches, n_layers=spec.model.n_layers,
        layers_per_stage=p.layers_per_stage)
    if found:
        raise FieldError(*found[0])


def json_schema() -> dict[str, Any]:
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = f"trainspec spec v{SPEC_VERSION}"
    return schema


def load_spec(
    source: str | Path | dict[str, Any] | Spec | None = None, overrides: list[str] = ()
) -> Spec:
    """Load and validate a spec from a TOML path, a TOML string, a dict, or None (defaults).

    `overrides` are `key.path=value` assignments applied before validation.
    Raises UserInputError with one line naming the field and the bad value.
    """
    data = source.to_dict() if isinstance(source, Spec) else read_source(source)
    apply_overrides(data, overrides)
    try:
        return Spec.model_validate(data)
    except pydantic.ValidationError as err:
        raise UserInputError(validation_message(err, Spec)) from None


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


DEFAULT_SPEC_PATH = Path(__file__).parents[1] / "default.toml"  # the default job's spec


def default_spec() -> Spec:
    return load_spec(DEFAULT_SPEC_PATH)

