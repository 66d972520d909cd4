"""--hold-at STEP in the elastic test workers: at the commit of STEP, a worker
commits again (nothing changed) while its generation has fewer than
--hold-for SIZE workers, or while the file --hold-until names does not exist
(the test makes it once what it waits for is done: a stranger refused), so
that a join or a refusal a test checks happens before the last steps however
slow the newcomer's start is on a loaded machine. A commit raises when the
job regroups, and the generation restarts from it. Bounded: after
HOLD_BOUND_S it trains on and the test's own assertions say what is missing."""

import os
import time

import jbps

HOLD_BOUND_S = 120.0


def add_arguments(parser):
    parser.add_argument(
        "--hold-at", type=int, default=None, help="the step whose commit waits (--hold-for, --hold-until)"
    )
    parser.add_argument("--hold-for", type=int, default=None, help="the workers --hold-at waits for")
    parser.add_argument("--hold-until", default=None, help="a file --hold-at waits for")


def _held(args) -> bool:
    short = args.hold_for is not None and jbps.size() < args.hold_for
    return short or (args.hold_until is not None and not os.path.exists(args.hold_until))


def hold(state, args, commit=None):
    """commit: what commits the state (state.commit, or the worker's own around it)."""
    if args.hold_at is None or state.step != args.hold_at:
        return
    commit = commit or state.commit
    deadline = time.monotonic() + HOLD_BOUND_S
    while _held(args) and time.monotonic() < deadline:
        time.sleep(0.05)
        commit()
