"""`spec_jax`, the package's old name, stays importable for one release: it warns, and its
names are the trainspec modules themselves, not copies."""
import subprocess
import sys

CODE = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import spec_jax
import spec_jax.core.spec, spec_jax.step, spec_jax.adapters.torch_step, spec_jax.conformance
import trainspec.core.spec, trainspec.jax.step, trainspec.torch.step, trainspec.core.conformance_runner
from spec_jax.adapters import torch_collectives
import trainspec.jax, trainspec.torch.collectives
assert any(issubclass(w.category, DeprecationWarning) and "trainspec" in str(w.message) for w in caught)
assert spec_jax.core.spec is trainspec.core.spec
assert spec_jax.step is trainspec.jax.step and spec_jax.step.__spec__.name == "trainspec.jax.step"
assert spec_jax.adapters.torch_step is trainspec.torch.step
assert spec_jax.conformance is trainspec.core.conformance_runner
assert torch_collectives is trainspec.torch.collectives
assert spec_jax.wrap is trainspec.jax.wrap and spec_jax.load_spec is trainspec.core.spec.load_spec
try:
    import spec_jax.no_such_module
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("an unknown old name imported")
print("ok")
"""


def test_the_old_name_warns_and_gives_the_new_modules():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"
