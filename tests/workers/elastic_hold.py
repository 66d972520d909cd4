"""--hold-at STEP --hold-for SIZE in the elastic test workers: at the commit
of STEP, a worker whose generation has fewer than SIZE workers commits again
(nothing changed) until the job regroups with the worker the test started
(commit raises, and the generation restarts from that commit), so that a join
a test checks happens before the last steps however slow the newcomer's
start is on a loaded machine. Bounded: after HOLD_BOUND_S it trains on and
the test's own assertions say what is missing."""

import time

import jbps

HOLD_BOUND_S = 120.0


def add_arguments(parser):
    parser.add_argument("--hold-at", type=int, default=None, help="the step whose commit waits for --hold-for workers")
    parser.add_argument("--hold-for", type=int, default=None, help="the workers --hold-at waits for")


def hold(state, args, commit=None):
    """commit: what commits the state (state.commit, or the worker's own around it)."""
    commit = commit or state.commit
    if args.hold_at is None or state.step != args.hold_at:
        return
    deadline = time.monotonic() + HOLD_BOUND_S
    while jbps.size() < args.hold_for and time.monotonic() < deadline:
        time.sleep(0.05)
        commit()
