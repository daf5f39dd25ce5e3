"""The reference transformer's mixture-of-experts MLP on torch (docs/spec.md, `[model.moe]`),
as trainspec/jax/models/moe.py: the routing decisions of trainspec.core.moe (top-k, gates,
capacity, the drop order, the auxiliary losses) over the whole micro-batch, and the experts
split over the `expert` axis.

Each rank holds its tokens of the micro-batch: its rows, and under a context axis its chunk
of their positions. Routing over the whole micro-batch needs three small exchanges over the
ranks that hold its tokens (`Routing`): each rank's count of assignments per (row, choice,
expert), all-gathered, gives every assignment its slot as if all tokens were in one place in
the micro-batch's order (every first choice before any second; rows in order, a row's
positions in the context split's order, as JAX's global view sees them); the router
probabilities' sums (the load-balancing loss's P_e) and the z-loss are summed over them. Each rank's share
of the auxiliary loss is its own rows' part of those sums, so that the shares add up to the
micro-batch's loss and its gradient.

Under a split expert axis each expert's kernels are one rank's (a DTensor sharded on the
experts' dimension; beside an fsdp axis FSDP2 shards the rest of the model and leaves them
whole on every fsdp rank), and the rows travel as on JAX: a buffer per expert holding the rows it
took (zeros elsewhere), the dispatch all-to-all to the experts' ranks, the experts, the
combine all-to-all back, summed by the gates (trainspec/torch/differentiable.py).
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from trainspec.core.moe import capacity
from trainspec.core.spec import ModelSpec
from trainspec.torch.differentiable import all_to_all
from trainspec.torch.mesh import group_of

# each kernel's fan-in dimension (the flax initialiser's N(0, 1/fan_in))
FAN_IN = {"router": 0, "mlp_in": 1, "mlp_out": 1}
EXPERT_KERNELS = ("mlp_in", "mlp_out")  # split over the expert axis on their first dimension


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    """x summed over `group` (no gradient: counts and statistics)."""
    x = x.detach().clone()
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


@dataclasses.dataclass(frozen=True)
class Routing:
    """The ranks holding one micro-batch's tokens (`group`, None: this rank alone) and where
    each one's lie in the micro-batch's order: group rank g holds row shard `shard[g]` (of
    `shards`) at sequence chunk `chunk[g]` (of `chunks`, the context split's)."""
    group: object = None
    shard: tuple[int, ...] = (0,)
    chunk: tuple[int, ...] = (0,)

    @property
    def shards(self) -> int:
        return max(self.shard) + 1

    @property
    def chunks(self) -> int:
        return max(self.chunk) + 1

    @property
    def me(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)


def _slots(choice: torch.Tensor, routing: Routing, rows: int):
    """Each assignment's slot at its expert as if the micro-batch's tokens were in one place
    in its order, (tokens, k); and the micro-batch's load per expert. `choice`: this rank's
    one-hot choices (tokens, k, e), `rows` rows of tokens / rows positions each."""
    per_row = choice.reshape(rows, -1, *choice.shape[1:])                  # (rows, t, k, e)
    counts = per_row.sum(1)                                                 # (rows, k, e)
    every = [counts]
    if routing.group is not None:
        every = [torch.empty_like(counts) for _ in range(dist.get_world_size(routing.group))]
        dist.all_gather(every, counts, group=routing.group)
    # the ranks' (row, choice, expert) counts in the micro-batch's order: shard, row, chunk
    key = torch.tensor(routing.shard) * routing.chunks + torch.tensor(routing.chunk)
    k, e = counts.shape[1:]
    ordered = torch.stack(every)[torch.argsort(key)].reshape(
        routing.shards, routing.chunks, rows, k, e).transpose(1, 2).reshape(-1, k, e)
    before = (ordered.cumsum(0) - ordered).reshape(routing.shards, rows, routing.chunks, k, e)
    me = routing.me
    mine = before[routing.shard[me], :, routing.chunk[me]]                  # (rows, k, e)
    total = ordered.sum(0)                                                  # (k, e)
    earlier = total.cumsum(0) - total  # every first choice before any second
    slot = ((per_row.cumsum(1) - 1 + mine[:, None] + earlier) * per_row).sum(-1)
    return slot.reshape(choice.shape[:2]), total.sum(0)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float, routing: Routing,
          rows: int) -> dict:
    """trainspec.core.moe.route of this rank's tokens of the micro-batch (`rows` rows of
    them): `weights` (tokens, experts), the gate of each kept assignment and 0 elsewhere;
    `aux`, this rank's share of the load-balancing and z losses (with gradient); the
    micro-batch's statistics."""
    group = routing.group
    mine, experts = logits.shape
    tokens = mine * (1 if group is None else dist.get_world_size(group))
    probs = torch.softmax(logits, -1)
    # a stable descending sort: of equal probabilities the lower expert first (the core's rule)
    picked, chosen = (x[:, :top_k] for x in torch.sort(probs, dim=-1, descending=True, stable=True))
    gates = picked / picked.sum(-1, keepdim=True)
    choice = F.one_hot(chosen, experts)                                     # (tokens, k, e)
    slot, load = _slots(choice, routing, rows)
    kept = slot < capacity(tokens, experts, top_k, capacity_factor)
    load = load.to(probs.dtype)
    mine_balance = experts * (load / (tokens * top_k) * probs.sum(0) / tokens).sum()
    mine_z = (torch.logsumexp(logits, -1) ** 2).sum() / tokens
    return {
        "weights": torch.einsum("tke,tk->te", choice.to(probs.dtype), gates * kept),
        "aux": (mine_balance, mine_z),
        "load": load,
        "dropped": (load - capacity(tokens, experts, top_k, capacity_factor)).clamp(min=0).sum(),
        "balance": _sum(mine_balance, group),
        "z": _sum(mine_z, group),
    }


