"""A worker of the elastic tests (tests/test_elastic.py): trains inside
jbps.elastic.run, checking every step's sum against numpy for the generation
it ran in.

Each step, device d of the worker of rank r (of n, with k local devices)
contributes (r*k + d + 1) * (step + 1): the sum is (step + 1) * T(T+1)/2 for
T = n*k, exact in float32, and any sum mixing two memberships misses it. The
state keeps w (the sums' running total over T) and, per committed step, the
T it ran with; at the end w must equal numpy's total over that history.

With --back-to-back the steps are dispatched without waiting for them (as a
training loop does), and their sums are checked at the next commit.

Prints one JSON line per commit (every --commit-every steps) ({"step", "size", "rank", "servers",
"link", "at", "rates", "replans", "timeout", "compiles", "lowered"}: the programs jax compiled and
lowered so far) and a
last one: {"done", "w", "expected", "exact", "acc_exact", "sizes", "cache_dir",
"cache_dir_after", "cache_hits", "lowered_before_training"} (acc_exact: with --placed-state,
whether each device's running total equals numpy's; jax's persistent compilation cache: its
directory while training and after jbps.elastic.run returned, and the programs it gave instead
of a compile; the programs jax lowered before the training function first ran: jbps.elastic's
warm-up). --die-at STEP kills this process (SIGKILL) before that step, once per
--die-file (created first). --hold-at STEP --hold-for SIZE: that step's commit waits until the
job has SIZE workers (tests/workers/elastic_hold.py).
"""

import argparse
import functools
import hashlib
import json
import logging
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jbps
import jbps.elastic
import jbps.runtime
from elastic_hold import add_arguments as add_hold_arguments, hold


