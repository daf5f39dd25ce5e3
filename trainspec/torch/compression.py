"""`collectives.compression` on torch: the data all-reduce of the gradient, compressed, with error
feedback (docs/communication.md).

The rule and its float64 reference are trainspec.core.compression; the float32 arithmetic of
the quantizers is trainspec.core.packed's, computed here bit for bit (as the JAX kernels and the
xla_ext handlers compute it), and each chunk travels as one packed buffer of that module's
byte layout. The exchange is core.compression's two stages over the data group: an all-to-all
of every replica's compressed chunks, a float32 sum of each chunk on its owner in rank order,
and an all-gather of the compressed sums; every replica decodes the same bytes, so all hold the
same sum bit for bit. Each replica keeps what both stages lost on its part in a float32
residual and sends it with its next gradient (`collectives.error_feedback`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from trainspec.core.compression import INT8_MAX, chunk_size
from trainspec.core.packed import HEADER_BYTES, INT8_INV_MAX, blocks, header

SCALE_MASK = -128  # core.packed.SCALE_MASK (0xFFFFFF80) as an int32


def quantize_int8(rows: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 scales (m, blocks), int8 payload (m, blocks, block)) of float32 rows (m, n),
    each zero-padded to whole blocks: core.packed.quantize_int8's arithmetic, row by row."""
    m, n = rows.shape
    padded = torch.zeros(m, blocks(n, block) * block, dtype=torch.float32, device=rows.device)
    padded[:, :n] = rows
    grouped = padded.reshape(m, -1, block)
    scales = grouped.abs().amax(dim=2) * float(INT8_INV_MAX)  # float32 x fl(1/127)
    scales = (scales.view(torch.int32) & SCALE_MASK).view(torch.float32)
    inverse = 1.0 / torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(grouped * inverse[..., None])  # half to even, as rint
    q = torch.where(q.isnan(), torch.zeros_like(q), q.clamp(-INT8_MAX, INT8_MAX))
    return scales, q.to(torch.int8)


def encode(rows: torch.Tensor, compression: str, block: int) -> torch.Tensor:
    """Each float32 row (m, n) as the packed buffer core.packed.pack makes of it: (m, bytes)
    uint8."""
    m, n = rows.shape
    head = torch.from_numpy(header(n, compression, block)).to(rows.device).expand(m, -1)
    if compression == "bf16":
        payload = torch.zeros(m, n + n % 2, dtype=torch.bfloat16, device=rows.device)
        payload[:, :n] = rows
        body = [payload.view(torch.uint8)]
    else:
        scales, q = quantize_int8(rows, block)
        body = [scales.view(torch.uint8), q.reshape(m, -1).view(torch.uint8)]
    return torch.cat([head, *body], dim=1)


def decode(wire: torch.Tensor, compression: str, block: int, n: int) -> torch.Tensor:
    """float32 rows (m, n) of packed buffers (m, bytes) of `n` elements each."""
    body = wire[:, HEADER_BYTES:]
    if compression == "bf16":
        return body.contiguous().view(torch.bfloat16)[:, :n].float()
    nb = blocks(n, block)
    scales = body[:, :4 * nb].contiguous().view(torch.float32)
    q = body[:, 4 * nb:].contiguous().view(torch.int8).reshape(-1, nb, block).float()
    return (q * scales[..., None]).reshape(q.shape[0], -1)[:, :n]  # exact: 7 x 17 bits


class CompressedSum:
    """The data all-reduce of one rank's flat float32 gradient, compressed. With error feedback
    the rank's residual lives here from step to step (`residual`, None until the first): a
    call leaves the new one `pending`, and `commit(take)` keeps it where the step's update is taken
    (a step the non-finite guard skips changes no state, its residual included)."""

    def __init__(self, compression: str, block: int, error_feedback: bool, group):
        self.compression, self.block, self.error_feedback = compression, block, error_feedback
        self.group = group
        self.replicas, self.me = dist.get_world_size(group), dist.get_rank(group)
        self.residual: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None

    def commit(self, take: torch.Tensor | bool = True) -> None:
        """Keep the pending residual where `take` (True, or a bool tensor decided on the
        device)."""
        if self.pending is None:
            return
        if take is not True:
            kept = self.residual if self.residual is not None else torch.zeros_like(self.pending)
            self.pending = torch.where(take, self.pending, kept)
        self.residual, self.pending = self.pending, None

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over the group of every replica's compressed `flat + residual` (float32)."""
        n, size = self.replicas, flat.numel()
        chunk = chunk_size(size, n, self.compression, self.block)
        rows = torch.zeros(n * chunk, dtype=torch.float32, device=flat.device)
        rows[:size] = flat
        if self.error_feedback and self.residual is not None:
            if self.residual.numel() != size:
                raise RuntimeError(f"the error-feedback residual holds {self.residual.numel()} "
                                   f"elements and the gradient {size}: its parameters changed")
            rows[:size] += self.residual
        rows = rows.reshape(n, chunk)
        wire = encode(rows, self.compression, self.block)
        received = torch.empty_like(wire)
        dist.all_to_all_single(received, wire, group=self.group)
        pieces = decode(received, self.compression, self.block, chunk)
        shard = pieces[0].clone()
        for piece in pieces[1:]:  # in rank order, as core.compression.two_stage_sum
            shard += piece
        shard_wire = encode(shard[None], self.compression, self.block)
        gathered = torch.empty(n * shard_wire.numel(), dtype=torch.uint8, device=flat.device)
        dist.all_gather_single(gathered, shard_wire.reshape(-1), group=self.group)
        total = decode(gathered.view(n, -1), self.compression, self.block, chunk).reshape(-1)[:size]
        if self.error_feedback:  # stage 1 lost owed[me] of every row; stage 2 lost on my chunk
            owed = rows - decode(wire, self.compression, self.block, chunk)
            owed[self.me] += shard - decode(shard_wire, self.compression, self.block, chunk)[0]
            self.pending = owed.reshape(-1)[:size].clone()
        return total

