"""A worker that trains (one psum per step) until --steps, except that rank
--raise-rank raises ValueError at step --raise-step: a bug in one worker's
own code. Prints "step N" after each psum. With --linger S the raising
worker takes S more seconds to exit after saying goodbye, so the others, failed
on its account, exit first."""

import argparse
import atexit
import time

import jax
import jax.numpy as jnp

import jbps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--raise-rank", type=int, default=1)
    p.add_argument("--raise-step", type=int, default=20)
    p.add_argument("--linger", type=float, default=0.0)
    p.add_argument(
        "--stall", action="store_true", help="the rank stops calling psum instead of raising; the others dispatch on"
    )
    args = p.parse_args()
    atexit.register(time.sleep, args.linger)  # runs after jbps's own exit handler (registered later) says goodbye
    jbps.init()
    step_fn = jax.jit(lambda x: jbps.psum(x))
    x = jnp.ones(1024, jnp.float32)
    for step in range(args.steps):
        if jbps.rank() == args.raise_rank and step == args.raise_step:
            if args.stall:
                time.sleep(3600)  # alive, never pushing again: the others' psums time out
            raise ValueError(f"a bug in worker {jbps.rank()}'s own code at step {step}")
        x = step_fn(x) / jbps.size()
        if not args.stall:  # with --stall the others dispatch steps back to back, as a training loop does
            x.block_until_ready()
            print(f"step {step}", flush=True)
    x.block_until_ready()


if __name__ == "__main__":
    main()
