"""Implementations of the spec behind one interface (base.py, normative in docs/adapters.md).

`jax`: the reference implementation's collectives backends (xla, ext, hierarchical);
`torch*`: PyTorch on torch.distributed (gloo on CPU, NCCL on GPU). The torch modules import no
jax and the jax module imports no torch; both build on spec_jax.core.
"""
