"""The health decisions of the spec (docs/reliability.md), framework-free.

- the non-finite (NaN) policy as a state machine over a small guard record, written with array
  operators and a `where` function only, so that one definition runs on the host (NumPy) and
  inside a compiled step (jax.numpy);
- the replica fingerprint vote: copies of one shard that differ from the majority of their copies;
- the straggler rule: median + k * MAD over a window of per-participant step timings.

Implementations measure (is the step finite, the fingerprints, the timings) and feed them here.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Sequence

import numpy as np

from trainspec.core.spec_health import NanSpec, StragglerSpec


class HealthHalt(RuntimeError):
    """A guard stopped the run. `last_good_step` is the step whose state is known good."""

    def __init__(self, message: str, last_good_step: int):
        super().__init__(message)
        self.last_good_step = last_good_step


class ReplicaMismatch(HealthHalt):
    """Replicas that should hold identical bytes do not; `devices` are the diverged ones."""

    def __init__(self, message: str, last_good_step: int, devices: list[int]):
        super().__init__(message, last_good_step)
        self.devices = devices


# -- non-finite steps -------------------------------------------------------------------------

def init_nan_guard(step: int = 0, skipped: int = 0, consecutive: int = 0) -> dict[str, np.int32]:
    """The guard record; `step` is the number of steps already taken (the data position);
    `skipped`, `consecutive`: the counts a resumed run carries on (from its checkpoint)."""
    return {
        "step": np.int32(step),          # steps taken through this guard
        "skipped": np.int32(skipped),    # non-finite steps dropped, total
        "consecutive": np.int32(consecutive),  # ... in a row, up to the last step
        "tripped_at": np.int32(-1),      # step (1-based) at which the guard halted; -1 = not
    }


def rolls_back(policy: NanSpec) -> bool:
    """Whether non-finite steps are judged by the run loop and rolled back from
    (`health.nan.policy = "rollback"`, trainspec.core.bad_steps) rather than dropped or halted
    on by the step's own guard: every layer asks this, none reads the policy itself."""
    return policy.policy == "rollback"


def nan_guard_step(policy: NanSpec, guard: dict, finite, where: Callable = np.where):
    """(new guard, take) after one step whose loss and gradients are `finite` (a bool array).

    `take`: whether the step's update is kept. Under `skip`, up to `max_consecutive_skips`
    non-finite steps in a row are dropped and the next one trips the guard; under `rollback`
    every update is taken (trainspec.core.bad_steps judges it later); under `halt` the
    first one trips it. Once tripped the guard takes no further update, so the state it keeps is
    the one before the first bad step, however many steps ran after it. `guard` values are
    integer arrays (NumPy, jax.numpy or torch tensors); `where` is that library's `where`.
    """
    if rolls_back(policy):  # every update is kept: the run loop judges the step
        return {**guard, "step": guard["step"] + 1}, True
    step = guard["step"] + 1
    consecutive = where(finite, 0, guard["consecutive"] + 1)
    limit = 0 if policy.policy == "halt" else policy.max_consecutive_skips
    was_tripped = guard["tripped_at"] >= 0
    trips = ~was_tripped & (consecutive > limit)
    take = finite & ~was_tripped
    new = {
        "step": step,
        "skipped": where(finite | was_tripped, guard["skipped"], guard["skipped"] + 1),
        "consecutive": where(was_tripped, guard["consecutive"], consecutive),
        "tripped_at": where(trips, step, guard["tripped_at"]),
    }
    return new, take


def check_nan_guard(policy: NanSpec, guard: dict) -> int:
    """At a host sync: raise HealthHalt if the guard tripped; else the number of skipped steps."""
    g = {k: int(v) for k, v in guard.items()}
    if g["tripped_at"] < 0:
        return g["skipped"]
    bad = g["tripped_at"]
    if policy.policy == "halt":
        why = "health.nan.policy = halt"
    else:
        why = (f"more than health.nan.max_consecutive_skips = "
               f"{policy.max_consecutive_skips} consecutive non-finite steps")
    # Where the state of step bad - 1 is kept (if anywhere) is for the caller to add.
    raise HealthHalt(f"non-finite loss, gradients or state at step {bad} ({why})",
                     last_good_step=bad - 1)


def nan_guard_counts(guard: dict) -> dict[str, int]:
    """The counts a checkpoint of the guarded state carries: as of the last step taken (a
    tripped guard froze the state before the step that tripped it, so that one is not counted)."""
    g = {k: int(v) for k, v in guard.items()}
    tripped = int(g["tripped_at"] >= 0)
    return {"skipped_steps": g["skipped"] - tripped,
            "consecutive_nonfinite": g["consecutive"] - tripped}


