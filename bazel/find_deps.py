"""Prints, as JSON, where the configured Python's installed build inputs are:
its headers, nanobind's sources and headers, and the XLA FFI headers.
Run by the Bazel repository rule in local_config.bzl; nothing is downloaded."""

import json
import os
import sys
import sysconfig


def fail(msg):
    sys.exit(f"jbps bazel: {msg} (Python: {sys.executable})")


def main():
    try:
        import nanobind
    except ImportError:
        fail("nanobind is not installed; `pip install nanobind` into the Python that JBPS_PYTHON names")
    ffi = os.environ.get("JBPS_FFI_INCLUDE_DIR")
    if not ffi:
        try:
            import jax.ffi

            ffi = jax.ffi.include_dir()
        except (ImportError, AttributeError):
            fail("jax (with jax.ffi) is not installed and JBPS_FFI_INCLUDE_DIR is not set")
    if not os.path.isfile(os.path.join(ffi, "xla", "ffi", "api", "ffi.h")):
        fail(f"xla/ffi/api/ffi.h not found under {ffi}")
    py_include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(py_include, "Python.h")):
        fail(f"Python.h not found under {py_include}; install the Python development headers")
    robin_map = os.path.join(os.path.dirname(nanobind.__file__), "ext", "robin_map", "include")
    if not os.path.isdir(robin_map):
        fail(f"nanobind's robin_map headers not found at {robin_map}")
    json.dump(
        {
            "python": sys.executable,
            "python_include": py_include,
            "nanobind_src": nanobind.source_dir(),
            "nanobind_include": nanobind.include_dir(),
            "robin_map_include": robin_map,
            "ffi_include": ffi,
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
