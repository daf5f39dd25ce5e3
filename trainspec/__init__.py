"""trainspec: a framework-neutral spec for running model training on accelerators.

One trunk, sibling implementations:

- `trainspec.core`: the spec itself, framework-free (schema, mesh resolution, records, formulas,
  health decisions, conformance cases, run files, the adapter interface);
- `trainspec.jax`: the reference implementation on JAX/XLA (`wrap`, `loss_step`, `grad_step`);
- `trainspec.torch`: the implementation on PyTorch (torch.distributed, FSDP2, DTensor);
- `trainspec.report`: reports over metrics files, whichever framework wrote them;
- `trainspec.cli`: the `trainspec` command, above all of them.

Importing this package imports no framework.
"""
from trainspec.core.errors import UserInputError
from trainspec.core.spec import Spec, default_spec, load_spec

__all__ = ["Spec", "UserInputError", "default_spec", "load_spec"]
