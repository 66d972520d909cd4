"""A flax training step with jbps.optax.distributed in buckets, traced: prints,
for each bucket's call of the last step, when it was entered, when its first
chunk was pushed and when a server first acknowledged one of its chunks, from
this worker's trace; and, with --schedule, where the compiled step's
side-stream calls (jbps/ops/side_stream.py) start and end in its schedule."""

import argparse
import json
import re
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jbps
from jbps.trace import read_trace, trace_path


class MLP(nn.Module):
    layers: int
    width: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = nn.tanh(nn.Dense(self.width)(x))
        return nn.Dense(1)(x)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--bucket-bytes", type=int, default=None)
    p.add_argument("--schedule", action="store_true", help="report the compiled step's side-stream calls")
    args = p.parse_args()

    jbps.init()
    model = MLP(args.layers, args.width)
    rng = np.random.default_rng(jbps.rank())
    x = jnp.asarray(rng.normal(size=(args.batch, args.width)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(args.batch, 1)), jnp.float32)
    params = model.init(jax.random.PRNGKey(0), x)
    tx = jbps.optax.distributed(
        optax.sgd(0.01), priority=jbps.forward_order(params), name="grads", bucket_bytes=args.bucket_bytes
    )
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    schedule = side_stream_schedule(step.lower(params, state).compile().as_text()) if args.schedule else None
    for _ in range(args.steps):
        params, state = step(params, state)
    jax.block_until_ready(params)
    checksum = float(sum(jnp.sum(leaf) for leaf in jax.tree_util.tree_leaves(params)))
    rank = jbps.rank()
    trace_dir = jbps.runtime.config().trace_dir
    jbps.shutdown()

    chunks = read_trace(trace_path(trace_dir, rank))
    last_round = {}
    for c in chunks:
        last_round[c.tensor] = max(last_round.get(c.tensor, -1), c.round)
    calls = {}
    for c in chunks:  # the last step's chunks, by call (the tensor name is the call's, then the leaf's path)
        if c.round != last_round[c.tensor]:
            continue
        call = c.tensor.split("[", 1)[0]
        entered, pushed, acked = calls.get(call, (float("inf"), float("inf"), float("inf")))
        calls[call] = (min(entered, c.queued), min(pushed, c.sent_start), min(acked, c.acked))
    sys.stdout.write(json.dumps({"rank": rank, "checksum": checksum, "calls": calls, "schedule": schedule}) + "\n")


def side_stream_schedule(hlo: str) -> dict:
    """In the entry computation's schedule (the compiled text lists it in
    order): the positions of the async starts and dones XLA made of the
    stream-annotated calls, and of the other instructions."""
    entry = hlo[hlo.index("ENTRY") :]
    lines = [line.strip() for line in entry[: entry.index("\n}")].splitlines()[1:]]
    starts = [i for i, line in enumerate(lines) if re.search(r"-start\(", line) and "_xla_stream_annotation" in line]
    dones = [i for i, line in enumerate(lines) if re.search(r"-done\(", line) and "_xla_stream_annotation" in line]
    others = [i for i in range(len(lines)) if i not in starts and i not in dones and "parameter(" not in lines[i]]
    return {
        "starts": starts,
        "dones": dones,
        "others": others,
        "custom_calls": hlo.count('custom_call_target="jbps_psum"'),
    }


if __name__ == "__main__":
    main()
