"""A model's parameters and the batch over the spec's mesh, on torch (docs/adapters.md).

- `fsdp` axis: FSDP2 `fully_shard` of the modules that module-name rules select (by default each
  child of the outermost `nn.ModuleList`s, the repeated blocks), innermost first, then the root;
  reductions sum (divide factor 1), so that the one division by the token count stays the step's;
- `tensor` axis: DTensor tensor parallelism by a plan {module name: ParallelStyle}, the user's or
  the default one, which splits `nn.Linear` layers by their names (Megatron's pairs: the
  column-split projections into a module's hidden width, the row-split one out of it);
- the batch: split over the data and fsdp axes, row-major, as in the JAX layout's `batch` rule.

Module-name rules are dotted names whose parts are fnmatch patterns ("transformer.h.*"), one
part per level, as `parallelize_module` reads its plan's keys.
"""
from __future__ import annotations

import collections
import fnmatch
import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from trainspec.core.errors import UserInputError

log = logging.getLogger("trainspec")

# The default tensor-parallel plan's names (the last part of an nn.Linear's module name), as
# Megatron, Llama and Hugging Face models name their projections. A fused projection (GPT-2's
# c_attn) cannot be split by a plan alone: its output would be cut across q, k and v.
COLUMN_SPLIT = frozenset({"query", "key", "value", "q_proj", "k_proj", "v_proj", "wq", "wk",
                          "wv", "mlp_in", "up_proj", "gate_proj", "w1", "w3", "fc1"})
ROW_SPLIT = frozenset({"out", "o_proj", "out_proj", "wo", "mlp_out", "down_proj", "w2", "fc2"})
OUTPUT_HEAD = frozenset({"head", "lm_head", "output"})  # column-split, output gathered


def matches(name: str, rule: str) -> bool:
    """Whether module name `name` matches the rule, part by part."""
    parts, patterns = name.split("."), rule.split(".")
    return len(parts) == len(patterns) and all(
        fnmatch.fnmatchcase(p, q) for p, q in zip(parts, patterns))


def _some_names(model: nn.Module, n: int = 6) -> str:
    names = [name for name, _ in model.named_modules() if name]
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def check_rules_match(model: nn.Module, rules: Iterable[str], argument: str) -> None:
    names = [name for name, _ in model.named_modules() if name]
    for rule in rules:
        if not any(matches(name, rule) for name in names):
            raise UserInputError(f"{argument}: {rule!r} names no module of the model (its "
                                 f"modules: {_some_names(model)})")


# -- fsdp -------------------------------------------------------------------------------------

def shard_units(model: nn.Module, rules: Sequence[str] | None) -> list[str]:
    """Names of the modules that get their own `fully_shard` before the root, innermost first.
    `rules` None: each child of the outermost nn.ModuleLists."""
    if rules is None:
        lists = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
        outermost = [n for n in lists if not any(n.startswith(f"{o}.") for o in lists if o)]
        units = [f"{n}.{child}" if n else child for n in outermost
                 for child, _ in model.get_submodule(n).named_children()]
    else:
        check_rules_match(model, rules, "fsdp_units")
        units = [name for name, _ in model.named_modules()
                 if name and any(matches(name, rule) for rule in rules)]
    return sorted(units, key=lambda name: -name.count("."))  # fully_shard wants inner first


