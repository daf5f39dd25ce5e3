"""Deprecated alias of trainspec, kept for one release: `spec_jax` became `trainspec`.

`import spec_jax` warns once and gives the JAX implementation's entry points (`wrap`,
`loss_step`, `grad_step`, `build_mesh`, `load_spec`, ...); `spec_jax.X` submodules resolve to
their new homes (`spec_jax.core.spec` is `trainspec.core.spec`, `spec_jax.step` is
`trainspec.jax.step`, `spec_jax.adapters.torch_step` is `trainspec.torch.step`), the same module
objects, not copies. New code imports trainspec.core, trainspec.jax or trainspec.torch.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

warnings.warn("spec_jax is deprecated and will be removed in the next release: import trainspec.jax "
              "(or trainspec.core, trainspec.torch) instead", DeprecationWarning, stacklevel=2)

# Where each old module lives now; a name not listed moved from spec_jax.X to trainspec.jax.X.
MOVED = {
    "spec_jax.core": "trainspec.core",
    "spec_jax.cli": "trainspec.cli",
    "spec_jax.run_files": "trainspec.core.run_files",
    "spec_jax.launch": "trainspec.core.launch",
    "spec_jax.conformance": "trainspec.core.conformance_runner",
    "spec_jax.adapters.base": "trainspec.core.adapter",
    "spec_jax.adapters.jax": "trainspec.jax.conformance",
    "spec_jax.adapters.torch": "trainspec.torch.runtime",
    "spec_jax.adapters.torch_checkpoint": "trainspec.torch.checkpoint",
    "spec_jax.adapters.torch_collectives": "trainspec.torch.collectives",
    "spec_jax.adapters.torch_model": "trainspec.torch.models.transformer",
    "spec_jax.adapters.torch_step": "trainspec.torch.step",
    "spec_jax.adapters.torch_support": "trainspec.torch.support",
    "spec_jax.adapters.torch_train": "trainspec.torch.train",
    "spec_jax.adapters": "trainspec.adapters",
    "spec_jax.models.transformer_flops": "trainspec.core.transformer_flops",
    "spec_jax.metrics.plots": "trainspec.report.plots",
    "spec_jax.tools.metrics_report": "trainspec.report.metrics_report",
    "spec_jax.tools.report_page": "trainspec.report.page",
}


def new_name(old: str) -> str:
    """The trainspec module an old spec_jax module name refers to (longest moved prefix wins)."""
    parts = old.split(".")
    for n in range(len(parts), 1, -1):
        head = ".".join(parts[:n])
        if head in MOVED:
            return ".".join([MOVED[head], *parts[n:]])
    return ".".join(["trainspec.jax", *parts[1:]])


class _AliasLoader(importlib.abc.Loader):
    """Gives the moved module itself. The import system sets the alias's spec on the module it
    is given; exec_module puts the module's own back, so the module keeps its one identity."""

    def create_module(self, spec):
        module = importlib.import_module(new_name(spec.name))
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._own_spec  # the target module ran when it was imported


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("spec_jax."):
            return None
        if fullname == "spec_jax.adapters":  # the old package of both implementations: a namespace
            return importlib.util.spec_from_loader(fullname, None, is_package=True)
        if importlib.util.find_spec(new_name(fullname)) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader())


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())


def __getattr__(name: str):
    return getattr(importlib.import_module("trainspec.jax"), name)
