"""Benchmark worker: jbps.psum of one float32 buffer, timed like the peer tools; optionally
the many-small-tensors case (a tree against one buffer of the same bytes) and the
memory case (see memory.py).

Run as every worker of a jbps job (LocalCluster sets JBPS_SERVERS,
JBPS_NUM_WORKERS and JBPS_WORKER_RANK), e.g.
    python -m benchmarks.jbps_worker --sizes 4194304,67108864 --iters 40,10 --warmup 2 \
        [--out-of-place] [--stages] \
        [--tree-sizes 4096,65536,... --tree-iters 20] [--memory 268435456,5,4194304,1000]
Rank 0 prints one JSON line: {"tool": ..., "results": {"<bytes>": {...}}, "small_tensors": {...}, "memory": {...}}.
--out-of-place also times each size with the input kept alive (a fresh output every call),
calls alternating with the in-place ones; --stages adds rank 0's latency breakdown (stages.py).
The memory case runs first, while the process holds nothing else.
"""

import argparse
import contextlib
import json
import os
import sys
import time

# Must be set before jax creates its backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jbps  # noqa: E402
from jbps import _core  # noqa: E402
from benchmarks import cpu_load, memory, rate_change  # noqa: E402
from benchmarks.report import summarize, with_cpu  # noqa: E402
from benchmarks.stages import call_stages, typical_stages  # noqa: E402
from jbps.ops import compression, topk  # noqa: E402
from jbps.ops.psum import psum_with_feedback  # noqa: E402
from jbps.optax import zero_residuals  # noqa: E402

TOOL = "jbps psum"


def _compression_arg(text: str) -> str:
    """--compression: bf16, fp16, onebit, topk or topk:FRACTION (compression.py's check)."""
    try:
        compression.check(text, "--compression", stateful_ok=True)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sizes", required=True, help="comma-separated buffer sizes in bytes")
    p.add_argument(
        "--iters", default="10", help="timed calls: one number for every size, or one per size (comma-separated)"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--tree-sizes", default="", help="many small tensors: the tree's leaf sizes in bytes (comma-separated)"
    )
    p.add_argument(
        "--tree-iters", type=int, default=20, help="many small tensors: timed calls of the tree and of the flat buffer"
    )
    p.add_argument(
        "--memory", default="", help="memory: PEAK_BYTES,PEAK_ROUNDS,ROUND_BYTES,ROUNDS (see benchmarks/memory.py)"
    )
    p.add_argument("--server-pids", default="", help="memory: the servers' PIDs, read by worker 0")
    p.add_argument(
        "--out-of-place",
        action="store_true",
        help="also time each size with its input kept alive (XLA gives the sum a fresh output)",
    )
    p.add_argument("--stages", action="store_true", help="also report the latency breakdown (stages.py)")
    p.add_argument(
        "--pause-at",
        type=int,
        default=None,
        help="worker 0 waits for the bench before this timed call of the first size (rate_change.py)",
    )
    p.add_argument("--pause-file", default=None, help="the file --pause-at says it paused in (rate_change.py)")
    p.add_argument("--cpu", action="store_true", help="also the machine's CPU time per timed call (cpu_load.py)")
    p.add_argument(
        "--compression",
        type=_compression_arg,
        default=None,
        help="the timed psums' compression: bf16, fp16, onebit, topk or topk:FRACTION "
        "(jbps.psum's compression=; onebit and topk with their residuals)",
    )
    args = p.parse_args(argv)
    args.tree_sizes = [int(s) for s in args.tree_sizes.split(",") if s]
    args.memory = [int(s) for s in args.memory.split(",") if s]
    if args.memory and len(args.memory) != 4:
        p.error("--memory needs PEAK_BYTES,PEAK_ROUNDS,ROUND_BYTES,ROUNDS")
    args.server_pids = [int(s) for s in args.server_pids.split(",") if s]
    if (args.pause_at is None) != (args.pause_file is None):
        p.error("--pause-at and --pause-file go together")
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    iters = [int(s) for s in args.iters.split(",") if s]
    if len(iters) == 1:
        iters *= len(args.sizes)
    if len(iters) != len(args.sizes) or min(iters, default=1) < 1:
        p.error("--iters needs one positive number, or one per size")
    args.iters = iters
    return args