def first_to_claim(path):
    """True in the one process that creates `path`."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-seconds", type=float, default=0.1, help="a sleep after each commit")
    p.add_argument(
        "--work-seconds",
        type=float,
        default=0.0,
        help="a sleep inside each step, before its commit: a step's computation, which a regroup does not skip",
    )
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--die-file", default=None)
    p.add_argument("--commit-every", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=None, help="given to jbps.elastic.run, over JBPS_TIMEOUT_S")
    p.add_argument("--width", type=int, default=1000, help="another width: a worker of another model")
    p.add_argument(
        "--back-to-back",
        action="store_true",
        help="dispatch steps without waiting for them: their sums are checked at the next commit",
    )
    p.add_argument(
        "--print-regroups",
        action="store_true",
        help='print {"regrouped_at": step, "at"} when a commit is saved and the generation regroups',
    )
    p.add_argument(
        "--placed-state",
        action="store_true",
        help="the state also holds acc, each device's running total of its sums, which a pmap adds to "
        "(a step whose input is a state leaf; from the host at first); commits count jax's compiles",
    )
    p.add_argument(
        "--mean",
        action="store_true",
        help="each step also takes jbps.pmean of the same values (checked: the sum over the workers' "
        "devices) and each commit prints a digest of the step's program text (the same for every "
        "membership: its compile comes from jax's cache)",
    )
    p.add_argument(
        "--membership-in-trace",
        action="store_true",
        help="the step reads jbps.rank() (its offset) and jbps.size() (an output, checked) while jax "
        "traces it: baked into the program, which then holds for one membership only",
    )
    p.add_argument(
        "--warm-up",
        nargs="?",
        const="compile",
        choices=("compile", "run", "raise", "donate"),
        help="gives jbps.elastic.run a warm_up that lowers and compiles the step (a newcomer then does so "
        "before it asks to join), one that runs it (a rehearsal: its psums sum this worker's devices only, checked), "
        "one that raises ValueError (a bug in the training's code), or one that runs a step donating the "
        "state's w (a jax array then)",
    )
    add_hold_arguments(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # each generation's timings
    cache_hits = []  # programs jax's persistent compilation cache gave instead of a compile
    jax.monitoring.register_event_listener(
        lambda event, **_: cache_hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    )
    lowered = []  # programs jax lowered to MLIR in this process
    compiled = []  # programs jax compiled (or took from its persistent cache) in this process
    counted = {"jaxpr_to_mlir_module_duration": lowered, "backend_compile_duration": compiled}

    def count(event, *_, **__):
        kept = counted.get(event.rsplit("/", 1)[-1])
        if kept is not None:
            kept.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    lowered_before_training = []  # how many when the training function first ran (before its first step)
    cache_dir = []  # jax's compilation cache directory while the training function ran (the job's)
    k = jax.local_device_count()

    @functools.partial(jax.pmap, axis_name="i")
    def contribute(step, offset):
        d = jax.lax.axis_index("i").astype(jnp.float32)
        if args.membership_in_trace:  # baked in: a program kept for another membership would be wrong
            offset = jnp.float32(jbps.rank() * k)
        x = jnp.ones((args.width,), jnp.float32) * (offset + d + 1.0) * (step + 1.0)
        if args.membership_in_trace:
            return jbps.psum(x, "i"), jnp.full((), jbps.size(), jnp.float32)
        if args.mean:
            return jbps.psum(x, "i"), jbps.pmean(x, "i", name="mean")
        return jbps.psum(x, "i")

    accumulate = jax.pmap(lambda acc, out: acc + out, axis_name="i")
    extra = {"acc": np.zeros((k, args.width), np.float32)} if args.placed_state else {}
    state = jbps.elastic.State(
        w=(jnp if args.warm_up == "donate" else np).zeros((args.width,), np.float32),
        sizes=np.zeros((args.steps,), np.int32),
        step=0,
        **extra,
    )

    def check(step, n, total, out):
        want = np.float32((step + 1) * total * (total + 1) / 2)
        out = np.asarray(out)
        if not np.all(out == want):
            print(json.dumps({"wrong": step, "size": n, "got": float(out.ravel()[0]), "want": float(want)}))
            sys.exit(3)

    def commit(state):
        try:
            state.commit()
        except Exception as exc:  # saved, then a regroup (or the job's fault): when, for the join's time
            if args.print_regroups and type(exc).__name__ == "_Regroup":
                print(json.dumps({"regrouped_at": state.step, "at": time.time()}))
                sys.stdout.flush()
            raise

    def warm_up(state):
        if args.warm_up == "raise":
            raise ValueError("the warm-up's own error")
        if args.warm_up == "donate":
            jax.jit(lambda w: w + 1.0, donate_argnums=0)(state.w)
            return
        zeros = np.zeros((k,), np.float32)
        if args.warm_up == "compile":
            contribute.lower(zeros, zeros).compile()
            return
        out = contribute(zeros, zeros)  # a rehearsal: each psum sums this worker's devices only
        rehearsed = np.asarray(out[0] if isinstance(out, tuple) else out)
        if not np.all(rehearsed == np.arange(1, k + 1, dtype=np.float32).sum()):
            print(json.dumps({"wrong_rehearsal": rehearsed[:, 0].tolist()}))
            sys.exit(3)

    @jbps.elastic.run(
        **({} if args.timeout_s is None else {"timeout_s": args.timeout_s}),
        **({"warm_up": warm_up} if args.warm_up else {}),
    )
    def train(state):
        unchecked = []  # steps dispatched back to back, checked at the next commit
        if not lowered_before_training:
            lowered_before_training.append(len(lowered))
            cache_dir.append(jax.config.jax_compilation_cache_dir)
        while state.step < args.steps:
            if args.die_at is not None and state.step == args.die_at and first_to_claim(args.die_file):
                os.kill(os.getpid(), signal.SIGKILL)
            n, r = jbps.size(), jbps.rank()
            total = n * k
            steps = np.full((k,), state.step, np.float32)
            offsets = np.full((k,), r * k, np.float32)
            out = contribute(steps, offsets)
            if args.membership_in_trace:
                out, traced_size = out
                if not np.all(np.asarray(traced_size) == n):
                    print(json.dumps({"wrong_size": state.step, "size": n, "got": float(np.asarray(traced_size)[0])}))
                    sys.exit(3)
            if args.mean:
                out, mean = out
                want = np.float32((state.step + 1) * total * (total + 1) / 2) / np.float32(total)
                if not np.all(np.asarray(mean) == want):
                    print(json.dumps({"wrong_mean": state.step, "size": n, "got": float(np.asarray(mean).ravel()[0])}))
                    sys.exit(3)
            if args.back_to_back:
                unchecked.append((state.step, n, total, out))
                state.w = jnp.asarray(state.w) + out[0] / np.float32(total)
            else:
                check(state.step, n, total, out)
                state.w = np.asarray(state.w) + np.asarray(out)[0] / np.float32(total)
            if args.placed_state:
                state.acc = accumulate(state.acc, out)
            time.sleep(args.work_seconds)
            sizes = np.array(state.sizes)
            sizes[state.step] = total
            state.sizes = sizes
            state.step += 1
            if state.step % args.commit_every == 0 or state.step == args.steps:
                for pending in unchecked:
                    check(*pending)
                unchecked.clear()
                commit(state)
                servers = len(jbps.config().servers)
                link = jbps.runtime.link_bytes_per_s()  # as measured, or reused from an earlier generation
                line = {"step": state.step, "size": n, "rank": r, "servers": servers, "link": link, "at": time.time()}
                line["compiles"], line["lowered"] = len(compiled), len(lowered)
                if args.mean:  # the step's program as this generation lowers it
                    text = contribute.lower(steps, offsets).as_text()
                    line["program"] = hashlib.sha256(text.encode()).hexdigest()[:16]
                line["timeout"] = jbps.config().timeout_s
                # Each server host's rate the generation started from, and the rate follower's splits so far.
                rates = jbps.runtime.server_rates()
                hosts = [a.rsplit(":", 1)[0] for a in jbps.config().servers]
                line.update(
                    rates=None if rates is None else dict(zip(hosts, rates)), replans=len(jbps.runtime.replans())
                )
                print(json.dumps(line))
                sys.stdout.flush()
                hold(state, args, lambda: commit(state))
            time.sleep(args.step_seconds)

    train(state)
    expected = np.zeros((args.width,), np.float32)
    for s, total in enumerate(np.asarray(state.sizes)):
        expected = expected + np.float32((s + 1) * int(total) * (int(total) + 1) / 2) / np.float32(total)
    w = np.asarray(state.w)
    sums = [np.float32((s + 1) * int(total) * (int(total) + 1) / 2) for s, total in enumerate(np.asarray(state.sizes))]
    acc_exact = None if not args.placed_state else bool(np.all(np.asarray(state.acc) == np.sum(sums, dtype=np.float32)))
    print(
        json.dumps(
            {
                "done": True,
                "w": float(w[0]),
                "expected": float(expected[0]),
                "exact": bool(np.array_equal(w, expected)),
                "acc_exact": acc_exact,
                "sizes": np.asarray(state.sizes).tolist(),
                "cache_dir": cache_dir[0],
                "cache_dir_after": jax.config.jax_compilation_cache_dir,  # the user's again, after jbps.elastic.run
                "cache_hits": len(cache_hits),
                "lowered_before_training": lowered_before_training[0],
            }
        )
    )


if __name__ == "__main__":
    main()
