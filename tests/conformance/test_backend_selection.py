"""How an op finds its backend: per call, a scoped `use_backend`, or the process default."""
from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from trainspec.jax import collectives
from trainspec.jax.collectives import api
from trainspec.core.errors import UserInputError


@pytest.fixture
def calls(monkeypatch):
    """Record which backend module's all_reduce each traced call reaches (a fake 'ext', so this
    runs whether or not the extension is built)."""
    seen = []

    class Fake:
        def __init__(self, name):
            self.name = name

        def all_reduce(self, x, axis_name, op="sum", *, timeout_s=None, in_place=False):
            seen.append(self.name if timeout_s is None else (self.name, timeout_s))
            return x

    monkeypatch.setattr(api, "get_backend", lambda name=None: Fake(name or api.current_backend()))
    monkeypatch.setattr(api, "_default_backend", "xla")
    return seen


def _trace(**kwargs):
    mesh = Mesh(np.array(jax.devices()), ("i",))
    fn = jax.shard_map(lambda v: collectives.all_reduce(v, "i", **kwargs), mesh=mesh,
                       in_specs=P("i"), out_specs=P("i"), check_vma=False)
    jax.jit(fn).lower(np.zeros(8, np.float32))


def test_precedence_call_then_scope_then_default(calls):
    _trace()
    collectives.set_default_backend("ext")
    _trace()
    with collectives.use_backend("xla"):
        _trace()
        _trace(backend="ext")
    _trace()
    assert calls == ["xla", "ext", "xla", "ext", "ext"]


def test_a_scope_s_timeout_applies_where_the_call_names_none(calls):
    """The wrapped step traces the model under use_backend(backend, timeout_s): the model's
    collectives (the experts' all-to-alls) then wait the spec's timeout."""
    with collectives.use_backend("ext", timeout_s=7):
        _trace()
        _trace(timeout_s=3)
        with collectives.use_backend("xla"):
            _trace()
    assert calls == [("ext", 7), ("ext", 3), "xla"]


@pytest.mark.parametrize("select", [
    lambda: collectives.set_default_backend("nccl"),
    lambda: collectives.use_backend("nccl").__enter__(),
    lambda: collectives.get_backend("nccl"),
])
def test_unknown_backend_is_a_user_error_naming_it(select):
    with pytest.raises(UserInputError, match="'nccl'.*known: xla, ext"):
        select()


def test_xla_backend_does_not_import_ext():
    """ext is imported only when chosen, so xla works where the extension is not built."""
    code = ("import sys; from trainspec.jax import collectives; collectives.get_backend('xla'); "
            "assert 'trainspec.jax.collectives.xla' in sys.modules; "
            "assert 'trainspec.jax.collectives.ext' not in sys.modules, 'ext imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