# One jitted function serves every barrier: the same name and shape each time.
_barrier = jax.jit(lambda x: jbps.psum(x, name="bench.barrier"))
_ONE = jnp.ones((1,), jnp.float32)


def barrier():
    """A tiny psum: it returns only after every worker has pushed, like MPI Barrier."""
    _barrier(_ONE).block_until_ready()


def gather_times(times, tag):
    """Every worker's timings, as a (workers, iters) array, summed through jbps itself."""
    rows = np.zeros((jbps.size(), len(times)), np.float32)
    rows[jbps.rank()] = times
    gather = jax.jit(lambda t: jbps.psum(t, name=f"bench.times.{tag}"))
    return np.asarray(gather(jnp.asarray(rows)))


def check_sum(out, what):
    """Every worker contributed rank+1 to every element: the sum is known without communication.
    With topk, of each block of equal values the first `keep` travel (ties go to the lower index)."""
    world = jbps.size()
    expected = world * (world + 1) / 2
    for i, y in enumerate(jax.tree_util.tree_leaves(out)):
        y = np.asarray(y)
        want = np.full(y.shape, expected, np.float32)
        codec = compression.feedback_codec(_compression)
        if isinstance(codec, topk.TopK) and codec.compressed(y.shape, y.dtype):
            want = np.where(np.arange(y.size).reshape(y.shape) % topk.BLOCK < codec.keep, want, np.float32(0))
        if not np.array_equal(y, want):
            bad = np.flatnonzero(y != want)
            raise RuntimeError(
                f"rank {jbps.rank()}: wrong psum result for {what} (leaf {i}): {bad.size} elements "
                f"differ, e.g. y[{bad[0]}] = {y.reshape(-1)[bad[0]]} (expected {want.reshape(-1)[bad[0]]})"
            )


def in_place(name):
    """The psum as a training step runs it: on buffers XLA can give up (dead gradients; here a
    donated argument), so each sum lands in its own input's buffer (jbps's custom call aliases
    them) and no fresh output is allocated. As MPI_IN_PLACE for the MPI peer, which reuses its
    buffers too."""
    if compression.stateful(_compression):
        return _WithFeedback(name, donate_values=True)
    return jax.jit(_summed(name), donate_argnums=0)


# --compression: the timed psums send 16-bit floats, onebit or topk records (the
# values, the same small integer throughout a leaf, stay exact; topk keeps `keep` of each block).
_compression = None


def _summed(name):
    """The timed psum of a tree, without error feedback."""
    return lambda t: jbps.psum(t, name=name, compression=_compression)


class _WithFeedback:
    """The timed psum with onebit or topk as a training step runs it: the residuals go in and come
    out (donated, as an optimizer's state), read and written by the same program as the sums.
    They are zeros again before every call (refill, untimed), so every call sends the same
    records and check_sum knows their sum."""

    def __init__(self, name, donate_values):
        def step(t, r):
            return psum_with_feedback(t, r, name=name, compression=_compression)

        self._step = jax.jit(step, donate_argnums=(0, 1) if donate_values else 1)
        self._zero = jax.jit(lambda r: jax.tree_util.tree_map(jnp.zeros_like, r), donate_argnums=0, keep_unused=True)
        self._residuals = None

    def refill(self):
        if self._residuals is not None:
            self._residuals = jax.block_until_ready(self._zero(self._residuals))

    def __call__(self, t):
        if self._residuals is None:
            self._residuals = zero_residuals(t)
        y, self._residuals = self._step(t, self._residuals)
        return y


def refilled(f, x):
    """Untimed, before every call: each worker's contribution back to rank+1, and f's residuals
    (with error feedback) back to zeros."""
    if isinstance(f, _WithFeedback):
        f.refill()
    return jax.block_until_ready(_refill(x))


# Untimed, before every call: each worker's contribution back to rank+1, in the same buffers
# (keep_unused: jit otherwise drops the unread argument, and its donation with it, and every
# refill faulted in a fresh buffer's pages, 8,193 of them for 32 MiB).
_refill = jax.jit(
    lambda t: jax.tree_util.tree_map(lambda a: jnp.full_like(a, jbps.rank() + 1), t), donate_argnums=0, keep_unused=True
)


