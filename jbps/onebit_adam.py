"""jbps.optax.onebit_adam: Adam whose first moment travels compressed, after
an uncompressed warm-up (as DeepSpeed's 1-bit Adam).

Compressing the gradients that Adam then divides by their own running
magnitude (compression="onebit" around optax.adam) turns the sign noise that
error feedback would cancel over a few steps into full-size steps: the
transformer example ends near a nat above float32. 1-bit Adam's way out:

- warm-up (the first `warmup_steps` steps): plain Adam on the gradients
  averaged uncompressed over the job, which sets the second moment nu;
- then nu stays as the warm-up left it, and each worker folds its own
  gradient into the job's first moment, m = b1 * mu + (1 - b1) * g; the job
  averages m / (sqrt(nu_hat) + eps), Adam's step direction, compressed with
  error feedback (the worker's residual in this state, the servers' per key),
  and the new mu is that average times the same denominators. With nu fixed
  the update is linear in m, so what error feedback delays reaches the
  parameters a step or two later instead of never; and dividing before the
  compression keeps a block's error in units of a step (DeepSpeed compresses
  m itself, which blew up the mnist example: a weight whose gradient is
  always zero has nu = 0, and the sign code sends it the block's scale).

Every worker holds the same mu and nu (they come out of the job's sums), so
the parameters stay identical across workers. The update is AdamW's:
mu_hat / (sqrt(nu_hat) + eps) + weight_decay * params, times -learning_rate,
with nu's bias correction frozen at the warm-up's last step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from . import runtime
from .ops import compression as wire
from .ops import psum
from .ops.psum import psum_with_feedback
from .partition.priority import Priority


class OneBitAdamState(NamedTuple):
    """onebit_adam's state (the first of its optax.chain's): steps taken, the
    job's first and second moments (float32, every worker the same), and this
    worker's residuals of the step direction's compression (float32 per
    compressed leaf, an empty array for leaves that travel as they are). It
    lives on the device and checkpoints with the rest (the servers'
    residuals start from zero in a new job)."""

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count, as optax's ScaleByAdamState does
    mu: Any
    nu: Any
    residuals: Any


def _scale_by_onebit_adam(
    warmup_steps: int, b1: float, b2: float, eps: float, compression: str, name: str | None, reduce_args: dict
) -> optax.GradientTransformation:
    """Adam's scaling with the averaging over the job inside (the module's
    docstring): the updates it returns are already the job's, so nothing
    else in the chain psums them. reduce_args: axis_name, priority and
    bucket_bytes for jbps.psum."""
    # Unnamed, an optimizer is named for where it is built (the same on every
    # worker, whatever the order); two built at one place and used in one
    # program get names of their own where it is lowered (ops/places.py).
    base = name if name is not None else runtime.auto_name("onebit_adam")
    # The largest step Adam itself takes on a coordinate, |mu_hat| / sqrt(nu_hat)
    # for one gradient after a history of zeros: a coordinate whose gradient
    # outgrew the frozen nu is held there (see compressed()).
    bound = (1 - b1) / (1 - b2) ** 0.5
    reduce_args = dict(reduce_args, average=True)

    def init_fn(params):
        from .optax import zero_residuals  # not at the top: jbps.optax imports this module

        zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return OneBitAdamState(jnp.zeros([], jnp.int32), zeros, zeros, zero_residuals(params))

    # Each branch returns the new (mu, nu, residuals) and the step:
    # mu_hat / (sqrt(nu_hat) + eps), with nu_hat's correction frozen at the
    # warm-up's last step.
    def warm(grads, state, count):
        g = psum(grads, name=f"{base}.warmup", **reduce_args)
        g = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), g)
        mu = jax.tree_util.tree_map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, g)
        nu = jax.tree_util.tree_map(lambda v, x: b2 * v + (1 - b2) * x * x, state.nu, g)
        t = count.astype(jnp.float32)
        step = jax.tree_util.tree_map(lambda m, v: (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), mu, nu)
        return (mu, nu, state.residuals), step

    def compressed(grads, state, count):
        # What travels is this worker's momentum divided by the frozen
        # denominators: Adam's step direction. With nu fixed the division
        # commutes with the average, so uncompressed it would be the same
        # sum; compressed, a block's error is in units of the step, where a
        # coordinate of near-zero nu (a weight whose gradient is always zero)
        # divided afterwards would turn the block's scale into a huge step.
        denom = jax.tree_util.tree_map(lambda v: jnp.sqrt(v / (1 - b2**warmup_steps)) + eps, state.nu)
        local = jax.tree_util.tree_map(
            lambda m, x, d: jnp.clip((b1 * m + (1 - b1) * x.astype(jnp.float32)) / d, -bound, bound),
            state.mu,
            grads,
            denom,
        )
        steps, residuals = psum_with_feedback(
            local, state.residuals, name=f"{base}.momentum", compression=compression, **reduce_args
        )
        mu = jax.tree_util.tree_map(jnp.multiply, steps, denom)
        correction = 1 - b1 ** count.astype(jnp.float32)
        return (mu, state.nu, residuals), jax.tree_util.tree_map(lambda x: x / correction, steps)

    def update_fn(updates, state, params=None):
        del params
        count = state.count + 1
        (mu, nu, residuals), step = lax.cond(count <= warmup_steps, warm, compressed, updates, state, count)
        scaled = jax.tree_util.tree_map(lambda x, u: x.astype(u.dtype), step, updates)
        return scaled, OneBitAdamState(count, mu, nu, residuals)

    return optax.GradientTransformation(init_fn, update_fn)


def onebit_adam(
    learning_rate: optax.ScalarOrSchedule,
    *,
    warmup_steps: int,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    compression: str = "onebit",
    axis_name: Any = None,
    name: str | None = None,
    priority: Priority = None,
    bucket_bytes: int | None = None,
) -> optax.GradientTransformation:
    """AdamW (optax.adamw's update, weight_decay 0 by default: Adam) whose
    gradients are averaged over the job uncompressed for `warmup_steps`
    steps and whose first moment travels compressed after (the module's
    docstring). Give it the gradients of this worker, as to
    jbps.optax.distributed: it averages them itself. warmup_steps:
    uncompressed steps first (at least 1; about a fifth of the steps is a
    start, as DeepSpeed's 15-25%: nu must have settled before it freezes);
    compression: "onebit", or
    "topk"/"topk:FRACTION", for the step direction; axis_name, name,
    priority, bucket_bytes: as for jbps.psum. Bad values are refused here,
    as it is built."""
    where = "jbps.optax.onebit_adam"
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
        raise ValueError(f"{where}: warmup_steps must be a whole number of steps, at least 1, got {warmup_steps!r}")
    for label, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{where}: {label} must be in [0, 1), got {value!r}")
    if wire.feedback_codec(compression, where) is None:
        raise ValueError(f"{where}: compression must be 'onebit', 'topk' or 'topk:FRACTION', got {compression!r}")
    reduce_args = dict(axis_name=axis_name, priority=priority, bucket_bytes=bucket_bytes)
    return optax.chain(
        _scale_by_onebit_adam(warmup_steps, b1, b2, eps, compression, name, reduce_args),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
