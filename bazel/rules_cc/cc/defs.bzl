"""The entry points of @rules_cc//cc:defs.bzl that Bazel 4's own C++ toolchain and tools load,
as the native rules they stand for. Bazel 4 would otherwise download rules_cc before building
any C++ (Debian's bazel-rules-cc is written for a newer Bazel); WORKSPACE maps @rules_cc here."""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