def checked_call(f, x, what):
    """One call whose result is checked; returns what the engine counted for it, and the
    buffers (the input was donated)."""
    x = refilled(f, x)
    before = jbps.engine_stats()
    y = f(x)
    jax.block_until_ready(y)
    after = jbps.engine_stats()
    check_sum(y, what)
    return {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}, y


def out_of_place(name):
    """The psum of an input that stays alive (`jax.jit(lambda g: jbps.psum(g))(g)` with g used
    again): XLA copies it into a fresh output buffer every call and the sum lands there. As an
    MPI Allreduce into a separate receive buffer; the MPI peer reuses its receive buffer."""
    if compression.stateful(_compression):
        return _WithFeedback(name, donate_values=False)
    return jax.jit(_summed(name))


def _stamped(run, stages_of, meter=None):
    """Seconds of run() after a barrier, its result, and with stages_of (the call's name; stage
    timing on) the call's stages; a cpu_load.Meter counts the machine's CPU time over it."""
    barrier()  # start all workers together; otherwise we time skew
    if stages_of is not None:
        _core.engine_take_stages()  # the barrier's and anything earlier
    with meter or contextlib.nullcontext():
        t0 = time.perf_counter_ns()
        y = run()
        t1 = time.perf_counter_ns()
    stages = None
    if stages_of is not None:
        mine = [r for r in _core.engine_take_stages() if r["name"] == stages_of]
        stages = call_stages(mine[-1], t0, t1) if mine else None
    return (t1 - t0) * 1e-9, y, stages


def timed_call(f, x, stages_of=None, meter=None):
    """Seconds of one call, the buffers to use next (the input was donated), and its stages."""
    x = refilled(f, x)
    return _stamped(lambda: jax.block_until_ready(f(x)), stages_of, meter)


def timed_fresh_call(f, x, stages_of=None):
    """Seconds of one out-of-place call and its stages: the input stays, the output is fresh and
    freed after, before the next call allocates its own, as a step's dead output would be."""
    if isinstance(f, _WithFeedback):
        f.refill()
    t, _, stages = _stamped(lambda: jax.block_until_ready(f(x)), stages_of)
    return t, stages


def slowest(times, tag):
    """The slowest worker's time per call (the sum is done only when all have it): the summary, and each call's."""
    per_call = gather_times(times, tag).max(axis=0).tolist()
    return {**summarize(per_call), "per_call_s": per_call}