# -- replica fingerprints ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Divergence:
    leaf: str             # path of the state array, e.g. .params['Dense_0']['kernel']
    devices: tuple[int, ...]
    replicas: tuple[int, ...]  # data-parallel replica index of each device
    copies: int           # how many devices hold this shard

    def describe(self) -> str:
        who = ", ".join(f"replica {r} (device {d})" for r, d in zip(self.replicas, self.devices))
        return f"{who} diverged on {self.leaf} ({self.copies} copies of the shard)"


def odd_copies(words: Sequence[bytes]) -> list[int]:
    """Indices of the copies that differ from the majority. Without a unique majority (two
    copies, or a tie) no copy can be trusted over another: all of them are named."""
    counts = collections.Counter(words)
    if len(counts) == 1:
        return []
    top, n_top = counts.most_common(1)[0]
    unique_majority = list(counts.values()).count(n_top) == 1
    return [i for i, w in enumerate(words) if not unique_majority or w != top]


def replica_index(coords: Sequence[int], axis_names: Sequence[str], shape: Sequence[int],
                  data_axes: Sequence[str]) -> int:
    """Index of the data-parallel replica at mesh `coords` (row-major over the data axes)."""
    index = 0
    for c, a, n in zip(coords, axis_names, shape):
        if a in data_axes:
            index = index * n + c
    return index


def diverged_copies(fingerprints: np.ndarray, device_ids: np.ndarray, axis_names: Sequence[str],
                    leaves: Sequence[tuple[str, Sequence[str]]],
                    data_axes: Sequence[str]) -> list[Divergence]:
    """Copies of the same shard that differ from the majority of their copies.

    `fingerprints[*mesh, leaf]` is each device's fingerprint (any fixed-size words) of its shard
    of each leaf; `device_ids[*mesh]` names the devices; `leaves[i]` = (path, mesh axes leaf i
    is split over). Devices that agree on the coordinates of the split axes hold the same shard.
    """
    shape = device_ids.shape
    found = []
    for i, (path, split) in enumerate(leaves):
        groups = collections.defaultdict(list)  # shard (coords on split axes) -> its copies
        for coords in itertools.product(*(range(n) for n in shape)):
            shard = tuple(c for c, a in zip(coords, axis_names) if a in split)
            groups[shard].append(coords)
        for copies in groups.values():
            odd = [copies[j] for j in odd_copies([fingerprints[c + (i,)].tobytes() for c in copies])]
            if odd:
                found.append(Divergence(
                    path, tuple(int(device_ids[c]) for c in odd),
                    tuple(replica_index(c, axis_names, shape, data_axes) for c in odd), len(copies),
                ))
    return found


# -- stragglers -------------------------------------------------------------------------------

def outlier_threshold(values: np.ndarray, k: float, min_excess: float = 0.0) -> float:
    """median + max(k * MAD, min_excess * median): above it, a value is an outlier."""
    values = np.asarray(values, dtype=np.float64)
    median = float(np.median(values))
    mad = float(np.median(np.abs(values - median)))
    return median + max(k * mad, min_excess * median)


class StragglerDetector:
    """Rule (robust to the outliers it looks for): over the last `window` steps, a participant
    whose median time exceeds median + k * MAD of all participants' medians is a straggler; a
    step whose time (slowest participant) exceeds median + k * MAD of the window's step times is
    a slow step. Both also need to exceed the median by `min_excess` (relative), because the MAD
    of near-identical timings is ~0 and would flag jitter."""

    def __init__(self, spec: StragglerSpec, participants: Sequence[str]):
        self.spec, self.participants = spec, list(participants)
        self.window: collections.deque[np.ndarray] = collections.deque(maxlen=spec.window)
        self.slow_steps: list[int] = []
        self.flagged: collections.Counter[str] = collections.Counter()

    def observe(self, step: int, times: Sequence[float]) -> None:
        """One step's time per participant (seconds, in `participants` order)."""
        times = np.asarray(times, dtype=np.float64)
        if len(self.window) >= 3:  # judge the step against the window before it joins
            history = np.array([t.max() for t in self.window])
            if times.max() > outlier_threshold(history, self.spec.k, self.spec.min_excess):
                self.slow_steps.append(step)
        self.window.append(times)
        for name in self.stragglers():
            self.flagged[name] += 1

    def stragglers(self) -> list[str]:
        """Participants whose windowed median is an outlier among all participants' medians."""
        if len(self.participants) < 3 or len(self.window) < 3:
            return []  # with one or two participants there is no majority to compare against
        medians = np.median(np.stack(self.window), axis=0)
        limit = outlier_threshold(medians, self.spec.k, self.spec.min_excess)
        return [p for p, m in zip(self.participants, medians) if m > limit]

    def report(self) -> dict:
        """For metrics records and the run summary."""
        medians = np.median(np.stack(self.window), axis=0) if self.window else []
        return {
            "stragglers": self.stragglers(),
            "straggler_steps": dict(self.flagged),
            "slow_steps": list(self.slow_steps),
            "median_step_time_s": {p: float(m) for p, m in zip(self.participants, medians)},
        }
