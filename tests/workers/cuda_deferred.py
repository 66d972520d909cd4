"""On CUDA an engine error arrives after the handler returned, so it fails the
*next* jbps_psum (unless JBPS_CUDA_SYNC=1). Worker 1's leaf 'b' differs in
shape from worker 0's; then each worker psums twice more. Prints {"rank",
"first_error", "second_error", "recovered"}."""

import json

import jax
import jax.numpy as jnp
import numpy as np

import jbps


def attempt(fn, *args):
    try:
        jax.block_until_ready(fn(*args))
        return None
    except Exception as exc:  # XLA's runtime error type differs across jax versions
        return str(exc)


def main():
    jbps.init()
    rank = jbps.rank()
    tree = {"a": jnp.ones(8, jnp.float32), "b": jnp.ones(7 if rank == 1 else 6, jnp.float32)}
    first = attempt(jax.jit(lambda t: jbps.psum(t, name="mismatched")), tree)
    second = attempt(jax.jit(lambda x: jbps.psum(x, name="next")), jnp.ones(4, jnp.float32))
    good = jax.jit(lambda x: jbps.psum(x, name="after"))(jnp.full(5, rank + 1.0, jnp.float32))
    recovered = bool(np.all(np.asarray(good) == sum(range(1, jbps.size() + 1))))
    jbps.shutdown()
    print(json.dumps({"rank": rank, "first_error": first, "second_error": second, "recovered": recovered}), flush=True)


if __name__ == "__main__":
    main()
