"""Offline stand-in for @rules_java//java:defs.bzl: Bazel 4's own Java rules
under the names rules_java exports. Bazel 4.2 registers @bazel_tools//tools/jdk:all
as toolchains, and that package loads this file even in a build without Java;
the real rules_java is only a download away."""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_lite_proto_library = native.java_lite_proto_library
java_package_configuration = native.java_package_configuration
java_plugin = native.java_plugin
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_test = native.java_test
java_toolchain = native.java_toolchain
