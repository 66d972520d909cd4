"""XLA:CPU's deadlock of multi-device loops in jax < 0.12, and what to do about it.

With several local CPU devices (`--xla_force_host_platform_device_count`, or
`jbps run --local-devices`), a loop of steps that contain a cross-device
collective, dispatched back to back with nothing waiting for a result, stalls
inside XLA's CPU runtime: one device's computation waits in the collective's
rendezvous while the other device's launch waits for a free slot of that
device's queue of in-flight computations (about 32). jaxlib then aborts after
40 s (`Termination timeout for ... RendezvousKey{...}`; jax 0.5 hangs for
ever), and the other workers of a jbps job time out waiting for its pushes.

It is XLA's, not jbps's: the same loop with `lax.psum` and no jbps stalls as
often. Measured (docs/guide/loops.md): jax 0.5.0, 0.10.2 and 0.11.2 stall; 0.12.0
does not. The loop finishes when no more than a few steps are in flight:
waiting for a step's result every WAIT_EVERY steps.
"""

from __future__ import annotations

import warnings

import jax

FIXED_IN = (0, 12)
WAIT_EVERY = 8  # steps in flight at most, far below the ~32 the deadlock needs

ADVICE = (
    f"jax {{version}}'s CPU runtime can deadlock a loop of multi-device steps dispatched back to back "
    f"(XLA aborts: 'Termination timeout for ... RendezvousKey'); jax {FIXED_IN[0]}.{FIXED_IN[1]} fixes it. "
    f"Until then wait for a step's result every few steps, e.g. "
    f"`if step % {WAIT_EVERY} == 0: jax.block_until_ready(state)` (docs/guide/loops.md)"
)


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def affected(jax_version: str, platform: str, local_devices: int) -> bool:
    """Whether loops of steps over `local_devices` devices of `platform` can
    stall this way with this jax."""
    return platform == "cpu" and local_devices > 1 and _version(jax_version) < FIXED_IN


def loops_need_waits() -> bool:
    """Whether this process's loops must wait every WAIT_EVERY steps (affected() for its jax and devices)."""
    return affected(jax.__version__, jax.default_backend(), jax.local_device_count())


def warn_if_affected(local_rank: int) -> bool:
    """Warns once per host (local rank 0) when this process's loops can stall; True if they can."""
    if not loops_need_waits():
        return False
    if local_rank == 0:
        warnings.warn("jbps: " + ADVICE.format(version=jax.__version__), RuntimeWarning, stacklevel=4)
    return True
