"""The data all-reduce of the gradients while the backward still runs, as DDP overlaps it.

The trainable parameters, in reverse order (about the order in which the backward produces
their gradients), are cut into buckets of about BUCKET_BYTES. During the backward that
completes a step's gradients (`arm()` first: earlier micro-batches only accumulate), each
parameter's post-accumulate-grad hook marks it ready; a bucket whose parameters are all ready
is copied into its buffer (in `precision.grad_reduce`) and its all-reduce started, buckets
strictly in order, so that every rank issues the same collectives in the same order whatever
order its hooks fire in. The last bucket waits for `finish()`, after the backward: it carries
the step's scalars (`extra`: the loss sum and valid tokens, the noise scale's small batch),
which are then known, so that they cost no collective of their own. The gradients themselves
keep this rank's sums until `finish()` has waited for every bucket and copied the sums back:
what reads the local gradient after the backward (the noise scale's small batch) reads it
there.

Each bucket's buffer is allocated once, its slots views shaped like the parameters' local
blocks, and the gradients go in and come back in one multi-tensor copy per bucket (as DDP
copies its buckets into the gradients): a step costs a fixed handful of operations per bucket,
not a few per parameter, which is most of a small model's step on the host.

A parameter that took no gradient in the backward adds zeros, as in the packed reduction
(trainspec/torch/reduction.py, which the step uses where the reduction cannot overlap: under
FSDP2, whose reduce-scatters overlap already, and under compression, which cuts the whole
buffer in a fixed order).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from trainspec.torch.layout import local_block

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class OverlappedReduction:
    """Sums the trainable `params`' gradients over the data `group` as the backward makes
    them (sent in `grad_dtype`)."""

    def __init__(self, group, grad_dtype: torch.dtype, params, bucket_bytes: int = BUCKET_BYTES):
        self.group, self.grad_dtype = group, grad_dtype
        trainable = [p for p in params if p.requires_grad]
        self.buckets: list[list[torch.Tensor]] = [[]]
        size = 0
        for p in reversed(trainable):
            nbytes = local_block(p).numel() * grad_dtype.itemsize
            if self.buckets[-1] and size + nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self.flats: list[torch.Tensor] = []
        self.slots: list[list[torch.Tensor]] = []
        for bucket in self.buckets:
            self._allocate(len(self.flats), bucket, 0)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.tail = 0  # the last buffer's room for `finish`'s extra values
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in trainable]
        self.armed = False
        self._missing: list[int] = []
        self._launched: list = []  # the buckets' all-reduce works, in order

    def _allocate(self, index: int, bucket: list[torch.Tensor], tail: int) -> None:
        """Bucket `index`'s buffer, with `tail` more values after the gradients' slots."""
        blocks = [local_block(p) for p in bucket]
        device = blocks[0].device if blocks else None
        flat = torch.empty(sum(b.numel() for b in blocks) + tail, dtype=self.grad_dtype,
                           device=device)
        slots, offset = [], 0
        for block in blocks:
            slots.append(flat[offset: offset + block.numel()].view(block.shape))
            offset += block.numel()
        self.flats[index:index + 1], self.slots[index:index + 1] = [flat], [slots]

    def arm(self) -> None:
        """The next backward completes the step's gradients: reduce them as they come."""
        self.armed = True
        self._missing = [len(bucket) for bucket in self.buckets]
        self._launched = []

    def _ready(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        self._missing[self._bucket_of[id(p)]] -= 1
        # every bucket but the last, in order, as soon as it and those before it are whole
        while len(self._launched) < len(self.buckets) - 1 and not self._missing[len(self._launched)]:
            self._launch(len(self._launched))

    def _held(self, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list]:
        """Bucket `index`'s (slots, local gradient blocks) of the parameters that have a
        gradient, and the slots of those that took none."""
        slots, grads, empty = [], [], []
        for p, slot in zip(self.buckets[index], self.slots[index]):
            if p.grad is None:
                empty.append(slot)
            else:
                slots.append(slot)
                grads.append(local_block(p.grad))
        return slots, grads, empty

    def _launch(self, index: int, extra: torch.Tensor | None = None) -> None:
        slots, grads, empty = self._held(index)
        if grads:
            torch._foreach_copy_(slots, grads)
        if empty:  # a parameter that took no gradient adds zeros
            torch._foreach_zero_(empty)
        flat = self.flats[index]
        if extra is not None:
            flat[flat.numel() - self.tail:].copy_(extra)
        self._launched.append(dist.all_reduce(flat, group=self.group, async_op=True))

    def finish(self, extra: torch.Tensor | None = None) -> torch.Tensor | None:
        """After the backward: start what is left (the last bucket, with `extra`, a float32
        vector summed with the gradients where they travel in float32, else on its own),
        wait, and put the sums into the gradients. Returns `extra` summed over the group."""
        self.armed = False
        rides = extra is not None and self.grad_dtype == torch.float32
        if rides and self.tail != extra.numel():  # room in the last buffer, made once
            self.tail = extra.numel()
            self._allocate(len(self.buckets) - 1, self.buckets[-1], self.tail)
        while len(self._launched) < len(self.buckets):
            last = len(self._launched) == len(self.buckets) - 1
            self._launch(len(self._launched), extra if last and rides else None)
        alone = None
        if extra is not None and not rides:
            alone = extra.clone()
            dist.all_reduce(alone, group=self.group)
        for index, work in enumerate(self._launched):
            work.wait()
            slots, grads, _ = self._held(index)
            if grads:
                torch._foreach_copy_(grads, slots)
        if not rides:
            return alone
        flat = self.flats[-1]
        return flat[flat.numel() - self.tail:].clone()  # the buffer is the next step's
