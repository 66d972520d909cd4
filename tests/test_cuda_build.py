"""The CUDA handler as built, checked on any machine (no GPU needed): whether
the build has it, that the module needs no CUDA library to load, and that
registering it for platform CUDA leaves the CPU path alone."""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbps
from jbps import _core


def test_has_cuda_support_matches_the_module():
    has = jbps.has_cuda_support()
    assert isinstance(has, bool)
    assert has == _core.has_cuda()
    assert bool(_core.ffi_targets_cuda()) == has
    assert set(_core.ffi_targets_cuda()) <= set(_core.ffi_targets())


def test_build_has_the_handler_ci_expects():
    # .ci/run sets JBPS_EXPECT_CUDA to whether it built the wheel with the
    # CUDA toolkit present; elsewhere the expectation is unknown.
    expect = os.environ.get("JBPS_EXPECT_CUDA")
    if expect is None:
        pytest.skip("JBPS_EXPECT_CUDA not set: nothing to compare has_cuda_support() with")
    assert jbps.has_cuda_support() == (expect == "1"), (
        f"JBPS_EXPECT_CUDA={expect} but has_cuda_support() is {jbps.has_cuda_support()}"
    )


@pytest.mark.skipif(shutil.which("ldd") is None, reason="ldd not available")
def test_core_needs_no_cuda_shared_library():
    # cudart_static is linked in, and it loads libcuda only when a CUDA call is
    # made, so `import jbps` works without a GPU, driver or libcudart.
    core = _core.__file__
    deps = subprocess.run(["ldd", core], capture_output=True, text=True, check=True).stdout
    assert "libcuda" not in deps and "libcudart" not in deps, deps


def test_cpu_psum_with_the_cuda_target_registered(session):
    # The session registered jbps_psum for "cpu" and, when built, for "CUDA".
    out = jax.jit(lambda t: jbps.psum(t))({"x": jnp.arange(6.0), "n": jnp.arange(3, dtype=jnp.int32)})
    np.testing.assert_array_equal(out["x"], np.arange(6.0))
    np.testing.assert_array_equal(out["n"], np.arange(3))


def test_import_and_psum_with_jax_choosing_its_backend(tmp_path):
    # Without JAX_PLATFORMS, jax probes for GPU plugins and falls back to the
    # CPU; the CUDA registration must not break that.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(jbps.__file__)), env.get("PYTHONPATH")) if p
    )
    code = (
        "import jax, jax.numpy as jnp, jbps\n"
        "with jbps.init(timeout_s=20):\n"
        "    print(jax.default_backend(), jbps.has_cuda_support(), float(jax.jit(jbps.psum)(jnp.ones(3)).sum()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    backend, has, total = proc.stdout.split()[-3:]
    assert has == str(jbps.has_cuda_support())
    assert float(total) == 3.0
