"""A worker's use of its elastic job's compilation cache (jbps/compile_cache.py), step by step.

    job_cache_member.py SCHEDULER SECRET [--compile-first]

Compiles a program first where --compile-first says (as a user's model
initialisation does before jbps.elastic.run), takes the job's cache
(compile_cache.use), compiles the same step every member of a job compiles,
and prints {"dir", "hits"} (jax's cache directory then, and the programs its
persistent cache gave instead of a compile). Then waits for a line on stdin:
"leave" leaves the cache and prints {"removed", "dir_after"}; nothing more
comes where the test kills it instead.
"""

import json
import sys

import jax
import jax.numpy as jnp

from jbps import compile_cache


def main():
    scheduler, secret = sys.argv[1], sys.argv[2]
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    )
    if "--compile-first" in sys.argv:
        jax.jit(lambda x: x - 1.0)(jnp.ones(3)).block_until_ready()
    cache = compile_cache.use(scheduler, secret)
    step = jax.jit(lambda w, g: w - 0.1 * jnp.tanh(g) @ jnp.ones((16, 16)))
    step(jnp.ones((4, 16)), jnp.ones((4, 16))).block_until_ready()
    print(json.dumps({"dir": jax.config.jax_compilation_cache_dir, "used": cache is not None, "hits": len(hits)}))
    sys.stdout.flush()
    if sys.stdin.readline().strip() == "leave":
        removed = cache.leave() if cache is not None else False
        print(json.dumps({"removed": removed, "dir_after": jax.config.jax_compilation_cache_dir}))


if __name__ == "__main__":
    main()
