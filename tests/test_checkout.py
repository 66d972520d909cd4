"""The README's commands, run from the root of the source checkout, where its
first command leaves a new user. Python puts the working directory first on
sys.path for `python -m` and `python -c`, so there they import the checkout's
jbps/, not the installed one: `pip install .` places the built extension there
too, and a source tree that was never built says so clearly."""

import glob
import os
import shutil
import subprocess
import sys

import pytest

from conftest import job_free_env, worker_script
from leftovers import assert_nothing_left
from test_launch import MPIEXEC, base_env, check_reports, needs_mpi, per_rank_reports, run

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# scikit-build-core's build folder (pyproject.toml): `pip install .` was run in this checkout.
BUILT_HERE = bool(glob.glob(os.path.join(CHECKOUT, "build", "*", "CMakeCache.txt")))
needs_built_checkout = pytest.mark.skipif(not BUILT_HERE, reason="`pip install .` was never run in this checkout")


@needs_built_checkout
def test_pip_install_places_the_extension_in_the_checkout():
    assert glob.glob(os.path.join(CHECKOUT, "jbps", "_core*.so")), (
        "pip install . built the extension here, but the checkout's jbps/ has none: python -m jbps.* fails here"
    )


@needs_built_checkout
@pytest.mark.parametrize(
    "module", ["jbps.server", "jbps.scheduler", "jbps.bench", "jbps.partition", "jbps", "benchmarks"]
)
def test_python_m_commands_run_from_the_checkout_root(module):
    proc = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        env=job_free_env(),
        cwd=CHECKOUT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout


@needs_mpi
@needs_built_checkout
def test_the_readme_mpmd_line_runs_from_the_checkout_root():
    env = base_env(JBPS_TIMEOUT_S="60")
    proc, out, err = run(
        [
            MPIEXEC,
            "-n",
            "2",
            sys.executable,
            worker_script("random_trees.py"),
            "--rounds",
            "2",
            "--mode",
            "jit",
            ":",
            "-n",
            "2",
            sys.executable,
            "-m",
            "jbps.server",
        ],
        env,
        cwd=CHECKOUT,
    )
    assert proc.returncode == 0, err[-3000:]
    check_reports(per_rank_reports(out), 2, 2)
    assert out.count("jbps.server listening on") == 2
    assert_nothing_left(env)


def test_an_unbuilt_source_tree_says_why_it_cannot_be_imported(tmp_path):
    # A checkout nobody ran `pip install .` in: the sources alone.
    shutil.copytree(
        os.path.join(CHECKOUT, "jbps"), tmp_path / "jbps", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    shutil.copy(os.path.join(CHECKOUT, "pyproject.toml"), tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "jbps.server", "--help"],
        env=job_free_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert f"jbps at {tmp_path / 'jbps'} has no built C++ extension" in last, proc.stderr[-3000:]
    assert f"`pip install .` in {tmp_path} builds it there too" in last
    assert "circular import" not in proc.stderr  # Python's guess, wrong here
