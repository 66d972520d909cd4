"""A worker of `python -m benchmarks.elastic_join --model NAME`: trains one of
the benchmarks' models (step_models.py: the examples' ResNet and transformer,
or an MLP) inside jbps.elastic.run, a step a commit, its gradients averaged by
jbps.optax.distributed. It prints what benchmarks/elastic_join.py reads from
the elastic test worker (tests/workers/elastic_train.py), whose flags it
shares: a JSON line per commit ({"step", "size", "rank", "at", "compiles"}),
{"regrouped_at", "at"} when a commit saves the state and the job regroups;
--die-at kills this process once per --die-file; --hold-at/--hold-for wait at
a commit for the restarted worker. So a loss and a join are timed with a real
model's step: traced, and compiled or taken from jax's persistent cache, again
in every new generation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import jax
import optax

import jbps
import jbps.elastic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))
from elastic_hold import add_arguments as add_hold_arguments, hold  # noqa: E402
from elastic_train import first_to_claim  # noqa: E402

from benchmarks import step_models  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    step_models.add_model_flags(p, layers=2, batch=8, steps=30)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--die-file", default=None)
    p.add_argument("--print-regroups", action="store_true")
    p.add_argument(
        "--warm-up",
        nargs="?",
        const="run",
        choices=("run", "compile"),
        help="jbps.elastic.run's warm_up runs the step (a rehearsal), or lowers and compiles it",
    )
    add_hold_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # each generation's timings
    compiled = []  # programs jax compiled (or took from its persistent cache) in this process
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *_, **__: compiled.append(event) if event.endswith("backend_compile_duration") else None
    )
    model = step_models.build(args.model, args.layers, args.width, args.batch, rank=0)
    tx = jbps.optax.distributed(optax.sgd(0.01), name="grads")

    @jax.jit
    def step(params, opt_state):
        updates, opt_state = tx.update(jax.grad(model.loss)(params, *model.inputs), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = jbps.elastic.State(params=model.params, opt_state=tx.init(model.params), step=0)

    def commit() -> None:
        try:
            state.commit()
        except Exception as exc:  # saved, then a regroup (or the job's fault): when, for the join's time
            if args.print_regroups and type(exc).__name__ == "_Regroup":
                print(json.dumps({"regrouped_at": state.step, "at": time.time()}), flush=True)
            raise

    def warm_up(state):
        if args.warm_up == "compile":
            step.lower(state.params, state.opt_state).compile()
        else:
            jax.block_until_ready(step(state.params, state.opt_state))

    @jbps.elastic.run(**({"warm_up": warm_up} if args.warm_up else {}))
    def train(state):
        while state.step < args.steps:
            if args.die_at is not None and state.step == args.die_at and first_to_claim(args.die_file):
                os.kill(os.getpid(), signal.SIGKILL)
            state.params, state.opt_state = jax.block_until_ready(step(state.params, state.opt_state))
            state.step += 1
            commit()
            line = {"step": state.step, "size": jbps.size(), "rank": jbps.rank(), "at": time.time()}
            print(json.dumps(dict(line, compiles=len(compiled))), flush=True)
            hold(state, args, commit)

    train(state)


if __name__ == "__main__":
    main()
