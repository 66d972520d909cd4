"""A psum at several places of one program (jbps/ops/places.py): each place
is lowered with keys of its own, the same on every worker, so that no worker's
place is summed with another worker's other place, whatever order XLA starts
them in.

The lowering is checked in one process: a jitted helper used twice, one name=
given to two psums, both branches of a cond and remat's recomputation each
give every place its own name, the first keeping the psum's own, the same on
every lowering. tests/workers/psum_places.py runs such programs on 2 workers
against numpy, among them one whose places XLA starts in a different order on
each worker from step to step (before places.py, about a quarter of its
steps summed the wrong places together)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jbps
from conftest import last_json, run_job, worker_script


def _places(lowered_text):
    """The tensor names of every jbps_psum custom call of a lowered module, in program order."""
    calls = [line for line in lowered_text.splitlines() if "stablehlo.custom_call @jbps_psum" in line]
    return [re.search(r'names = "([^"]*)"', line).group(1) for line in calls]


def _lowered(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cpu",)).as_text()


def test_each_place_of_one_psum_is_lowered_with_a_name_of_its_own(session):
    a, b = jnp.ones(64, jnp.float32), jnp.full(64, 2.0, jnp.float32)

    @jax.jit
    def helper(x):
        return jbps.psum(x)

    twice = _places(_lowered(lambda x, y: (helper(x), helper(y)), a, b))
    assert len(twice) == 2 and twice[1] == twice[0] + "@1", twice
    # Lowered again (a retrace: the helper's psum gets a new name), the places are named alike.
    again = _places(_lowered(lambda x, y: (helper(x), helper(y)), a, b))
    assert again == twice, (again, twice)

    named = _places(_lowered(lambda x, y: (jbps.psum(x, name="g"), jbps.psum(y, name="g")), a, b))
    assert named == ["g", "g@1"], named

    def branches(x, y, pick):
        return jax.lax.cond(pick > 0, lambda: helper(x), lambda: helper(y * 3.0))

    in_cond = _places(_lowered(branches, a, b, jnp.int32(1)))
    assert len(in_cond) == 2 and in_cond[1] == in_cond[0] + "@1", in_cond

    # Remat recomputes the forward pass, psum included, in the backward pass.
    loss = jax.checkpoint(lambda w: jnp.sum(jbps.psum(w * 2.0, name="fwd") ** 2))
    remat = _places(_lowered(jax.value_and_grad(loss), a))
    fwd = [n for n in remat if n.startswith("fwd") and "/" not in n]
    assert len(fwd) == 2 and fwd[0] == "fwd" and fwd[1] == "fwd@1", remat

    # A psum at one place keeps its name.
    assert _places(_lowered(lambda x: jbps.psum(x, name="once"), a)) == ["once"]


def test_each_place_of_one_psum_sums_in_one_process(session):
    @jax.jit
    def helper(x):
        return jbps.psum(x)

    f = jax.jit(lambda x, y: (helper(x), helper(helper(y) * 2.0)))
    x, y = f(jnp.arange(8.0), jnp.full(8, 3.0))
    np.testing.assert_allclose(np.asarray(x), np.arange(8.0))
    np.testing.assert_allclose(np.asarray(y), np.full(8, 6.0))


@pytest.mark.parametrize("devices", [1, 2])
def test_places_of_one_psum_started_in_any_order_sum_exactly_on_every_worker(devices):
    results = run_job(
        [worker_script("psum_places.py"), "--steps", "40"],
        workers=2,
        servers=2,
        devices=devices,
        env={"JBPS_TIMEOUT_S": "30"},
        timeout_s=240,
    )
    for r in results:
        assert r.returncode == 0, f"worker {r.rank} failed:\n{r.stderr[-4000:]}"
        report = last_json(r.stdout)
        assert report["chain"] and report["cond"] and report["after"], report
        assert report["race_error"] is None and report["race_wrong"] == 0 and report["race_steps"] == 40, report


def test_a_psums_name_does_not_depend_on_the_order_its_process_traced_it(session):
    # An elastic job's newcomer traces its programs in its own order while the others keep theirs:
    # an unnamed psum's name comes from where it is called and what it sums, not from a count.
    a, v = jnp.ones(64, jnp.float32), jnp.ones(4, jnp.float32)
    f = jax.jit(lambda x: jbps.psum(x * 2.0))
    g = jax.jit(lambda x, y: (jbps.psum(x), jbps.psum(y)))
    h = jax.jit(lambda x: jbps.psum(x))  # g's first psum's shapes, called from another line
    first = [_places(_lowered(fn, *args)) for fn, args in ((f, (a,)), (g, (a, v)), (h, (a,)))]
    jax.clear_caches()
    later = [_places(_lowered(fn, *args)) for fn, args in ((h, (a,)), (g, (a, v)), (f, (a,)))][::-1]
    assert later == first, (first, later)
    names = [n for program in first for n in program]
    assert len(set(names)) == len(names) == 4, names  # other call sites or shapes: other names


def test_workers_that_traced_their_programs_in_other_orders_sum_exactly():
    results = run_job(
        [worker_script("trace_order.py"), "--steps", "20", "--eval-first-rank", "1"],
        workers=2,
        servers=2,
        env={"JBPS_TIMEOUT_S": "20"},
        timeout_s=180,
    )
    reports = []
    for r in results:
        assert r.returncode == 0, f"worker {r.rank} failed:\n{r.stderr[-4000:]}"
        reports.append(last_json(r.stdout))
    assert reports[0]["names"] == reports[1]["names"], reports
    assert all(r["wrong"] == 0 and r["steps"] == 20 for r in reports), reports
