"""The blocks' parameters held by the pipeline stages that run them (docs/pipeline.md).

Under a split pipeline axis the train state holds every parameter-like dict (the parameters,
each optimizer moment: any dict holding all the blocks' names) as `Staged`: the blocks stacked
into leaves [stages, virtual stages, blocks per chunk, ...], split over the pipeline axis on
their first dimension, so stage s holds model chunks s, s + p, ... and nothing else; the rest
(embedding, head, ...) as without a pipeline. The step's gradients of the blocks come out of
the pipeline in that layout: nothing moves between stages but the activations, their
cotangents and the loss.

Checkpoints, parameter files and exports hold the model's own tree, one leaf per block,
whatever the stage count (`whole`): a state is saved in it, each block's leaves split over the
pipeline axis on a free dimension (no device holds more than before), and restored from it into
the current stage count's layout (`staged_like`), so a run resumes onto any stage count or
none.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.tree_util import GetAttrKey

from trainspec.jax.layout import add_axes_on_free_dim


@dataclasses.dataclass(frozen=True)
class StageForm:
    """How a model's blocks split over the stages: `blocks`, their names in order; model chunk
    k (blocks k·per_chunk ...) runs on stage k mod `stages`, as chunk k // `stages` of its
    `virtual` ones; `axis`, the pipeline mesh axis."""

    blocks: tuple[str, ...]
    stages: int
    virtual: int
    axis: str

    @property
    def per_chunk(self) -> int:
        return len(self.blocks) // (self.stages * self.virtual)

    def holds_blocks(self, node) -> bool:
        return isinstance(node, dict) and set(self.blocks) <= node.keys()

    def place(self, block: int) -> tuple[int, int, int]:
        """(stage, chunk on that stage, position in the chunk) of block `block`."""
        chunk, position = divmod(block, self.per_chunk)
        virtual, stage = divmod(chunk, self.stages)
        return stage, virtual, position

    def staged(self, tree):
        """`tree` with each dict holding the blocks as `Staged` (traceable: inside jit)."""
        p, v, n = self.stages, self.virtual, self.per_chunk

        def stack(*leaves):  # [v, p, n] in model order is chunk c·p + s at [c, s]
            return jnp.stack(leaves).reshape(v, p, n, *leaves[0].shape).swapaxes(0, 1)

        def stage(node):
            if not self.holds_blocks(node):
                return node
            rest = {k: x for k, x in node.items() if k not in self.blocks}
            return Staged(rest, jax.tree.map(stack, *(node[b] for b in self.blocks)), self)

        return jax.tree.map(stage, tree, is_leaf=self.holds_blocks)

    def staged_pspecs(self, pspecs):
        """The PartitionSpecs of `staged(tree)` from those of `tree` (the blocks' are alike)."""
        def stage(node):
            if not self.holds_blocks(node):
                return node
            rest = {k: x for k, x in node.items() if k not in self.blocks}
            stacked = jax.tree.map(lambda ps: P(self.axis, None, None, *ps),
                                   node[self.blocks[0]], is_leaf=_is_pspec)
            return Staged(rest, stacked, self)

        return jax.tree.map(stage, pspecs, is_leaf=lambda x: self.holds_blocks(x) or _is_pspec(x))


@jax.tree_util.register_pytree_with_keys_class
class Staged:
    """A parameter-like dict with its blocks held by stage (`StageForm.staged`): `rest`, the
    dict without them; `stages`, one block's tree with leaves [stages, virtual, per chunk, ...]."""

    def __init__(self, rest: dict, stages, form: StageForm):
        self.rest, self.stages, self.form = rest, stages, form

    def __contains__(self, key) -> bool:  # a dict's question (flax's TrainState asks it)
        return key in self.rest or key in self.form.blocks

    def tree_flatten_with_keys(self):
        return ((GetAttrKey("rest"), self.rest), (GetAttrKey("stages"), self.stages)), self.form

    @classmethod
    def tree_unflatten(cls, form, children):
        return cls(*children, form)

    def whole(self, take) -> dict:
        """The dict it was staged from, block b's leaves `take(stacked leaf, *form.place(b))`."""
        blocks = {name: jax.tree.map(lambda a, b=b: take(a, *self.form.place(b)), self.stages)
                  for b, name in enumerate(self.form.blocks)}
        return {**self.rest, **blocks}


def _is_pspec(x) -> bool:
    return isinstance(x, P)


def _is_staged(x) -> bool:
    return isinstance(x, Staged)


def form_of(tree) -> StageForm | None:
    """The stage form `tree` is held in, or None when it holds no blocks by stage."""
    found = [x.form for x in jax.tree.leaves(tree, is_leaf=_is_staged) if _is_staged(x)]
    return found[0] if found else None


def whole(tree):
    """`tree` with every `Staged` dict as the model's own, one leaf per block (traceable)."""
    return jax.tree.map(lambda x: x.whole(lambda a, *at: a[at]) if _is_staged(x) else x, tree,
                        is_leaf=_is_staged)


def _stored(leaf, stage: int, virtual: int, position: int) -> jax.ShapeDtypeStruct:
    """A block's leaf as it is stored: its stacked leaf's layout less the stage dimensions,
    split over the pipeline axis on its first free dimension that it divides."""
    del stage, virtual, position  # every block's leaf is stored alike
    shape, sharding = leaf.shape[3:], leaf.sharding
    axis = sharding.spec[0]
    spec = add_axes_on_free_dim(P(*sharding.spec[3:]), shape, (axis,), sharding.mesh)
    return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=NamedSharding(sharding.mesh, spec))


def whole_abstract(tree):
    """Shapes, dtypes and stored shardings of `whole(tree)`, from `tree`'s arrays or
    ShapeDtypeStructs with shardings: what a checkpoint of it is restored into."""
    def leaf(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)

    def node(x):
        return x.whole(_stored) if _is_staged(x) else x

    return jax.tree.map(node, jax.tree.map(leaf, tree), is_leaf=_is_staged)


def whole_arrays(tree):
    """`whole(tree)` computed on the devices, each block's leaves as `whole_abstract` stores
    them; `tree` itself when it holds no blocks by stage."""
    if form_of(tree) is None:
        return tree
    shardings = jax.tree.map(lambda x: x.sharding, whole_abstract(tree))
    return jax.jit(whole, out_shardings=shardings)(tree)


def staged_like(tree, target):
    """`tree` (the model's own dicts, as `whole` gives) in `target`'s stage form and shardings
    (arrays or ShapeDtypeStructs with shardings); `tree` itself when `target` holds none."""
    form = form_of(target)
    if form is None:
        return tree
    shardings = jax.tree.map(lambda x: x.sharding, target)
    return jax.jit(form.staged, out_shardings=shardings)(tree)
