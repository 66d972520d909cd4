"""A data-parallel training step written two ways, timed side by side in one run:
jit over a mesh with jbps.value_and_grad (the program of today, no psum
written) against shard_map with jbps.optax.distributed (jbps's psum inside the
mapped step). The same MLP, batch, optimizer and devices; blocks of steps of
each alternate, so drift on a shared machine hits both alike.

    jbps run -n 2 --local-devices 2 python -m benchmarks.data_parallel [--width 512] [--layers 4]
        [--batch 256] [--blocks 6] [--block-steps 5] [--json]

Rank 0 prints each style's median step time and their ratio (jit / shard_map;
issue goal <= 1.05), and the largest parameter difference between the two
styles after the run (they train the same model from the same start).

On emulated hosts (root; emulated_network.py), one worker host each with a
colocated server, and CPU hosts:

    python -m benchmarks.data_parallel --hosts 2 [--cpu-hosts 1] [--rate 200M] [--local-devices 2] [...]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jbps

try:
    from jax import shard_map
except ImportError:  # jax < 0.7
    from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]


def init(layers: int, width: int):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32) for _ in range(layers)]


def loss(params, x, y):
    for w in params[:-1]:
        x = jnp.tanh(x @ w)
    return jnp.mean((x @ params[-1] - y) ** 2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=256, help="per worker, split over its devices")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--block-steps", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--hosts", type=int, default=0, help="run on this many emulated worker hosts (root)")
    p.add_argument("--cpu-hosts", type=int, default=0, help="with --hosts: emulated CPU hosts with a server each")
    p.add_argument("--rate", default="200M", help="with --hosts: each NIC's rate each way, bits/s")
    p.add_argument("--local-devices", type=int, default=2, help="with --hosts: each worker's CPU devices")
    args = p.parse_args(argv)
    if args.hosts:
        return on_emulated_hosts(args)

    jbps.init()
    mesh = Mesh(np.array(jax.local_devices()), ("data",))
    tx = optax.sgd(1e-3)
    rng = np.random.default_rng(jbps.rank())
    x = jax.device_put(rng.standard_normal((args.batch, args.width)).astype(np.float32), NamedSharding(mesh, P("data")))
    y = jax.device_put(rng.standard_normal((args.batch, args.width)).astype(np.float32), NamedSharding(mesh, P("data")))

    vg = jbps.value_and_grad(loss, mesh=mesh, name="jit-style")

    @jax.jit
    def jit_step(params, opt_state, x, y):
        value, grads = vg(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    dtx = jbps.optax.distributed(optax.sgd(1e-3), axis_name="data", name="shard_map-style")

    def mapped(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = dtx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(value, "data")

    map_step = jax.jit(
        shard_map(mapped, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P(), P()))
    )

    styles = {"jit": [jit_step, None, None], "shard_map": [map_step, None, None]}
    for style in styles.values():
        style[1] = init(args.layers, args.width)
        style[2] = (tx if style[0] is jit_step else dtx).init(style[1])
    times: dict[str, list[float]] = {name: [] for name in styles}
    for block in range(args.blocks + 1):  # block 0 compiles and warms up
        for name, style in styles.items():
            step, params, opt_state = style
            for _ in range(args.block_steps):
                start = time.perf_counter()
                params, opt_state, value = step(params, opt_state, x, y)
                jax.block_until_ready(params)
                if block:
                    times[name].append(time.perf_counter() - start)
            style[1], style[2] = params, opt_state
    median = {name: float(np.median(t)) for name, t in times.items()}
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(styles["jit"][1], styles["shard_map"][1])
    )
    report = {
        "workers": jbps.size(),
        "devices": len(mesh.devices),
        "gradient_mib": args.layers * args.width * args.width * 4 / 2**20,
        "median_s": median,
        "total_s": {name: float(np.sum(t)) for name, t in times.items()},  # stalls included
        "ratio_jit_over_shard_map": median["jit"] / median["shard_map"],
        "largest_parameter_difference": diff,
    }
    if jbps.rank() == 0:
        if args.json:
            print(json.dumps(report))
        else:
            print(
                f"{report['workers']} worker(s) x {report['devices']} devices, {report['gradient_mib']:.0f} MiB of "
                f"gradients: jit + jbps.value_and_grad {median['jit'] * 1e3:.1f} ms, shard_map + "
                f"jbps.optax.distributed {median['shard_map'] * 1e3:.1f} ms a step (medians of "
                f"{len(times['jit'])}); ratio {report['ratio_jit_over_shard_map']:.3f}; "
                f"parameters differ by at most {diff:.1e}"
            )
    jbps.shutdown()


def on_emulated_hosts(args) -> None:
    """This benchmark as a job on emulated hosts; prints rank 0's report."""
    from .emulated_job import job_free_env, run_job
    from .emulated_network import EmulatedNetwork

    n, k = args.hosts, args.cpu_hosts
    model = {"--width": args.width, "--layers": args.layers, "--batch": args.batch, "--blocks": args.blocks}
    model["--block-steps"] = args.block_steps
    worker_argv = ["-m", "benchmarks.data_parallel", "--json"] + [str(a) for kv in model.items() for a in kv]
    with EmulatedNetwork(n + k, args.rate) as net:
        result = run_job(
            net, list(range(n)), list(range(n + k)), worker_argv, env=job_free_env(), local_devices=args.local_devices
        )
    report = json.loads(result.workers[0].stdout.strip().splitlines()[-1])
    report.update(hosts=n, cpu_hosts=k, rate=args.rate)
    if args.json:
        print(json.dumps(report))
    else:
        median = report["median_s"]
        print(
            f"{n} worker hosts + {k} CPU hosts at {args.rate}bit/s, {args.local_devices} devices each, "
            f"{report['gradient_mib']:.0f} MiB of gradients: jit + jbps.value_and_grad {median['jit'] * 1e3:.1f} ms, "
            f"shard_map + jbps.optax.distributed {median['shard_map'] * 1e3:.1f} ms a step; "
            f"ratio {report['ratio_jit_over_shard_map']:.3f}; parameters differ by at most "
            f"{report['largest_parameter_difference']:.1e}"
        )


if __name__ == "__main__":
    main()
