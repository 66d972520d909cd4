"""Loading the C++ extension (jbps._core), and saying why it cannot be.

The usual reason is a source checkout that was never built: Python puts the
working directory (python -m, python -c) or the script's folder first on
sys.path, so from a checkout its jbps/ is found before the installed package.
`pip install .` also places the extension in the source tree (CMakeLists.txt),
which makes the checkout importable; this module explains the cases left.
"""

from __future__ import annotations

import glob
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _built(package_dir: str) -> bool:
    return bool(glob.glob(os.path.join(package_dir, "_core*.so")) or glob.glob(os.path.join(package_dir, "_core*.pyd")))


def installed_elsewhere() -> str | None:
    """Another jbps on sys.path that has the extension, if any."""
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or os.curdir), "jbps")
        if candidate != HERE and os.path.isfile(os.path.join(candidate, "__init__.py")) and _built(candidate):
            return candidate
    return None


def missing_message() -> str:
    root = os.path.dirname(HERE)
    other = installed_elsewhere()
    fixes = []
    if os.path.isfile(os.path.join(root, "pyproject.toml")):
        fixes.append(f"`pip install .` in {root} builds it there too")
    if other:
        fixes.append(f"run from another directory, and the jbps installed at {other} is used")
    return (
        f"jbps at {HERE} has no built C++ extension (jbps/_core*.so): it is a source tree that was never built, "
        "found first because Python puts the working directory (python -m, python -c) or the script's folder "
        "first on sys.path. " + ("; or ".join(fixes) or "Install jbps (pip install .) and import it from there") + "."
    )


def load_core():
    """jbps._core, or ImportError saying what to do."""
    try:
        return importlib.import_module("._core", __package__)
    except ImportError as exc:
        if not _built(HERE):
            raise ImportError(missing_message()) from None
        raise ImportError(f"jbps's C++ extension in {HERE} failed to load: {exc}") from exc
