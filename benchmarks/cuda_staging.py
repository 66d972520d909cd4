"""The CUDA handler's costs on a GPU machine (first run on an H100 on
2026-11-26: docs/guide/gpus.md has the numbers, docs/cuda-staging-h100.json
the document).

    python -m benchmarks.cuda_staging [--sizes 4M,64M] [--iters 20] [--out results.json]

One process, running alone (an in-process summation server on loopback), so
the network part is the same for both backends:
- staging: jbps.psum of one float32 tensor on the GPU and on the CPU backend;
  the difference is what staging through pinned memory adds, shown next to a
  plain pinned cudaMemcpy each way (D2H + H2D) timed in the same run;
- per-call overhead: the same for a 4 KiB tensor;
- a flax MLP training step on the GPU with optax.adam and with
  jbps.optax.distributed(optax.adam).
Prints one JSON document (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jbps  # noqa: E402
from benchmarks.cxx_hooks import hooks  # noqa: E402
from jbps.sizes import parse_bytes  # noqa: E402


def median_seconds(fn, arg, iters: int) -> float:
    jax.block_until_ready(fn(arg))  # compile and warm the staging pool
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def psum_seconds(nbytes: int, device, iters: int) -> float:
    x = jax.device_put(jnp.ones(nbytes // 4, jnp.float32), device)
    return median_seconds(jax.jit(lambda v: jbps.psum(v, name=f"bench{nbytes}")), x, iters)


def flax_step_seconds(use_jbps: bool, iters: int) -> float:
    import flax.linen as nn
    import optax

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (1024, 1024, 10):
                x = nn.Dense(width)(x)
                x = nn.relu(x) if width != 10 else x
            return x

    model = MLP()
    x = jnp.ones((256, 784), jnp.float32)
    y = jnp.zeros((256,), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    tx = jbps.optax.distributed(optax.adam(1e-3)) if use_jbps else optax.adam(1e-3)
    state = (params, tx.init(params))

    @jax.jit
    def step(state):
        params, opt = state

        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

        updates, opt = tx.update(jax.grad(loss)(params), opt, params)
        return optax.apply_updates(params, updates), opt

    return median_seconds(step, state, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4M,64M", help="comma-separated tensor sizes: bytes, or 64K, 4M, 1G")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args()
    if not jbps.has_cuda_support():
        raise SystemExit("jbps was built without the CUDA handler (see JBPS_CUDA in docs/guide/gpus.md)")
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    try:
        sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        p.error(f"--sizes: {exc}")
    report = {"device": gpu.device_kind, "jax": jax.__version__, "iters": args.iters, "staging": []}
    with jbps.init():
        for nbytes in sizes:
            d2h, h2d = hooks().cuda_pinned_copy_seconds(nbytes, args.iters)
            on_gpu, on_cpu = psum_seconds(nbytes, gpu, args.iters), psum_seconds(nbytes, cpu, args.iters)
            report["staging"].append(
                {
                    "bytes": nbytes,
                    "psum_gpu_s": on_gpu,
                    "psum_cpu_s": on_cpu,
                    "staging_added_s": on_gpu - on_cpu,
                    "pinned_memcpy_d2h_s": d2h,
                    "pinned_memcpy_h2d_s": h2d,
                    "pinned_memcpy_GBps": 2 * nbytes / (d2h + h2d) / 1e9,
                    "staging_GBps": 2 * nbytes / max(on_gpu - on_cpu, 1e-9) / 1e9,
                }
            )
        report["per_call_4KiB"] = {
            "gpu_s": psum_seconds(4096, gpu, args.iters * 10),
            "cpu_s": psum_seconds(4096, cpu, args.iters * 10),
        }
        report["flax_mlp_step"] = {
            "without_jbps_s": flax_step_seconds(False, args.iters),
            "with_jbps_s": flax_step_seconds(True, args.iters),
        }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
