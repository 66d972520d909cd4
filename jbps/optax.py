"""jbps.optax.distributed: an optax optimizer whose update first sums (or
averages) the gradients over every device of every worker with jbps.psum,
then runs the wrapped optimizer's update, all inside the user's jitted or
pmapped step. The servers only add; the optimizer stays on the device.

    tx = jbps.optax.distributed(optax.adam(1e-3), axis_name="batch")

It is an ordinary GradientTransformation, so it composes: inside
optax.masked only the masked leaves travel, optax.chain and
optax.inject_hyperparams(lambda lr: distributed(optax.sgd(lr)))(lr=0.1)
work. Its state is the wrapped optimizer's state, unchanged, so checkpoints
of a single-process run load into a distributed one and back.

Gradient accumulation: jbps.optax.MultiSteps(tx, k) communicates once per
real step. optax.MultiSteps(distributed(tx), k) gives the same parameters,
but optax runs the inner update on every mini-step and keeps the result only
on the last, so it would communicate k times per real step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from .ops import compression as wire
from .ops import onebit, psum
from .ops.psum import psum_with_feedback
from .partition.priority import Priority
from .onebit_adam import OneBitAdamState, onebit_adam

__all__ = [
    "DistributedOptimizer",
    "FeedbackState",
    "MultiSteps",
    "MultiStepsState",
    "OneBitAdamState",
    "distributed",
    "onebit_adam",
    "psum_gradients",
    "switch_compression",
    "zero_residuals",
]


def psum_gradients(
    axis_name: Any = None,
    *,
    average: bool = True,
    name: str | None = None,
    priority: Priority = None,
    bucket_bytes: int | None = None,
    compression: str | None = None,
) -> optax.GradientTransformation:
    """A stateless transformation that reduces the updates with jbps.psum, to
    put first in an optax.chain."""

    wire.check(compression, "jbps.optax.psum_gradients")  # stateless: no onebit

    def update_fn(updates, state, params=None):
        del params
        return psum(
            updates,
            axis_name,
            average=average,
            name=name,
            priority=priority,
            bucket_bytes=bucket_bytes,
            compression=compression,
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def distributed(
    tx: optax.GradientTransformation,
    *,
    axis_name: Any = None,
    average: bool = True,
    name: str | None = None,
    priority: Priority = None,
    bucket_bytes: int | None = None,
    compression: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """`tx`, with its update applied to the gradients reduced over the job.

    axis_name: the pmap/shard_map axes to average over besides the workers
    (as for lax.pmean; on a mesh, the data axes); None outside pmap and
    shard_map (refused inside them).
    average: True (the default, as Horovod's DistributedOptimizer) averages
    over all devices of all workers, so a mean loss per device gives the
    gradient of the mean loss over the global batch; False sums.
    name, priority, bucket_bytes: as for jbps.psum.
    compression: as for jbps.psum ("bf16" or "fp16" halves the bytes of
    float32 gradients), or with error feedback "onebit" (a sign bit per
    value and a scale per 256 values: 1/25.6 of the bytes) or "topk" (the 10
    largest of every 1024 values with their indices: 1/51.2), or
    "topk:FRACTION" (round(FRACTION * 1024) of every 1024, FRACTION in
    (0, 0.5]: "topk:0.05" keeps 51, 1/10 of the bytes); the state is
    then a FeedbackState holding tx's state and the residuals. Flax params flatten in
    alphabetical module order; priority=jbps.forward_order(params) sends the
    first layers first, which the next forward pass needs first, and groups
    the buckets in the order the backward pass produces the gradients, so
    each bucket travels while the rest of the backward pass runs.
    """
    wire.check(compression, "jbps.optax.distributed", stateful_ok=True)
    inner = optax.with_extra_args_support(tx)
    psum_args = dict(
        axis_name=axis_name,
        average=average,
        name=name,
        priority=priority,
        bucket_bytes=bucket_bytes,
        compression=compression,
    )
    if wire.stateful(compression):
        return _with_feedback(inner, **psum_args)

    def update_fn(updates, state, params=None, **extra_args):
        if isinstance(state, FeedbackState):
            raise ValueError(_WRONG_STATE.format(made=_HOLDS, now="keeps none"))
        return inner.update(psum(updates, **psum_args), state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


# A checkpoint restored into another optimizer than the one that saved it.
_WRONG_STATE = (
    "jbps.optax.distributed: this optimizer state {made}, and this optimizer {now}: restore a checkpoint with the "
    "optimizer that saved it, then convert its state with jbps.optax.switch_compression(opt_state, params, compression=...)"
)
_HOLDS = "holds error-feedback residuals (it was made with compression='onebit' or 'topk')"
_LACKS = "has no error-feedback residuals (it was made without compression, or with 'bf16'/'fp16')"


class FeedbackState(NamedTuple):
    """distributed(tx, compression="onebit" or "topk")'s state: tx's, and per leaf what
    this worker's encodings have not sent yet (float32, the leaf's shape;
    None for leaves that travel as they are: integers and leaves of fewer
    than 1024 values). It lives on the device and checkpoints with the rest
    (orbax, flax's msgpack); restored on the worker that saved it, it resumes
    the feedback exactly (the servers' residuals start from zero in a new job;
    docs/guide/checkpoints.md: the other workers' residuals). switch_compression
    converts it to and from tx's own state."""

    residuals: Any
    inner_state: Any


def zero_residuals(params: Any) -> Any:
    """The residuals before the first step."""
    return jax.tree_util.tree_map(lambda p: onebit.zero_residual(jnp.shape(p), jnp.result_type(p)), params)


def _with_feedback(inner, **psum_args) -> optax.GradientTransformationExtraArgs:
    def init_fn(params):
        return FeedbackState(zero_residuals(params), inner.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        if not isinstance(state, FeedbackState):
            raise ValueError(_WRONG_STATE.format(made=_LACKS, now="needs them"))
        reduced, residuals = psum_with_feedback(updates, state.residuals, **psum_args)
        new_updates, inner_state = inner.update(reduced, state.inner_state, params, **extra_args)
        return new_updates, FeedbackState(residuals, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


DistributedOptimizer = distributed


def switch_compression(opt_state: Any, params: Any, compression: str | None) -> Any:
    """`opt_state` of jbps.optax.distributed(tx, ...) as distributed(tx,
    compression=compression) needs it, for a checkpoint that changes its
    compression on restore: with error feedback ("onebit", "topk") the state
    is a FeedbackState holding tx's and the residuals (zeros when they start);
    without, tx's own. Dropping residuals drops what earlier encodings had not
    sent yet: a little of the last steps' gradients, once."""
    wire.check(compression, "jbps.optax.switch_compression", stateful_ok=True)
    inner = opt_state.inner_state if isinstance(opt_state, FeedbackState) else opt_state
    if not wire.stateful(compression):
        return inner
    if isinstance(opt_state, FeedbackState):
        return opt_state  # the same leaves travel compressed under onebit and topk: keep the residuals
    return FeedbackState(zero_residuals(params), inner)


class MultiStepsState(NamedTuple):
    mini_step: jax.Array  # gradients accumulated so far in this real step
    acc_grads: Any  # their running mean, this worker's own
    inner_opt_state: Any


def MultiSteps(
    tx: optax.GradientTransformation,
    every_k_schedule: int,
    *,
    axis_name: Any = None,  # noqa: N802
    average: bool = True,
    name: str | None = None,
    priority: Priority = None,
    bucket_bytes: int | None = None,
    compression: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Gradient accumulation over `every_k_schedule` mini-steps with one
    communication per real step: each worker averages its own mini-step
    gradients, and only on the k-th does the mean travel (a lax.cond, so
    the other mini-steps send nothing) and `tx` update; between, the updates
    are zeros. Same results as optax.MultiSteps(tx, k) on the job's averaged
    gradients; other arguments as for distributed() (with "onebit", the
    residuals live in inner_opt_state, a FeedbackState, and only the k-th
    mini-step's mean is encoded)."""
    if isinstance(every_k_schedule, bool) or not isinstance(every_k_schedule, int) or every_k_schedule < 1:
        raise TypeError(f"jbps.optax.MultiSteps: every_k_schedule must be a positive int, got {every_k_schedule!r}")
    wire.check(compression, "jbps.optax.MultiSteps", stateful_ok=True)
    # What the k-th mini-step runs: the reduction and tx's update, as distributed() does.
    inner = distributed(
        tx,
        axis_name=axis_name,
        average=average,
        name=name,
        priority=priority,
        bucket_bytes=bucket_bytes,
        compression=compression,
    )

    def init_fn(params):
        return MultiStepsState(
            jnp.zeros([], jnp.int32), jax.tree_util.tree_map(jnp.zeros_like, params), inner.init(params)
        )

    def update_fn(updates, state, params=None, **extra_args):
        acc = jax.tree_util.tree_map(
            lambda g, a: a + (g - a) / (state.mini_step + 1).astype(a.dtype), updates, state.acc_grads
        )

        def communicate(acc, inner_state):
            return inner.update(acc, inner_state, params, **extra_args)

        def accumulate(acc, inner_state):
            return jax.tree_util.tree_map(jnp.zeros_like, acc), inner_state

        emit = state.mini_step == every_k_schedule - 1
        new_updates, inner_state = lax.cond(emit, communicate, accumulate, acc, state.inner_opt_state)
        acc = jax.tree_util.tree_map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc)
        return new_updates, MultiStepsState((state.mini_step + 1) % every_k_schedule, acc, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
