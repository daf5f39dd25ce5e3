"""`trainspec plan --published NAME`: a published model in the layout it was trained with, as
the sharded-decoder planner predicts it (trainspec.core.plan.sharded_decoder; the shapes,
layouts and their sources in trainspec.core.plan.published; docs/plan.md, "Published
architectures")."""
from __future__ import annotations

import dataclasses
import json

from trainspec.core.errors import UserInputError

def run(args, conflicting: list[str]) -> int:
    """The published layout `args.published` on its hardware (or --hardware); `conflicting`:
    the flags given that would change what ran, refused."""
    from trainspec.core.plan.hardware import load_profile
    from trainspec.core.plan.published import PUBLISHED
    from trainspec.core.plan.sharded_decoder import estimate

    if args.published not in PUBLISHED:
        raise UserInputError(f"--published: unknown {args.published!r}; known: "
                             f"{', '.join(PUBLISHED)}")
    if conflicting:
        raise UserInputError(f"--published plans the published layout as it ran; it cannot be "
                             f"combined with {', '.join(conflicting)}")
    shape, lay, hardware = PUBLISHED[args.published]
    profile = load_profile(args.hardware or hardware)
    e = estimate(shape, lay, profile)
    print(report(args.published, shape, e, profile))
    if args.json:
        args.json.write_text(json.dumps({
            "published": args.published, "hardware": profile.as_dict(),
            "layout": dataclasses.asdict(lay), "memory": e.memory, "comm_bytes": e.comm,
            "step_time_s": e.step_time_s, "compute_s": e.compute_s, "bubble_s": e.bubble_s,
            "exposed_comm_s": e.exposed_comm_s, "mfu": e.mfu, "fits": e.fits}, indent=1) + "\n")
    if not e.fits:
        raise UserInputError(f"--published {args.published}: {e.memory['total'] / 1e9:.1f} GB "
                             f"per device exceeds the {profile.memory_bytes / 1e9:.0f} GB of "
                             f"{profile.name}")
    return 0


def report(name: str, shape, e, profile) -> str:
    lay = e.layout
    sizes = " x ".join(f"{role} {size}" for role, size in lay.sizes.items())
    schedule = (f"{lay.schedule}" + (f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else "")
                if lay.size("pipeline") > 1 else "no pipeline")
    gb = {k: f"{v / 1e9:.2f}" for k, v in e.memory.items()}
    parts = ", ".join(f"{k} {v}" for k, v in gb.items() if k != "total")
    traffic = ", ".join(f"{role} {b / 1e9:.1f} GB" for role, b in e.comm.items() if b)
    return "\n".join([
        f"# trainspec plan --published {name}: {shape.name} ({shape.total_params / 1e9:.0f}B "
        f"parameters, {shape.active_params / 1e9:.0f}B active) on {lay.n_devices:,} "
        f"{profile.name}: {sizes}",
        f"# {lay.micro_batches} micro-batches of {lay.micro_batch} x {lay.seq_len:,} tokens a "
        f"replica; {schedule}; {f'ZeRO-{lay.zero}' if lay.zero else 'no ZeRO'}; "
        f"{'full recomputation' if lay.full_remat else 'no recomputation'}",
        f"memory per device {gb['total']} GB of {profile.memory_bytes / 1e9:.0f} "
        f"({parts}): {'fits' if e.fits else 'does not fit'}",
        f"step {e.step_time_s:.2f} s: compute {e.compute_s:.2f}, bubble {e.bubble_s:.2f}, "
        f"exposed communication {e.exposed_comm_s:.2f}; MFU {100 * e.mfu:.1f}%",
        f"bytes sent per device per step: {traffic}",
    ])
