"""The data reduction overlapped with the backward (trainspec/torch/overlap.py), on a job of
one rank, where a sum over the data group is the rank's own value: cut into several buckets,
every gradient comes back as it went in (in float32; rounded to bfloat16 where it travels so),
a parameter that took no gradient keeps none, the values riding with the gradients come back,
and the operations `finish` runs do not grow with the number of parameters (one copy in and
one out per bucket). The reference models' gradients fit one bucket, so the equality tests
never cut several."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from trainspec.torch.overlap import OverlappedReduction
from trainspec.torch.runtime import TorchRuntime


@pytest.fixture(scope="module")
def world():
    adapter = TorchRuntime()
    adapter.join()  # no launcher in the environment: a job of one rank
    yield dist.group.WORLD
    adapter.leave()


def layers(n: int) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(n)))
    model.register_parameter("unused", nn.Parameter(torch.ones(3)))  # takes no gradient
    return model


def backward(model: nn.Module) -> None:
    model(torch.arange(16.0).reshape(2, 8) / 16).square().sum().backward()


class OpCount(TorchDispatchMode):
    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_buckets_return_each_gradient_and_the_riding_values(world, grad_dtype):
    model = layers(6)
    params = list(model.parameters())
    # a bucket holds one layer's weight and bias (72 values)
    reduction = OverlappedReduction(world, grad_dtype, params,
                                    bucket_bytes=75 * grad_dtype.itemsize)
    assert len(reduction.buckets) > 3
    backward(model)  # not armed: the hooks only let the gradients accumulate
    alone = [None if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    reduction.arm()
    backward(model)
    extra = torch.tensor([3.0, 7.0, 0.5])
    summed = reduction.finish(extra)
    assert torch.equal(summed, extra)
    for p, before in zip(params, alone):
        if before is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, before.to(grad_dtype).float())


def test_finish_runs_as_many_operations_for_more_parameters(world):
    counts = []
    for n in (2, 8):
        model = layers(n)
        reduction = OverlappedReduction(world, torch.float32, list(model.parameters()))
        for _ in range(2):  # the second step: the riding values' room is made once
            reduction.arm()
            backward(model)
            with OpCount() as ops:
                reduction.finish(torch.ones(4))
        counts.append(ops.count)
    assert counts[0] == counts[1]
