"""A worker training an MLP with jbps.scan: --programs programs of --steps
steps each, adam through jbps.optax.distributed in small buckets, on one
device (jit) or on every local device (pmap). Checks the parameters and the
steps' losses against a reference that needs no jbps: every worker's and
device's batch (seeded by step, worker and device) through plain jax and
optax in one process; with --compression (which rounds the sums), against
the same steps run one program a step with jbps. With --marks, the first
layer's activation of every step reports when it was computed (a
jax.debug.callback), and the engine's trace says when each step's sums came
back. With --die-rank, that rank leaves before the second program (with
--hang, after not answering for 15 s), and the others report how their
second program ended and how long it took: {"rank", "program", "error",
"after_s"}.

Prints one JSON line: {"rank", "max_error", "loss_error", "checksum",
"marks", "sums_back"}.
"""

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jbps
from jbps.trace import read_trace, trace_path

WIDTHS = (16, 32, 32, 32)  # the first layer small; --last-width sizes the last


def init_params(last_width):
    rng = np.random.default_rng(0)
    widths = WIDTHS + (last_width,)
    return [
        {"w": rng.standard_normal((a, b)).astype(np.float32) / np.sqrt(a), "b": np.zeros(b, np.float32)}
        for a, b in zip(widths, widths[1:])
    ]


def batch(step, worker, device, batch_size):
    rng = np.random.default_rng([step, worker, device])
    return rng.standard_normal((batch_size, WIDTHS[0])).astype(np.float32)


def loss_fn(params, x, mark=None):
    h = x
    for i, layer in enumerate(params):
        h = jnp.tanh(h @ layer["w"] + layer["b"])
        if i == 0 and mark is not None:
            jax.debug.callback(mark, h[0, 0])
    return jnp.mean(h**2)


def plain_optax(args, params, rank, size, devices):
    """The mean gradient over every worker's and device's batch, plain optax."""
    tx = optax.adam(1e-2)
    state = tx.init(params)
    losses = []
    grad = jax.jit(jax.value_and_grad(loss_fn))
    for s in range(args.programs * args.steps):
        results = [grad(params, batch(s, w, d, args.batch)) for w in range(size) for d in range(devices)]
        losses.append(float(results[rank * devices][0]))
        mean = jax.tree_util.tree_map(lambda *g: sum(g) / len(g), *[g for _, g in results])
        updates, state = tx.update(mean, state, params)
        params = optax.apply_updates(params, updates)
    return params, losses


def make_step(tx, mark=None):
    """One training step, (params, optimizer state) -> (the next, its loss)."""

    def step(carry, x):
        params, state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, x, mark)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), loss

    return step