def _experts(rows, w_in, w_out):
    """Every expert on every row: (experts, rows, d_model)."""
    hidden = F.gelu(torch.einsum("td,edf->etf", rows, w_in), approximate="tanh")
    return torch.einsum("etf,efd->etd", hidden, w_out)


class MoEMlp(nn.Module):
    """(batch, length, d_model) -> the same. After each forward, `aux` holds this rank's share
    of the weighted auxiliary loss and `stats` the micro-batch's routing statistics."""

    def __init__(self, c: ModelSpec, compute: torch.dtype, param: torch.dtype):
        super().__init__()
        moe, d, f = c.moe, c.d_model, c.d_ff
        self.settings, self.compute = moe, compute
        self.router = nn.Parameter(torch.empty(d, moe.experts, dtype=param))
        self.mlp_in = nn.Parameter(torch.empty(moe.experts, d, f, dtype=param))
        self.mlp_out = nn.Parameter(torch.empty(moe.experts, f, d, dtype=param))
        self.routing, self.expert_group = Routing(), None  # set by the step's layout
        self.aux, self.stats = None, None

    def forward(self, x):
        b, t, d = x.shape
        rows = x.reshape(b * t, d)
        m = self.settings
        r = route(rows.float() @ self.router.float(), m.top_k, m.capacity_factor,
                  self.routing, b)
        balance, z = r["aux"]
        self.aux = m.load_balance_weight * balance + m.z_loss_weight * z
        self.stats = {k: r[k].detach() for k in ("load", "dropped", "balance", "z")}
        rows, weights = rows.to(self.compute), r["weights"].to(self.compute)
        w_in, w_out = (_local(w).to(self.compute) for w in (self.mlp_in, self.mlp_out))
        if self.expert_group is None:
            out = _experts(rows, w_in, w_out)
        else:
            sent = (weights > 0).to(rows.dtype)
            received = all_to_all(sent.T[..., None] * rows[None], self.expert_group)
            # (sender, this rank's expert, row, d): each expert on the rows sent to it
            received = received.reshape(-1, w_in.shape[0], b * t, d)
            hidden = F.gelu(torch.einsum("sltd,ldf->sltf", received, w_in), approximate="tanh")
            out = all_to_all(torch.einsum("sltf,lfd->sltd", hidden, w_out).flatten(0, 1),
                             self.expert_group)
        return torch.einsum("te,etd->td", weights, out).reshape(b, t, d)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def moe_layers(model: nn.Module) -> list[MoEMlp]:
    return [m for m in model.modules() if isinstance(m, MoEMlp)]


def routing_of(mesh: DeviceMesh, batch_axes: tuple[str, ...],
               context_axes: tuple[str, ...]) -> Routing:
    """The Routing over the ranks of the batch axes (row shards, row-major over them) and
    the context axes (chunks), the group's ranks row-major over both in mesh order."""
    axes = tuple(a for a in mesh.mesh_dim_names if a in batch_axes + context_axes)
    if not axes:
        return Routing()
    sizes = [mesh.size(mesh.mesh_dim_names.index(a)) for a in axes]
    coords = [dict(zip(axes, c)) for c in itertools.product(*(range(n) for n in sizes))]

    def index(c: dict, among: tuple[str, ...]) -> int:  # row-major over `among`
        i = 0
        for a in among:
            i = i * sizes[axes.index(a)] + c[a]
        return i

    rows_by, chunks_by = (tuple(a for a in axes if a in some) for some in (batch_axes, context_axes))
    return Routing(group_of(mesh, axes), tuple(index(c, rows_by) for c in coords),
                   tuple(index(c, chunks_by) for c in coords))


def lay_out_experts(model: nn.Module, mesh: DeviceMesh, routing: Routing,
                    expert_axis: str | None) -> set[nn.Parameter]:
    """Every MoE layer routes over `routing`; with an expert axis its expert kernels become
    DTensors sharded on the experts' dimension over it, each rank's experts its own. Returns
    those kernels (FSDP2 beside them leaves them alone)."""
    kernels = set()
    for layer in moe_layers(model):
        layer.routing = routing
        if expert_axis is None:
            continue
        layer.expert_group = mesh.get_group(expert_axis)
        for name in EXPERT_KERNELS:
            whole = getattr(layer, name)
            setattr(layer, name, nn.Parameter(distribute_tensor(
                whole.data, mesh[expert_axis], [Shard(0)])))
            kernels.add(getattr(layer, name))
    return kernels


def weighted_aux_loss(model: nn.Module, valid_tokens: torch.Tensor) -> torch.Tensor:
    """This rank's share of the last forward's auxiliary losses (summed over layers) times the
    micro-batch's valid tokens, to add to the loss sum (the JAX job's aux x tokens)."""
    layers = moe_layers(model)
    tokens = _sum(torch.as_tensor(valid_tokens, dtype=torch.float32), layers[0].routing.group)
    return sum(layer.aux for layer in layers) * tokens


def routing_stats(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The last forward's statistics as the JAX job's aux reports them (summed over layers;
    the load per layer): trainspec.core.records.moe_fields reads them. None without experts."""
    layers = moe_layers(model)
    if not layers:
        return None
    return {"moe_load": torch.stack([layer.stats["load"] for layer in layers]),
            "moe_dropped": sum(layer.stats["dropped"] for layer in layers).float(),
            "moe_balance": sum(layer.stats["balance"] for layer in layers),
            "moe_z": sum(layer.stats["z"] for layer in layers),
            "moe_layers": torch.tensor(float(len(layers)))}
