"""The one tiny reference job of the tests (seconds, not minutes): `tiny_spec(*overrides, layout=)`."""
from trainspec.core.spec import DEFAULT_SPEC_PATH, load_spec

TINY = [
    "model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.n_heads=2",
    "batch.seq_len=16", "batch.global_batch=16", "batch.micro_batch=16",
    "metrics.interval=2", "optimizer.warmup_steps=2",
]
# Named layouts over the 8 test devices.
LAYOUTS = {
    "data": ["mesh.axes.data.size=8", "mesh.axes.fsdp.size=1", "mesh.axes.tensor.size=1"],
    "fsdp2": ["mesh.axes.data.size=4", "mesh.axes.fsdp.size=2", "mesh.axes.tensor.size=1"],
    "fsdp4": ["mesh.axes.data.size=2", "mesh.axes.fsdp.size=4", "mesh.axes.tensor.size=1"],
    "fsdp8": ["mesh.axes.data.size=1", "mesh.axes.fsdp.size=8", "mesh.axes.tensor.size=1"],
    "tensor": ["mesh.axes.data.size=2", "mesh.axes.fsdp.size=1", "mesh.axes.tensor.size=4"],
}


def tiny_spec(*overrides: str, layout: str | None = None):
    """The default spec shrunk by TINY, then `layout` (a key of LAYOUTS), then `overrides`."""
    return load_spec(DEFAULT_SPEC_PATH, [*TINY, *LAYOUTS.get(layout, ()), *overrides])
