"""A repository of the headers and sources that the xla_ext module builds against, taken from a
Python environment on this machine (no download): its C API headers, the XLA FFI headers of its
jaxlib and nanobind's sources. The interpreter is $TRAINSPEC_PYTHON (default: python3 on PATH);
it must be the one that will import the module, so that the FFI headers are its jaxlib's."""

_QUERY = """
import json, os, sysconfig
import jaxlib.version, nanobind
print(json.dumps({
    "python_include": sysconfig.get_paths()["include"],
    "ffi_include": os.path.join(os.path.dirname(jaxlib.version.__file__), "include"),
    "jaxlib_version": jaxlib.version.__version__,
    "nanobind": os.path.dirname(nanobind.__file__),
}))
"""

_BUILD = """
cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
    visibility = ["//visibility:public"],
)

# The define records which jaxlib these headers come from (the module reports it at load).
cc_library(
    name = "xla_ffi_api",
    hdrs = glob(["ffi_include/xla/ffi/api/*.h"]),
    defines = ['TRAINSPEC_JAXLIB_VERSION=\\\\"{jaxlib_version}\\\\"'],
    includes = ["ffi_include"],
    visibility = ["//visibility:public"],
)

cc_library(
    name = "robin_map",
    hdrs = glob(["nanobind/ext/robin_map/include/**/*.h"]),
    includes = ["nanobind/ext/robin_map/include"],
)

# libnanobind as nanobind's own CMake builds it for a static, non-free-threaded module: every
# source but the single-file amalgamation, the free-threading and the split-backend entry point.
cc_library(
    name = "nanobind",
    srcs = glob(
        ["nanobind/src/*.cpp", "nanobind/src/*.h"],
        exclude = [
            "nanobind/src/nb_combined.cpp",
            "nanobind/src/nb_ft.cpp",
            "nanobind/src/nb_backend.cpp",
        ],
    ),
    hdrs = glob(["nanobind/include/**/*.h"]),
    copts = ["-fno-strict-aliasing", "-fvisibility=hidden", "-fno-stack-protector"],
    includes = ["nanobind/include"],
    local_defines = ["NB_BUILD", "NB_COMPACT_ASSERTIONS"],
    visibility = ["//visibility:public"],
    deps = [":python_headers", ":robin_map"],
)
"""

def _python_env_impl(rctx):
    python = rctx.os.environ.get("TRAINSPEC_PYTHON", "python3")
    result = rctx.execute([python, "-c", _QUERY])
    if result.return_code != 0:
        fail("{} cannot report its headers (needs jaxlib and nanobind installed):\n{}".format(
            python,
            result.stderr,
        ))
    found = json.decode(result.stdout)
    for name in ("python_include", "ffi_include", "nanobind"):
        rctx.symlink(found[name], name)
    rctx.file("BUILD.bazel", _BUILD.format(jaxlib_version = found["jaxlib_version"]))

python_env = repository_rule(
    implementation = _python_env_impl,
    environ = ["TRAINSPEC_PYTHON", "PATH"],
    local = True,
)
