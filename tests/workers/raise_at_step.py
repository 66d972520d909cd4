"""A worker that trains (one psum per step) until --steps, except that rank
--raise-rank raises ValueError at step --raise-step: a bug in one worker's
own code. Prints "step N" after each psum."""

import argparse

import jax
import jax.numpy as jnp

import jbps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--raise-rank", type=int, default=1)
    p.add_argument("--raise-step", type=int, default=20)
    args = p.parse_args()
    jbps.init()
    step_fn = jax.jit(lambda x: jbps.psum(x))
    x = jnp.ones(1024, jnp.float32)
    for step in range(args.steps):
        if jbps.rank() == args.raise_rank and step == args.raise_step:
            raise ValueError(f"a bug in worker {jbps.rank()}'s own code at step {step}")
        x = step_fn(x) / jbps.size()
        x.block_until_ready()
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    main()
