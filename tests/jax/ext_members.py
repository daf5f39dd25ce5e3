"""The members of the xla_ext collective tests: 8 simulated CPU devices as one group or a 2x4
mesh, their inputs, and the handler's documented reduction order as a NumPy reference."""
import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DEVICES = np.array(jax.devices())
MESH_1D = Mesh(DEVICES, ("d",))
MESH_2D = Mesh(DEVICES.reshape(2, 4), ("x", "y"))

DTYPES = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "i32": np.int32}
LOCAL_SHAPE = (8, 16)  # every dimension divisible by every group size of the tests


def member_inputs(dtype, seed: int = 0):
    """Per-member inputs, shape (8, *LOCAL_SHAPE); wide magnitudes so sum order matters."""
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        return rng.integers(-1000, 1000, (8, *LOCAL_SHAPE)).astype(np.int32)
    x = rng.standard_normal((8, *LOCAL_SHAPE)) * 10.0 ** rng.integers(-3, 4, (8, *LOCAL_SHAPE))
    return x.astype(dtype)


def on_every_member(fn, mesh):
    """fn maps one member's local array to a dict of local arrays; run it on every member."""
    spec = P(*mesh.axis_names)
    lead = len(mesh.axis_names)

    def body(block):
        out = fn(block.reshape(block.shape[lead:]))
        return jax.tree.map(lambda a: a.reshape((1,) * lead + a.shape), out)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=False))


def place(members, mesh):
    x = members.reshape(mesh.devices.shape + members.shape[1:])
    return jax.device_put(x, NamedSharding(mesh, P(*mesh.axis_names)))


def per_member(out, mesh):
    return {k: np.asarray(v).reshape((8,) + v.shape[len(mesh.axis_names):])
            for k, v in out.items()}


def rank_order_sum(xs):
    """The handler's definition: accumulate in rank order, float32 for 16/32-bit floats."""
    acc_dtype = np.int64 if xs[0].dtype == np.int32 else np.float32
    acc = xs[0].astype(acc_dtype)
    for v in xs[1:]:
        acc = acc + v.astype(acc_dtype)
    return acc.astype(xs[0].dtype)
