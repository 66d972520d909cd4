"""jbps_testing, the tests' and the lab's hooks into jbps's C++
(xla_ext/python/testing_module.cc): the servers' summation kernels, the
engine's copy, scheduling policy and fusion, the CUDA staging copy's timing.
It is never part of the installed package: this builds it from the checkout
with CMake (option JBPS_BUILD_TESTING), once per Python, into
build/testing-<python tag>/, or loads it from JBPS_TESTING_DIR (CI builds it once).

    from benchmarks.cxx_hooks import hooks
    hooks().accumulate("float32", acc, src)
"""

from __future__ import annotations

import fcntl
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_module = None


def build_dir() -> Path:
    tag = sysconfig.get_config_var("SOABI") or f"py{sys.version_info[0]}{sys.version_info[1]}"
    return REPO / "build" / f"testing-{tag}"


def _build(where: Path) -> None:
    """Configures and builds the jbps_testing target with this Python (about a minute on 2 cores)."""
    where.mkdir(parents=True, exist_ok=True)
    configure = [
        "cmake",
        "-S",
        str(REPO),
        "-B",
        str(where),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        "-DJBPS_BUILD_TESTING=ON",
        "-DJBPS_EXTENSION_IN_SOURCE_TREE=OFF",
    ]
    if shutil.which("ninja") and not (where / "Makefile").exists():
        configure += ["-G", "Ninja"]
    for cmd in (configure, ["cmake", "--build", str(where), "--target", "jbps_testing", "-j", str(os.cpu_count())]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"building jbps_testing failed: {' '.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )


def hooks():
    """The jbps_testing module, built first if this checkout has none for this Python."""
    global _module
    if _module is not None:
        return _module
    given = os.environ.get("JBPS_TESTING_DIR")
    where = Path(given) if given else build_dir()
    if not given:
        where.mkdir(parents=True, exist_ok=True)
        with open(where / ".lock", "w") as lock:  # pytest-xdist workers, or two sessions, build it once
            fcntl.flock(lock, fcntl.LOCK_EX)
            _build(where)  # incremental: seconds when nothing changed
    sys.path.insert(0, str(where))
    try:
        _module = importlib.import_module("jbps_testing")
    finally:
        sys.path.remove(str(where))
    return _module
