"""One worker of `python -m benchmarks.overlap`: a training step of a model
(benchmarks/step_models.py: an MLP, the examples' ResNet or transformer),
timed, with the gradients reduced one way or another.

    python -m benchmarks.step_worker --mode MODE [--model mlp] [--layers 4] [--width 1024] [--batch 512]
                                     [--steps 8] [--warmup 2] [--bucket-bytes N] [--scan N]
                                     [--coordinator H:P --num-processes N --process-id I]   (gloo)

MODE: compute (no communication: the step alone, what every worker computes),
comm (jbps.psum of the step's gradients alone, no compute in the timed call),
jbps (the step with jbps.optax.distributed; --bucket-bytes 0: one call, else
buckets, default JBPS_BUCKET_BYTES; --scan N: N steps a program, jbps.scan,
each timed step a program, its time over N), gloo (the step with JAX's own pmean over
gloo, jax.distributed across the hosts). Prints one JSON line: this process's
median and every step's time, and the machine's CPU time over the timed steps;
with jbps, the workers' parameters are checked equal at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from benchmarks import cpu_load, step_models  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("compute", "comm", "jbps", "gloo"), required=True)
    step_models.add_model_flags(p, layers=4, batch=512, steps=8)
    p.add_argument("--bucket-bytes", type=int, default=None)
    p.add_argument("--scan", type=int, default=0, help="jbps mode: this many steps a program (jbps.scan)")
    p.add_argument("--coordinator")
    p.add_argument("--num-processes", type=int)
    p.add_argument("--process-id", type=int)
    return p.parse_args(argv)


def time_steps(run, steps: int, warmup: int) -> tuple[list[float], list[tuple[float, float]], dict]:
    """Each timed step's seconds, its start and end in microseconds since the
    epoch (the trace's clock), and the machine's CPU time per timed step
    (every emulated host's, as they share the machine: cpu_load.Meter)."""
    times, spans = [], []
    meter = cpu_load.Meter()
    for i in range(warmup + steps):
        start = time.time()
        t = time.perf_counter()
        with meter if i >= warmup else contextlib.nullcontext():
            run()
        if i >= warmup:
            times.append(time.perf_counter() - t)
            spans.append((start * 1e6, time.time() * 1e6))
    return times, spans, meter.per_call()


def main(argv=None):
    args = parse_args(argv)
    if args.mode == "gloo":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_num_cpu_devices", 1)
        jax.distributed.initialize(
            coordinator_address=args.coordinator, num_processes=args.num_processes, process_id=args.process_id
        )
        rank = jax.process_index()
    elif args.mode in ("jbps", "comm"):
        import jbps

        jbps.init()
        rank = jbps.rank()
    else:
        rank = 0
    model = step_models.build(args.model, args.layers, args.width, args.batch, rank)
    params, loss, inputs = model.params, model.loss, model.inputs
    tx = optax.sgd(0.01)
    report = {
        "mode": args.mode,
        "bucket_bytes": args.bucket_bytes,
        "grad_bytes": sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)),
        "model": model.describe,
        "samples": args.batch,
    }
    state = tx.init(params)

    if args.mode == "compute":

        @jax.jit
        def step(params, state):
            updates, state = tx.update(jax.grad(loss)(params, *inputs), state, params)
            return optax.apply_updates(params, updates), state
    elif args.mode == "jbps":
        import jbps

        dist = jbps.optax.distributed(tx, bucket_bytes=args.bucket_bytes, name="grads")
        state = dist.init(params)

        def one(carry, _):
            params, state = carry
            updates, state = dist.update(jax.grad(loss)(params, *inputs), state, params)
            return (optax.apply_updates(params, updates), state), None

        @jax.jit
        def step(params, state):
            if args.scan:
                return jbps.scan(one, (params, state), length=args.scan)[0]
            return one((params, state), None)[0]
    elif args.mode == "comm":
        import jbps

        grads = jax.jit(jax.grad(loss))(params, *inputs)
        psum = jax.jit(lambda g: jbps.psum(g, name="grads"))
        holder = [grads]

        def run():
            holder[0] = jax.block_until_ready(psum(holder[0]))
    else:  # gloo: the same step with lax.pmean over the processes' devices
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        mesh = Mesh(np.array(jax.devices()), ("i",))
        shard_map = getattr(jax, "shard_map", None)
        if shard_map is None:
            from jax.experimental.shard_map import shard_map
        replicated = NamedSharding(mesh, P())

        def body(params, state, *inputs):
            grads = jax.lax.pmean(jax.grad(loss)(params, *(a[0] for a in inputs)), "i")
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        specs = (P(), P()) + (P("i"),) * len(inputs)
        sharded = jax.jit(shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P())))
        local = [jax.device_put(a[None], jax.local_devices()[0]) for a in inputs]
        global_inputs = [
            jax.make_array_from_single_device_arrays(
                (args.num_processes,) + a.shape[1:], NamedSharding(mesh, P("i")), [a]
            )
            for a in local
        ]
        params = jax.device_put(params, replicated)
        state = jax.device_put(state, replicated)

        def step(params, state):
            return sharded(params, state, *global_inputs)

    if args.mode != "comm":
        box = [params, state]

        def run():
            box[0], box[1] = jax.block_until_ready(step(box[0], box[1]))

    times, spans, cpu = time_steps(run, args.steps, args.warmup)
    if args.mode == "jbps" and args.scan:  # a timed run is a program of args.scan steps
        times = [t / args.scan for t in times]
        cpu = {**cpu, "busy_core_s": cpu["busy_core_s"] / args.scan}
    # The step of median time, to draw (an odd count has one).
    middle = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
    report.update(rank=rank, median_s=float(np.median(times)), times_s=times, median_step_us=spans[middle])
    report["cpu_core_s_per_step"] = cpu["busy_core_s"]
    report["cpu"] = cpu
    if args.mode == "jbps":
        import jbps

        # Every worker ends with the same parameters: compare through one more psum.
        flat = jnp.concatenate([jnp.ravel(v) for v in jax.tree_util.tree_leaves(box[0])])
        total = jax.jit(lambda v: jbps.psum(v, name="check"))(flat)
        report["params_equal"] = bool(jnp.allclose(total, flat * jbps.size(), rtol=1e-6, atol=1e-6))
        jbps.shutdown()
    elif args.mode == "comm":
        jbps.shutdown()
    elif args.mode == "gloo":
        jax.distributed.shutdown()
    sys.stdout.write(json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
