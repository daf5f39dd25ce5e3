"""The two backends are mirrors: each part of the backend contract (trainspec.core.backend) is a
module (or package) of the same name in trainspec/jax and trainspec/torch, and each package
registers a Backend object of that contract."""
from pathlib import Path

import trainspec
from trainspec.core import registry
from trainspec.core.backend import Backend

# runtime, mesh, engine, checkpoint (the store), capabilities, collectives: the contract's
# parts; step: the wrapped step a user's model goes through; models, train, run: the reference
# models, the reference job and the run services for a user's loop; conformance: the suite's
# view; backend: the registration.
PARTS = ("backend", "runtime", "mesh", "engine", "checkpoint", "capabilities", "collectives",
         "step", "models", "train", "run", "conformance")


def test_the_reference_models_are_the_same_modules():
    """models/ holds the same model modules in both trees (the transformer and its MoE MLP
    among them)."""
    jax, torch = (_modules(f"{name}/models") for name in ("jax", "torch"))
    assert jax == torch and {"transformer", "moe"} <= jax
ROOT = Path(trainspec.__file__).parent


def _modules(package: str) -> set[str]:
    folder = ROOT / package
    return ({p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
            | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()})


def test_both_trees_have_every_part():
    jax, torch = _modules("jax"), _modules("torch")
    assert {part for part in PARTS if part not in jax} == set()
    assert {part for part in PARTS if part not in torch} == set()


def test_the_check_fails_on_a_missing_part(tmp_path, monkeypatch):
    """A tree without one part's module is caught (the check reads the files it is given)."""
    for name in ("jax", "torch"):
        (tmp_path / name).mkdir()
        for part in PARTS:
            if not (name == "torch" and part == "mesh"):
                (tmp_path / name / f"{part}.py").write_text("")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert "mesh" in _modules("jax") and "mesh" not in _modules("torch")


def test_each_backend_module_registers_a_backend():
    for name in ("jax", "torch"):
        found = registry.backend(name)
        assert isinstance(found, Backend)
        assert type(found).__module__ == f"trainspec.{name}.backend"


def test_every_run_resumes_through_the_trunks_one_signature():
    """`Run.resume(init_fn=None, *args)` is defined once, in the trunk: each backend's Run says
    only what its step's state is (`_resume_job`)."""
    from trainspec.core.run import Run
    from trainspec.jax.run import Run as JaxRun
    from trainspec.torch.run import Run as TorchRun

    for backend_run in (JaxRun, TorchRun):
        assert issubclass(backend_run, Run) and backend_run.resume is Run.resume
        assert "_resume_job" in vars(backend_run)


def _methods(part) -> list[str]:
    return [name for name, value in vars(part).items()
            if callable(value) and (name == "__call__" or not name.startswith("_"))]


def test_each_engine_implements_every_part_of_the_engine():
    """trainspec.core.backend.Engine is made of small parts; both backends' engines have each
    part's methods (a part's attributes are set per instance)."""
    from trainspec.core import backend
    from trainspec.jax.engine import JaxEngine
    from trainspec.torch.engine import TorchEngine

    parts = (backend.Stepping, backend.HostValues, backend.Tracing, backend.FiniteChecks,
             backend.ReplicaChecks, backend.JobProcesses)
    engine_methods = {name for name in dir(backend.Engine)
                      if name == "__call__" or not name.startswith("_")}
    assert sorted(name for part in parts for name in _methods(part)) == sorted(engine_methods)
    for part in parts:
        for engine in (JaxEngine, TorchEngine):
            missing = [name for name in _methods(part) if not hasattr(engine, name)]
            assert not missing, (engine.__name__, part.__name__, missing)