def apply_fsdp(model: nn.Module, units: Sequence[str], mesh: DeviceMesh,
               reduce_dtype: torch.dtype, ignored: set[nn.Parameter] = frozenset()) -> None:
    """FSDP2 over `mesh` on each unit, then the root; `ignored` parameters (the experts'
    kernels, already split over an expert axis) stay as they are, whole on every fsdp rank."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for name in units:
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=policy,
                    ignored_params=set(ignored))
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=set(ignored))
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)  # sum: the step divides by the tokens once
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


# -- tensor -----------------------------------------------------------------------------------

def default_tensor_plan(model: nn.Module, ranks: int) -> dict[str, object]:
    """{module name: ParallelStyle} for the nn.Linear layers whose names COLUMN_SPLIT,
    ROW_SPLIT and OUTPUT_HEAD list. A row-split layer needs a column-split sibling whose output
    width is its input width, and the other way round (the pair the plan relies on: the
    hidden activations between them stay split); the split widths must divide by `ranks`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    siblings: dict[str, list[tuple[str, nn.Linear]]] = collections.defaultdict(list)
    for name, m in linears:
        parent, _, leaf = name.rpartition(".")
        siblings[parent].append((leaf, m))
    users: dict[int, list[str]] = collections.defaultdict(list)  # parameter -> its modules
    for name, m in model.named_modules(remove_duplicate=False):
        for q in m.parameters(recurse=False):
            users[id(q)].append(name)
    plan: dict[str, object] = {}
    for name, m in linears:
        parent, _, leaf = name.rpartition(".")
        if leaf in COLUMN_SPLIT | ROW_SPLIT | OUTPUT_HEAD and len(users[id(m.weight)]) > 1:
            others = ", ".join(u for u in users[id(m.weight)] if u != name)
            raise UserInputError(
                f"tensor_plan: {name}.weight is shared with {others} (tied); the default plan "
                "would split one of its users only; give wrap a tensor_plan")
        if leaf in OUTPUT_HEAD:
            plan[name], width = ColwiseParallel(output_layouts=Replicate()), m.out_features
            paired = True  # its output is gathered whole
        elif leaf in COLUMN_SPLIT:
            plan[name], width = ColwiseParallel(), m.out_features
            paired = any(other in ROW_SPLIT and s.in_features == width
                         for other, s in siblings[parent])
        elif leaf in ROW_SPLIT:
            plan[name], width = RowwiseParallel(), m.in_features
            paired = any(other in COLUMN_SPLIT and s.out_features == width
                         for other, s in siblings[parent])
        else:
            continue
        if not paired:
            kind = "row" if leaf in COLUMN_SPLIT else "column"
            raise UserInputError(
                f"tensor_plan: the default plan splits {name} but finds no {kind}-split "
                f"nn.Linear beside it of matching width to pair it with; give wrap a tensor_plan")
        if width % ranks:
            raise UserInputError(f"tensor_plan: {name} has width {width}, not divisible by the "
                                 f"{ranks} ranks of the tensor axis")
    if not plan:
        raise UserInputError(
            f"tensor_plan: the model has no nn.Linear that the default plan knows by name "
            f"({', '.join(sorted(COLUMN_SPLIT | ROW_SPLIT | OUTPUT_HEAD))}); give wrap a "
            "tensor_plan {module name: ColwiseParallel() / RowwiseParallel() ...}")
    unsplit = [name for name, _ in linears if name not in plan]
    if unsplit:  # e.g. nanoGPT's c_q, c_fc, c_proj: replicated over the axis, silently
        shown = ", ".join(unsplit[:4]) + (f" and {len(unsplit) - 4} more" if len(unsplit) > 4
                                          else "")
        log.warning(f"tensor_plan: the default plan leaves {len(unsplit)} nn.Linear layers "
                    f"unsplit, each whole on every rank of the tensor axis ({shown}); give "
                    "wrap (or a UserModel) a tensor_plan that names them")
    return plan


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, plan: dict[str, object]) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, plan)


# -- the batch --------------------------------------------------------------------------------

def mesh_size(mesh: DeviceMesh, axis: str) -> int:
    return mesh.size(mesh.mesh_dim_names.index(axis))


def rows(mesh: DeviceMesh, batch_axes: Sequence[str], global_batch: int) -> slice:
    """This rank's rows: block `shard` of the batch axes' row-major coordinates."""
    shard, shards = 0, 1
    for axis in batch_axes:
        shard = shard * mesh_size(mesh, axis) + mesh.get_local_rank(axis)
        shards *= mesh_size(mesh, axis)
    per = global_batch // shards
    return slice(shard * per, (shard + 1) * per)


def sharded_axes(t: DTensor) -> tuple[str, ...]:
    """The mesh axes over which `t`'s local blocks are disjoint pieces of it.

    Every placement but Replicate splits the tensor: Shard, and also _StridedShard, which FSDP2
    gives a parameter that tensor parallelism already split on the same dimension (fsdp x
    tensor); in torch 2.13 `_StridedShard.is_shard()` is False and it does not subclass Shard.
    A Partial placement holds unreduced addends, whose squares do not sum to the square of
    their sum."""
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"a gradient with pending reductions ({t.placements}) has no local norm")
    return tuple(name for name, p in zip(t.device_mesh.mesh_dim_names, t.placements)
                 if not p.is_replicate())


def local_block(t: torch.Tensor) -> torch.Tensor:
    """This rank's block of a parameter or gradient (all of it when not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t
