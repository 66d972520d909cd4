"""Run peer tools (MPI Allreduce, JAX gloo psum) as 2 local processes and collect timings.

Each runner returns {"tool": str, "results": {size_bytes: {"median_s", "min_s", "iters"}}}
so the jbps benchmark can print them next to its own numbers; given tree_sizes, also
"small_tensors": the many-small-tensors case (a tree of buffers against one of the same bytes).
"""

import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from jbps.procs import terminate
from .report import parse_report

logger = logging.getLogger(__name__)

NUM_PROCESSES = 2

# The checkout's root, which holds benchmarks/ (and jbps/), so that
# `python -m benchmarks.*` works in the peers' processes.
_PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(extra=None):
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _PKG_PARENT + (os.pathsep + old if old else "")
    env.update(extra or {})
    return env


def _peer_args(sizes, iters, warmup, tree_sizes=(), tree_iters=None, out_of_place=False):
    args = ["--sizes", ",".join(str(int(s)) for s in sizes), "--iters", str(int(iters)), "--warmup", str(int(warmup))]
    if out_of_place:
        args.append("--out-of-place")
    if tree_sizes:
        args += [
            "--tree-sizes",
            ",".join(str(int(s)) for s in tree_sizes),
            "--tree-iters",
            str(int(tree_iters or iters)),
        ]
    return args


def _run_group(cmds, env, timeout_s, what, grace_s=0.0):
    """Start each command in its own session, wait for all, return their stdouts.

    Fails as soon as any process exits non-zero (its peers would otherwise
    block until the timeout). On timeout or failure everything we started is
    ended by pid (see _terminate); all children are reaped in `finally`.
    """
    procs, logs = [], []
    try:
        for cmd in cmds:
            logger.debug("%s: starting %s", what, " ".join(cmd))
            # Files, not pipes: a chatty child can never block on a full pipe.
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            logs.append((out, err))
            procs.append(
                subprocess.Popen(
                    cmd, env=env, cwd=_PKG_PARENT, stdout=out, stderr=err, text=True, start_new_session=True
                )
            )
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p in procs]
            for i, rc in enumerate(codes):
                if rc not in (None, 0):
                    raise RuntimeError(f"{what}: process {i} exited with {rc}; stderr:\n{_read(logs[i][1])}")
            if all(rc == 0 for rc in codes):
                return [_read(out) for out, _ in logs]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what}: timed out after {timeout_s} s; stderr of process 0:\n{_read(logs[0][1])}")
            time.sleep(0.05)
    finally:
        terminate(procs, grace_s, what)  # by PID, with everything they spawned; reaps
        for out, err in logs:
            out.close()
            err.close()


def _read(f):
    f.seek(0)
    return f.read()


def _find_mpiexec():
    # Prefer the venv's own mpiexec: it matches the MPI that mpi4py was built against.
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(local, os.X_OK):
        return local
    return shutil.which("mpiexec")


def run_mpi_allreduce(
    sizes: list[int],
    iters: int,
    warmup: int,
    timeout_s: float = 300,
    tree_sizes=(),
    tree_iters=None,
    out_of_place=False,
) -> dict | None:
    """Time mpi4py Allreduce(SUM) across 2 local ranks (with out_of_place, also into a separate
    receive buffer); None if mpi4py is missing."""
    if importlib.util.find_spec("mpi4py") is None:
        logger.info("mpi4py not installed; skipping MPI peer")
        return None
    mpiexec = _find_mpiexec()
    if mpiexec is None:
        raise RuntimeError("mpi4py is installed but no mpiexec was found")
    cmd = [
        mpiexec,
        "-n",
        str(NUM_PROCESSES),
        sys.executable,
        "-m",
        "benchmarks.mpi_peer",
        *_peer_args(sizes, iters, warmup, tree_sizes, tree_iters, out_of_place),
    ]
    # SIGTERM grace: mpiexec then tears down its ranks, which sit in their own sessions.
    [out] = _run_group([cmd], _child_env(), timeout_s, "mpi_peer", grace_s=3.0)
    return parse_report(out, "mpi_peer")


def run_gloo_psum(
    sizes: list[int], iters: int, warmup: int, timeout_s: float = 300, tree_sizes=(), tree_iters=None
) -> dict:
    """Time a JAX psum over gloo across 2 local processes with 1 CPU device each."""
    # One CPU device per process; appended so it wins over an inherited count.
    xla_flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
    env = _child_env({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags})
    coordinator = f"127.0.0.1:{free_port()}"
    cmds = [
        [
            sys.executable,
            "-m",
            "benchmarks.gloo_peer",
            "--coordinator",
            coordinator,
            "--num-processes",
            str(NUM_PROCESSES),
            "--process-id",
            str(i),
            *_peer_args(sizes, iters, warmup, tree_sizes, tree_iters),
        ]
        for i in range(NUM_PROCESSES)
    ]
    # No SIGTERM grace: JAX's distributed runtime catches SIGTERM (preemption).
    outputs = _run_group(cmds, env, timeout_s, "gloo_peer")
    return parse_report(outputs[0], "gloo_peer")