def one_step_programs(args, make_tx, params, rank):
    """The same steps with jbps, one jitted program a step (jit mode). The k-th
    step of a program has psums of its own (grads@k), and with error feedback
    its own residuals on the servers: step s here uses ref@(s % steps)'s."""
    txs = [make_tx("ref" if k == 0 else f"ref@{k}") for k in range(args.steps)]
    steps = [jax.jit(make_step(tx)) for tx in txs]
    carry, losses = (params, txs[0].init(params)), []
    for s in range(args.programs * args.steps):
        carry, loss = steps[s % args.steps](carry, batch(s, rank, 0, args.batch))
        losses.append(float(loss))
    return carry[0], losses


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("jit", "pmap"), default="jit")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--programs", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--last-width", type=int, default=32)
    p.add_argument("--marks", action="store_true")
    p.add_argument("--compression", choices=("bf16", "onebit"))
    p.add_argument("--die-rank", type=int, default=-1, help="this rank leaves before the second program")
    p.add_argument("--hang", action="store_true", help="--die-rank stops answering for 15 s first")
    args = p.parse_args()

    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    devices = jax.local_device_count() if args.mode == "pmap" else 1
    params = init_params(args.last_width)

    # The first layers first: their sums travel ahead of the last layer's.
    def make_tx(name):
        return jbps.optax.distributed(
            optax.adam(1e-2),
            average=True,
            axis_name="i" if args.mode == "pmap" else None,
            priority=jbps.forward_order(params),
            bucket_bytes=4096,
            name=name,
            compression=args.compression,
        )

    tx = make_tx("grads")
    marks = []

    def mark(_):
        marks.append(time.time() * 1e6)

    step = make_step(tx, mark if args.marks else None)

    def program(params, state, xs):
        return jbps.scan(step, (params, state), xs)

    carry = (params, tx.init(params))
    losses = []
    if args.mode == "pmap":
        run = jax.pmap(program, axis_name="i")
        carry = jax.tree_util.tree_map(lambda v: np.stack([v] * devices), carry)
    else:
        run = jax.jit(program)
    pending = []
    for prog in range(args.programs):
        if prog == 1 and rank == args.die_rank:
            if args.hang:
                time.sleep(15)  # past the others' psum timeout (the test sets 4 s)
            os._exit(3)
        steps = range(prog * args.steps, (prog + 1) * args.steps)
        xs = np.stack([np.stack([batch(s, rank, d, args.batch) for d in range(devices)]) for s in steps])
        if args.die_rank >= 0:  # a fault to come: how the program ends, and when
            started = time.monotonic()
            try:
                ys = run(*carry, np.swapaxes(xs, 0, 1) if args.mode == "pmap" else xs[:, 0])[1]
                jax.block_until_ready(ys)
            except Exception as exc:
                report = {"rank": rank, "program": prog, "error": str(exc), "after_s": time.monotonic() - started}
                sys.stdout.write(json.dumps(report) + "\n")
                sys.stdout.flush()
                os._exit(0)  # the job is over: no goodbye to wait for
            continue
        if args.mode == "pmap":
            carry, ys = run(*carry, np.swapaxes(xs, 0, 1))  # devices first
            # Several devices: wait for each program (jax < 0.12's CPU runtime can
            # deadlock multi-device programs dispatched back to back: docs/guide/loops.md).
            losses += list(np.asarray(ys)[0])
        else:
            carry, ys = run(*carry, xs[:, 0])  # dispatched back to back, read at the end
            pending.append(ys)
    losses += [float(v) for ys in pending for v in np.asarray(ys)]
    final = jax.tree_util.tree_map(lambda v: np.asarray(v)[0] if args.mode == "pmap" else np.asarray(v), carry[0])

    if args.compression:
        ref_params, ref_losses = one_step_programs(args, make_tx, init_params(args.last_width), rank)
    else:
        ref_params, ref_losses = plain_optax(args, init_params(args.last_width), rank, size, devices)
    max_error = max(
        float(np.max(np.abs(a - np.asarray(b))))
        for a, b in zip(jax.tree_util.tree_leaves(final), jax.tree_util.tree_leaves(ref_params))
    )
    loss_error = float(np.max(np.abs(np.asarray(losses) - np.asarray(ref_losses))))
    checksum = float(sum(np.sum(v) for v in jax.tree_util.tree_leaves(final)))

    sums_back = {}
    trace_dir = jbps.runtime.config().trace_dir
    jbps.shutdown()
    if trace_dir:
        # When each step's sums were all back: the steps of a program are its psums
        # grads, grads@1, ... (one name a step), a program a round.
        for c in read_trace(trace_path(trace_dir, rank)):
            call = c.tensor.split("/", 1)[0].split("[", 1)[0]
            if not call.startswith("grads"):
                continue
            k = int(call.split("@", 1)[1]) if "@" in call else 0
            index = c.round * args.steps + k
            sums_back[index] = max(sums_back.get(index, 0.0), c.pulled)
    report = {
        "rank": rank,
        "max_error": max_error,
        "loss_error": loss_error,
        "checksum": checksum,
        "marks": marks,
        "sums_back": [sums_back[i] for i in sorted(sums_back)],
    }
    sys.stdout.write(json.dumps(report) + "\n")


if __name__ == "__main__":
    main()
