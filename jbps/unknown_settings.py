"""Variables in jbps's namespaces that jbps does not read: a misspelled setting
(`JBPS_TIMOUT_S=5`) would otherwise run silently with the default. Each is
named once, with the nearest name jbps knows.

jbps run checks the job's environment once, before it starts anything, and
tells its children not to say it again; a process started any other way
(mpirun, the scheduler's variables, by hand) checks its own at jbps.init()
(worker) or start (server), on its host's first worker only.
"""

from __future__ import annotations

import difflib
import os
from typing import Mapping

from .config import OPTIONS

PREFIXES = ("JBPS_", "BYTEPS_", "DMLC_")

# Read by jbps outside the options of jbps.init(): the servers' settings, the
# kernels' and the CUDA handler's switches, BytePS's tracing pair.
OTHER_SETTINGS = (
    "JBPS_SERVER_ENGINE_THREADS",
    "BYTEPS_SERVER_ENGINE_THREAD",
    "JBPS_SERVER_ROLE",
    "JBPS_SERVER_BIND",
    "JBPS_SERVER_HOST",
    "JBPS_DETERMINISTIC",
    "JBPS_CPU_BASELINE",
    "JBPS_CUDA",
    "JBPS_CUDA_SYNC",
    "JBPS_CUDA_HOST_WAIT",
    "BYTEPS_TRACE_ON",
    "BYTEPS_TRACE_DIR",
)
# The build's, the lab's and CI's own (a user does not set them; they are not misspellings).
DEVELOPMENT = (
    "JBPS_EXPECT_CUDA",
    "JBPS_TESTING_DIR",
    "JBPS_BAZEL_BIN",
    "JBPS_PYTHON",
    "JBPS_SOAK",
    "JBPS_TEST_MARKER",
    "JBPS_FFI_INCLUDE_DIR",
)
DEVELOPMENT_PREFIXES = ("JBPS_CI_",)
# Set by jbps run for its children: it has checked their environment already.
CHECKED = "JBPS_ENVIRONMENT_CHECKED"


def known() -> tuple[str, ...]:
    names = [name for opt in OPTIONS for name in opt.env]
    return tuple(dict.fromkeys(names + list(OTHER_SETTINGS) + list(DEVELOPMENT) + [CHECKED]))


def unknown(environ: Mapping[str, str] | None = None) -> list[tuple[str, str | None]]:
    """(variable, the nearest known name or None) for every variable with
    jbps's, BytePS's or DMLC's prefix that jbps does not read, sorted."""
    environ = os.environ if environ is None else environ
    names = known()
    settings = [n for n in names if n not in DEVELOPMENT and n != CHECKED]
    out = []
    for var in sorted(environ):
        if not var.startswith(PREFIXES) or var in names or var.startswith(DEVELOPMENT_PREFIXES):
            continue
        near = difflib.get_close_matches(var, settings, n=1, cutoff=0.75)
        out.append((var, near[0] if near else None))
    return out


def messages(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per unknown variable."""
    lines = []
    for var, near in unknown(environ):
        hint = f"did you mean {near}?" if near else "it has no effect"
        lines.append(f"jbps: {var} is not a setting jbps reads: {hint}")
    return lines


_said: set[str] = set()


def warn(say, environ: Mapping[str, str] | None = None, local_rank: int = 0) -> list[str]:
    """Says each unknown variable once per process through `say` (a callable
    taking a line), unless jbps run has said it already, or this is not its
    host's first worker. Returns the lines said."""
    environ = os.environ if environ is None else environ
    if environ.get(CHECKED) == "1" or local_rank != 0:
        return []
    said = [line for line in messages(environ) if line not in _said]
    for line in said:
        _said.add(line)
        say(line)
    return said
