"""XLA flags the test processes compile with, and the environment of a subprocess that must
set its own device count (the CLI does, as for a user) but compile as the suite does."""
import os
from importlib.metadata import version

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def speed_flags() -> list[str]:
    """XLA:CPU flags that cut the suite's compile time without changing what is tested.

    On jaxlib 0.10, XLA:CPU's MLIR fusion emitters took 3.1 s of CPU to compile the tiny
    reference train step on 8 devices and its older IR emitters 1.0 s (6.0 and 3.9 s at XLA's
    default optimisation), with the same run time (30 steps: 0.61 and 0.56 s of CPU); the
    train step's compiles were a quarter of the suite's CPU. Later jaxlibs have only the
    fusion emitters and reject the flag (an unknown flag in XLA_FLAGS aborts the process).
    """
    major_minor = tuple(int(part) for part in version("jaxlib").split(".")[:2])
    return ["--xla_cpu_use_fusion_emitters=false"] if major_minor < (0, 11) else []


def without_device_count() -> dict:
    """This process's environment with the device count taken out of XLA_FLAGS, the speed
    flags kept."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG))
    return env
