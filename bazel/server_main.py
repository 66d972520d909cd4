"""`python -m jbps.server` as a Bazel py_binary."""

import runpy

runpy.run_module("jbps.server", run_name="__main__", alter_sys=True)
