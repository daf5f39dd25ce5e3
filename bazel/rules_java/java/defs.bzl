"""The entry points of @rules_java//java:defs.bzl that Bazel 4's @bazel_tools//tools/jdk package
loads when toolchains are resolved, as the native rules they stand for. Nothing here builds Java;
Bazel 4 would otherwise download rules_java before building C++. WORKSPACE maps @rules_java here."""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
