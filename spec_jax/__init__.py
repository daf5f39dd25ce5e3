"""trainspec's reference implementation on JAX/XLA."""
