"""The spec's sections of what is trained and kept (trainspec.core.spec holds the placement
sections and the whole Spec): the reference model, its optimizer and run length, held-out
evaluation, metrics, profiler traces and checkpoints."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from trainspec.core.spec_bounds import (
    MAX_DEVICES, MAX_KEPT, MAX_LAYERS, MAX_MODEL_WIDTH, MAX_PARAMETERS, MAX_STEPS, MAX_WIDTH)
from trainspec.core.spec_section import Section
from trainspec.core.spec_sequence import MoESpec


class MetricsSpec(Section):
    """What is measured, how often, and where the records go (docs/metrics.md)."""

    sink: Literal["jsonl"] = Field("jsonl", description="Where metric records go.")
    sinks: list[str] = Field(
        default_factory=list, max_length=16, description="More sinks, by the names packages "
        "register under the `trainspec.sinks` entry points (docs/metrics.md); each gets every "
        "record the JSONL file gets.")
    path: str = Field("metrics.jsonl", min_length=1,
                      description="Sink file, relative to the run directory.")
    interval: int = Field(10, ge=1, le=MAX_STEPS,
                          description="Steps between metric records (host syncs).")
    flops_convention: Literal["no_causal_discount", "causal_discount"] = Field(
        "no_causal_discount",
        description="Attention FLOPs in `model_flops_per_step`: all T^2 score entries "
        "(torchtitan) or half of them (MaxText). docs/metrics.md.",
    )
    peak_flops_per_device: float | None = Field(
        None, gt=0, description="Peak FLOP/s of one device for `mfu`/`hfu`; default: the "
        "table in docs/metrics.md for the device kind and compute dtype.",
    )
    tensorboard: bool = Field(
        False, description="Also write TensorBoard scalars (needs tensorboardX or torch).",
    )
    gns: bool | None = Field(
        None, description="Measure the gradient noise scale (`gns_*` record fields; "
        "docs/advice.md). Default: on when there are >= 2 data-parallel replicas or "
        "micro-batches; `true` where neither exists is an error.",
    )


class ModelSpec(Section):
    """The reference decoder-only transformer that `trainspec train` builds."""

    vocab_size: int = Field(256, ge=2, le=MAX_WIDTH, description="Byte-level by default.")
    d_model: int = Field(128, ge=1, le=MAX_MODEL_WIDTH, description="Width of the residual stream.")
    n_layers: int = Field(2, ge=1, le=MAX_LAYERS, description="Transformer blocks.")
    n_heads: int = Field(4, ge=1, le=2**12, description="Attention heads; must divide d_model.")
    d_ff: int = Field(512, ge=1, le=MAX_MODEL_WIDTH, description="Hidden width of the MLP (of "
                      "each expert's, with `moe`).")
    moe: MoESpec | None = Field(
        None, description="Every block's MLP a mixture of experts; absent = dense.")

    @model_validator(mode="after")
    def _heads(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
        if (count := reference_parameters(self)) > MAX_PARAMETERS:
            raise ValueError(f"d_model, d_ff, n_layers and vocab_size make {count:.3g} "
                             f"parameters, more than {MAX_PARAMETERS:.0e}")
        return self


def reference_parameters(m: ModelSpec) -> int:
    """The reference transformer's parameter count (trainspec.core.reference_model): embedding
    and head, and per block four attention projections, the MLP (each expert's, and the
    router, with `moe`) and two norms."""
    experts = m.moe.experts if m.moe else 1
    mlp = 2 * m.d_model * m.d_ff * experts + (m.d_model * experts if m.moe else 0)
    block = 4 * m.d_model**2 + mlp + 2 * m.d_model
    return 2 * m.vocab_size * m.d_model + m.d_model + m.n_layers * block


class OptimizerSpec(Section):
    """The reference job's optax optimizer and its schedule."""

    name: Literal["adamw", "sgd"] = Field("adamw", description="The optax optimizer.")
    learning_rate: float = Field(3e-3, gt=0, le=10.0,
                                 description="Peak learning rate (above 10 is a typo).")
    warmup_steps: int = Field(10, ge=0, le=MAX_STEPS,
                              description="Steps of linear warm-up from 0 to "
                              "learning_rate; cosine decay to a tenth of it follows.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay (adamw only).")
    grad_clip_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient "
                                         "norm to this; null = no clipping.")


class TrainSpec(Section):
    """How long the reference job trains."""

    steps: int = Field(60, ge=1, le=MAX_STEPS, description="Optimizer steps of `trainspec train`.")


class EvalSpec(Section):
    """Held-out loss during training: the records' `eval_loss` (docs/spec.md)."""

    interval: int = Field(0, ge=0, le=MAX_STEPS, description="Steps between evaluations "
                          "(0 = none); a run evaluates after every step that is a multiple of it.")
    batches: int = Field(2, ge=1, le=MAX_STEPS, description="Global batches per evaluation, "
                         "the same ones every time.")
    source: Literal["held_out", "training"] = Field(
        "held_out", description="The reference job's eval data: held_out, the standard "
        "library's source past the training corpus (never trained on); training, other "
        "windows of the training corpus. A user's model evaluates its own eval_batches.")


class ProfileSpec(Section):
    """Profiler traces of a few steps into the run directory (docs/spec.md)."""

    start_step: int = Field(0, ge=0, le=MAX_STEPS, description="The first step traced (0 = "
                            "none).")
    steps: int = Field(3, ge=1, le=MAX_STEPS, description="Steps traced from start_step on.")
    process: int = Field(0, ge=0, le=MAX_DEVICES, description="The process (JAX) or rank "
                         "(torch) that traces.")


class CheckpointSpec(Section):
    """When and where the train state is saved (docs/reliability.md)."""

    interval: int = Field(
        20, ge=0, le=MAX_STEPS,
        description="Steps between checkpoints (0 = none). The last step and a halt "
        "are always checkpointed when this is > 0."
    )
    keep: int = Field(3, ge=1, le=MAX_KEPT,
                      description="Newest checkpoints kept; older ones are deleted.")
    async_save: bool = Field(
        True, description="Write in the background while training continues."
    )
    dir: str = Field("checkpoints", min_length=1,
                     description="Checkpoint directory, relative to the run directory.")

    @field_validator("dir")
    @classmethod
    def _inside_the_run(cls, directory: str) -> str:
        if Path(directory).is_absolute() or Path(directory).parts in ((), (".",)) \
                or ".." in Path(directory).parts:
            raise ValueError(f"expected a directory inside the run directory, got {directory!r}")
        return directory
