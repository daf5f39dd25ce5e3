"""One process of the conformance suite run across processes (test_multiprocess_conformance.py).

Run under `trainspec launch --nprocs 2 -- python multiprocess_worker.py BACKEND`: each process
presents 4 CPU devices, joins the jax.distributed job from the TRAINSPEC_* variables, and calls
the suite's own test functions (same cases, same NumPy references, same tolerances) on meshes
whose first axis `p` is the process. Every process runs the same checks in the same order (the
collectives are SPMD across processes) and fetches whole results (`_host`), so both reach the
same verdicts. Prints one `RESULT` line; exits 1 if any check failed.

A hang does not wait out the test's timeout in silence: joining the job and each check run
under a watchdog that prints which it was and every thread's stack (`faulthandler`), then
exits, so the launcher stops the other process. gloo (through the XLA flag below) times out
first and raises; the watchdog is for what has no timeout.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # the suite's checks, and tests/xla_env.py

from xla_env import DEVICE_COUNT_FLAG, without_device_count  # noqa: E402

# 4 devices per process; the suite's other XLA flags are kept. XLA:CPU's collectives across
# processes (gloo) wait for a missing peer far longer by default; here they fail after 60 s
# ("Gloo all-reduce failed: ... Timed out waiting 60000ms"), before the watchdog below.
os.environ["XLA_FLAGS"] = (f"{without_device_count()['XLA_FLAGS']} {DEVICE_COUNT_FLAG}=4 "
                           "--xla_cpu_collective_timeout_seconds=60").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# No persistent compilation cache (the suite's conftest sets one for its processes). Shared by
# the two processes of this job on jaxlib 0.12.1, it made the cross-process permute of the
# `both_reversed` layout hang: rank 0's gloo recv timed out, rank 1 waited on (2 runs of 2 with
# a fresh cache directory; 0 of 15 without one).
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)

import jax  # noqa: E402

from trainspec.jax.runtime import initialize_from_env  # noqa: E402

HANG_STATUS = 3  # the exit status of a process whose watchdog fired (a failed check: 1)

# Alone a check takes well under a second and the whole run under a minute (2 loaded cores).
WATCHDOG_S = 90
# The other process's watchdog, started within milliseconds of this one's (the checks meet in
# collectives), fires in this time too: both stacks are printed before either exits.
BOTH_DUMPED_S = 15


class Watchdog:
    """`with Watchdog(what):` exits the process, saying `what` and dumping every thread's
    stack, if the block runs longer than WATCHDOG_S."""

    def __init__(self, what: str):
        self.what, self.timer = what, threading.Timer(WATCHDOG_S, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        print(f"HANG {self.what}: still running after {WATCHDOG_S} s; stacks:", flush=True)
        faulthandler.dump_traceback(sys.stdout, all_threads=True)
        sys.stdout.flush()
        time.sleep(BOTH_DUMPED_S)
        os._exit(HANG_STATUS)

    def __enter__(self):
        self.timer.start()

    def __exit__(self, *exc):
        self.timer.cancel()


with Watchdog("joining the 2-process job"):
    assert initialize_from_env(), "run me under `trainspec launch --nprocs 2`"
    assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.device_count())

import pytest  # noqa: E402

import test_collectives_conformance as suite  # noqa: E402

Layout = suite.Layout
# Meshes over the 8 devices of both processes; jax.devices() lists process 0's devices first,
# so the leading axis `p` is the process (checked below). The group of each layout decides the
# path through the hierarchical backend: both stages, in-process only (ext), across only (lax).
LAYOUTS = [
    Layout("both", (2, 4), ("p", "l"), ("p", "l")),           # the full hierarchy, n = 8
    Layout("both_3d", (2, 2, 2), ("p", "a", "b"), ("p", "b")),  # part of the local axes, n = 4
    Layout("both_reversed", (2, 4), ("p", "l"), ("l", "p")),  # rank order != mesh order
    Layout("local", (2, 4), ("p", "l"), ("l",)),
    Layout("across", (2, 4), ("p", "l"), ("p",)),
]
# The suite's fixed-layout tests use LAYOUTS[0] (16-bit sums, integer means, bits) and
# LAYOUTS[1] (vmap): point them at the hierarchical layouts.
suite.LAYOUTS = LAYOUTS


def checks(backend):
    """(name, thunk) for every check, the same list in every process."""
    for lay in LAYOUTS:
        dtypes = suite.DTYPES if lay.name == "both" else ["float32"]
        for case in suite.CASES:
            for dtype in dtypes:
                if not (dtype == "int32" and case.needs_float):
                    yield (f"forward {case.id} {dtype} {lay.name}", lay,
                           lambda c=case, d=dtype, l=lay: suite.test_matches_reference(backend, c, d, l))
    for lay in LAYOUTS[:3]:
        for case in suite.LINEAR_CASES:
            yield (f"gradient {case.id} {lay.name}", lay,
                   lambda c=case, l=lay: suite.test_gradient_matches_analytic(backend, c, l))
    for case in suite.CASES:
        yield (f"vmap {case.id}", LAYOUTS[1],
               lambda c=case: suite.test_vmap_inside_shard_map(backend, c))
        if case.op in ("all_gather", "broadcast", "permute", "all_to_all"):
            yield (f"bits {case.id}", LAYOUTS[0],
                   lambda c=case: suite.test_data_movement_preserves_bits(backend, c))
    for op in ("all_reduce", "reduce_scatter"):
        for dtype in ("bfloat16", "float16"):
            yield (f"16-bit {op} {dtype}", LAYOUTS[0],
                   lambda o=op, d=dtype: suite.test_16bit_sums_accumulate_in_f32(backend, o, d))
        yield (f"int mean {op}", LAYOUTS[0],
               lambda o=op: suite.test_mean_of_integers_is_rejected(backend, o))
        yield (f"determinism {op}", LAYOUTS[0],
               lambda o=op: suite.test_deterministic_backends_are_bitwise_repeatable(backend, o))
    for illegal in suite.ILLEGAL:
        yield (f"illegal {illegal[0]} {illegal[3]}", LAYOUTS[0],
               lambda i=illegal: suite.test_rejects_illegal_calls(backend, *i, LAYOUTS[0]))


def main(backend: str) -> int:
    procs = [[d.process_index for d in row] for row in suite._mesh((2, 4), ("p", "l")).devices]
    assert procs == [[0] * 4, [1] * 4], f"axis p is not the process: {procs}"
    passed, skipped, failed = 0, 0, []
    t0 = time.perf_counter()
    for name, lay, check in checks(backend):
        # The hierarchical backend reads which axes are in-process from the concrete mesh.
        try:
            with Watchdog(name), jax.set_mesh(suite._mesh(lay.mesh_shape, lay.mesh_axes)):
                check()
            passed += 1
        except pytest.skip.Exception:
            skipped += 1
        except BaseException as err:  # noqa: BLE001  pytest.fail raises a BaseException
            failed.append(name)
            print(f"FAIL {name}: {str(err).splitlines()[0][:300]}", flush=True)
            if not isinstance(err, (AssertionError, pytest.fail.Exception)):
                traceback.print_exc()
    print(f"RESULT backend={backend} process={jax.process_index()} passed={passed} "
          f"skipped={skipped} failed={len(failed)} seconds={time.perf_counter() - t0:.0f}",
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "hierarchical"))
