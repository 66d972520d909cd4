"""What the installed package holds: the library a user needs on a real
cluster, not the lab. No network-namespace code, no MPI or gloo comparison
peers, no test hooks (those live in benchmarks/ and jbps_testing, run from a
checkout). Read from the installed distribution's own file list (the wheel's
RECORD), so it checks what `pip install` put there."""

import importlib.metadata
import os

import pytest

import jbps
from jbps import _core

# What the lab has and the package must not: names of its modules, and what its code calls.
LAB_FILES = ("emulated_network", "emulated_job", "local_cluster", "gloo_peer", "mpi_peer", "jbps_testing", "bench/")
LAB_CODE = ("ip netns", "tc qdisc", "jax.distributed.initialize", "MPI.COMM_WORLD.Allreduce")
TEST_HOOKS = ("accumulate", "accumulator_init", "ChunkQueue", "fuse_small_chunks", "stream_copy", "engine_chunk_sizes")


def _installed_files():
    try:
        dist = importlib.metadata.distribution("jbps")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("jbps is not installed as a distribution (run from a checkout without pip install)")
    files = [f for f in dist.files or [] if str(f).startswith("jbps/")]
    if not files:
        pytest.skip("the installed jbps lists no files")
    return dist, files


def test_the_wheel_holds_the_library_and_not_the_lab():
    dist, files = _installed_files()
    names = [str(f) for f in files]
    assert "jbps/__init__.py" in names and any(n.startswith("jbps/_core") for n in names), names
    assert "jbps/bench.py" in names and "jbps/launch.py" in names  # the user's tools stay
    shipped_lab = [n for n in names if any(lab in n for lab in LAB_FILES)]
    assert not shipped_lab, f"the wheel ships the lab: {shipped_lab}"
    for f in files:
        if str(f).endswith(".py"):
            text = open(dist.locate_file(f), errors="replace").read()
            found = [code for code in LAB_CODE if code in text]
            assert not found, f"{f} has the lab's code: {found}"


def test_the_extension_has_no_test_hooks():
    # The tests' hooks are jbps_testing's (xla_ext/python/testing_module.cc), built for them only.
    present = [name for name in TEST_HOOKS if hasattr(_core, name)]
    assert not present, f"jbps._core exports test hooks: {present}"
    assert os.path.basename(_core.__file__).startswith("_core")
    assert jbps.has_cuda_support() in (True, False)
