"""A worker of a jbps job: sums a gradient-like tree over every device of
every worker with jbps.psum inside pmap, and checks the result.

Run it as a job on this machine (2 workers with 2 devices each):

    jbps run -n 2 --local-devices 2 python examples/psum_pmap.py

or start servers and workers any other way (docs/guide/starting-jobs.md).
"""

import jax
import jax.numpy as jnp
import numpy as np

import jbps


def fake_grads(worker, device):
    rng = np.random.default_rng([worker, device])
    return {
        "dense": {
            "kernel": rng.standard_normal((256, 128)).astype(np.float32),
            "bias": rng.standard_normal(128).astype(np.float32),
        },
        "embed": rng.standard_normal((1000, 64)).astype(jnp.bfloat16),
    }


def main():
    jbps.init()  # JBPS_SERVERS, JBPS_NUM_WORKERS, JBPS_WORKER_RANK
    rank, workers, L = jbps.rank(), jbps.size(), jax.local_device_count()
    grads = jax.tree_util.tree_map(lambda *x: np.stack(x), *[fake_grads(rank, d) for d in range(L)])

    step = jax.pmap(lambda g: jbps.psum(g, "i"), axis_name="i")
    out = step(grads)

    everyone = [fake_grads(w, d) for w in range(workers) for d in range(L)]
    want = np.sum([g["dense"]["kernel"] for g in everyone], axis=0)
    err = np.abs(np.asarray(out["dense"]["kernel"][0]) - want).max()
    print(
        f"worker {rank}/{workers}: summed {L} local devices x {workers} workers, "
        f"kernel[0,:3]={np.asarray(out['dense']['kernel'][0, 0, :3])}, max error vs numpy {err:.2e}"
    )
    jbps.shutdown()


if __name__ == "__main__":
    main()
