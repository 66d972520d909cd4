"""The Bazel build works: a 2-worker psum job whose servers and workers import
the jbps package and extension exactly as Bazel assembled them (//:jbps in the
runfiles of //bazel:server), and the //bazel:server binary itself.

Skipped unless JBPS_BAZEL_BIN names Bazel's output folder: run
`bazel/build_offline.sh`, then `JBPS_BAZEL_BIN=bazel-bin pytest tests/test_bazel_smoke.py`.
"""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import check_results, run_job, worker_script
from jbps.procs import terminate

BIN = os.environ.get("JBPS_BAZEL_BIN")
pytestmark = pytest.mark.skipif(
    not BIN,
    reason="JBPS_BAZEL_BIN is not set: no Bazel build to test (bazel/build_offline.sh, then JBPS_BAZEL_BIN=bazel-bin)",
)


def runfiles():
    tree = Path(BIN) / "bazel" / "server.runfiles" / "jbps"
    if not (tree / "jbps" / "_core.so").exists():
        pytest.fail(f"{tree}/jbps/_core.so not found: JBPS_BAZEL_BIN={BIN} holds no build of //bazel:server")
    return tree


@pytest.fixture
def bazel_package(tmp_path):
    """A copy of the runfiles with the symlinks resolved: a plain tree whose
    jbps has Bazel's extension and nothing else (the .py files link to the
    checkout, where a CMake-built _core may also sit)."""
    tree = tmp_path / "pkg"
    shutil.copytree(runfiles(), tree)
    return tree


def test_two_worker_psum_with_the_bazel_package(bazel_package):
    env = {"PYTHONPATH": str(bazel_package)}
    where = subprocess.run(
        [sys.executable, "-c", "import jbps._core as c; print(c.__file__)"],
        env={**os.environ, **env},
        cwd=bazel_package.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip() == str(bazel_package / "jbps" / "_core.so")
    rounds = 3
    results = run_job(
        [worker_script("random_trees.py"), "--rounds", str(rounds), "--mode", "pmap"],
        workers=2,
        servers=2,
        devices=2,
        env={**env, "JBPS_TIMEOUT_S": "60"},
        timeout_s=240,
    )
    check_results(results, rounds)


def test_bazel_server_binary_starts(tmp_path):
    out = tmp_path / "server.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [str(Path(BIN) / "bazel" / "server"), "--bind", "127.0.0.1:0", "--num-workers", "1"],
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while not re.search(r"jbps\.server listening on 127\.0\.0\.1:\d+", out.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"//bazel:server did not start (exit code {proc.poll()}):\n{out.read_text()[-3000:]}"
            )
            time.sleep(0.05)
    finally:
        terminate([proc], grace_s=3, what="//bazel:server")