def bench_size(nbytes, iters, warmup, fresh=False, stages=False, cpu=False, pause=None):
    """In place; with `fresh` also out of place, calls alternating so that both see the same
    machine; with `stages` the median latency breakdown of rank 0's calls; with `cpu` the
    machine's CPU time per in-place call; with `pause` (call, file) worker 0 waits for the
    bench before that call (rate_change.py)."""
    x = jnp.full((nbytes // 4,), jbps.rank() + 1, jnp.float32)
    name = f"bench.{nbytes}"
    f = in_place(name)
    for _ in range(warmup):
        x = f(refilled(f, x)).block_until_ready()
    # One checked call, also measuring what a call sends (warm-up compiled it).
    engine, x = checked_call(f, x, f"{nbytes} bytes")
    if fresh:
        fresh_name = f"bench.fresh.{nbytes}"
        g = out_of_place(fresh_name)
        kept = jnp.full((nbytes // 4,), jbps.rank() + 1, jnp.float32)
        for _ in range(warmup):
            jax.block_until_ready(g(kept))
        if isinstance(g, _WithFeedback):
            g.refill()
        check_sum(g(kept), f"{nbytes} bytes out of place")
    _core.engine_set_stage_timing(stages)
    times, fresh_times, parts, fresh_parts = [], [], [], []
    meter = cpu_load.Meter(on=cpu and jbps.rank() == 0)  # the machine's: one worker counts it
    try:
        marks = [jbps.engine_stats()] if pause is not None else []  # around the rate change
        for i in range(iters):
            if pause is not None and i == pause[0]:
                marks.append(jbps.engine_stats())
                if jbps.rank() == 0:
                    rate_change.pause_for_change(pause[1])
            t, x, part = timed_call(f, x, name if stages else None, meter)
            times.append(t)
            parts.append(part)
            if fresh:
                t, part = timed_fresh_call(g, kept, fresh_name if stages else None)
                fresh_times.append(t)
                fresh_parts.append(part)
    finally:
        _core.engine_set_stage_timing(False)
    out = {
        **with_cpu(slowest(times, nbytes), meter),
        "bytes_pushed_per_call": engine["bytes_pushed"],
        "bytes_pulled_per_call": engine["bytes_pulled"],
        "engine_per_call": engine,
        "partition_bytes": jbps.runtime.partition_bytes(nbytes),
        "replans": jbps.runtime.replans(),  # the rate follower's splits so far (replan.py)
    }
    if pause is not None:
        marks.append(jbps.engine_stats())
        out["server_answer_rates"] = {
            "before": rate_change.answer_rates(marks[0], marks[1]),
            "after": rate_change.answer_rates(marks[1], marks[2]),
        }
    if fresh:
        out["out_of_place"] = slowest(fresh_times, f"fresh.{nbytes}")
    if stages:
        out["stages"] = typical_stages(parts)
        if fresh:
            out["out_of_place"]["stages"] = typical_stages(fresh_parts)
    return out


def bench_tree(leaf_bytes, iters, warmup):
    """Many small tensors: one psum of a tree of float32 leaves against one of a buffer of the same total bytes,
    calls alternating so that both see the same machine."""
    rank = jbps.rank()
    tree = [jnp.full((b // 4,), rank + 1, jnp.float32) for b in leaf_bytes]
    flat = jnp.full((sum(leaf_bytes) // 4,), rank + 1, jnp.float32)
    fns = {"tree": in_place("bench.small_tensors.tree"), "flat": in_place("bench.small_tensors.flat")}
    bufs = {"tree": tree, "flat": flat}
    out = {}
    for key, f in fns.items():
        for _ in range(warmup):
            bufs[key] = jax.block_until_ready(f(_refill(bufs[key])))
        engine, bufs[key] = checked_call(f, bufs[key], f"the small tensors' {key}")
        out[key] = {"engine_per_call": engine}
    times = {key: [] for key in fns}
    for _ in range(iters):
        for key, f in fns.items():
            t, bufs[key], _ = timed_call(f, bufs[key])
            times[key].append(t)
    for key in fns:
        out[key].update(slowest(times[key], f"small_tensors.{key}"))
    return {
        "tool": TOOL,
        "leaves": len(leaf_bytes),
        "bytes": sum(leaf_bytes),
        **out,
        "tree_over_flat": out["tree"]["median_s"] / out["flat"]["median_s"],
    }


def main(argv=None):
    global _compression
    args = parse_args(argv)
    _compression = args.compression
    jbps.init()
    try:
        report = {"tool": TOOL, "workers": jbps.size(), "link_bytes_per_s": jbps.runtime.link_bytes_per_s()}
        report["servers"] = list(jbps.runtime.config().servers)  # the order of engine_stats' per-server lists
        report["link_probes"] = list(jbps.link_rate.probes)  # (bytes, seconds) behind that rate
        rates = jbps.runtime.server_rates()  # each server's link as jbps.init measured it, and the split it led to
        report["server_rates_bytes_per_s"] = None if rates is None else list(rates)
        report["server_fractions"] = list(jbps.runtime.server_fractions())
        if args.memory:
            peak_bytes, peak_rounds, round_bytes, rounds = args.memory
            report["memory"] = memory.run(
                peak_bytes,
                peak_rounds,
                round_bytes,
                rounds,
                barrier,
                check_sum,
                args.server_pids if jbps.rank() == 0 else (),
            )
        stats_before = jbps.engine_stats()
        pause = None if args.pause_at is None else (args.pause_at, args.pause_file)
        report["results"] = {
            str(nbytes): bench_size(
                nbytes, iters, args.warmup, args.out_of_place, args.stages, args.cpu, pause if i == 0 else None
            )
            for i, (nbytes, iters) in enumerate(zip(args.sizes, args.iters))
        }
        stats_after = jbps.engine_stats()
        report["engine_stats"] = {"before": stats_before, "after": stats_after}
        if args.tree_sizes:
            report["small_tensors"] = bench_tree(args.tree_sizes, args.tree_iters, args.warmup)
        if jbps.rank() == 0:
            print(json.dumps(report), flush=True)
    finally:
        jbps.shutdown()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as e:  # one line naming the worker, then the traceback for detail
        print(f"jbps_worker: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
