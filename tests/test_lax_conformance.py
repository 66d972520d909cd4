"""jbps.psum agrees with lax.psum, case by case (tests/workers/conformance.py):
meshes of 1 to 3 axes with psums over some or all of them, pmap, vmap, grads,
scan, cond, donation, and the refusals. Once with one worker alone (a plain
`python`, its server inside), once with 2 workers under `jbps run`, whose sums run over both;
each job runs every case once, and each case is a test of its own here."""

import importlib.util

import jax
import pytest

from conftest import case_reports, check_case, worker_outputs, worker_script
from test_launch import PYTHON, base_env, jbps_run, run
from jbps.cpu_loop_deadlock import _version as jax_version

SCRIPT = worker_script("conformance.py")
_spec = importlib.util.spec_from_file_location("conformance_cases", SCRIPT)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
CASES = [case.name for case in _module.cases()]
# The reference maps every worker's devices in each process: 8 per worker.
DEVICES_PER_WORKER = 8


@pytest.fixture(scope="module")
def alone():
    env = base_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_WORKER}", JBPS_TIMEOUT_S="60")
    proc, out, err = run([PYTHON, SCRIPT], env, timeout=600)
    return [(case_reports(out), proc.returncode, err)]


@pytest.fixture(scope="module")
def two_workers():
    # As a user starts a job: jbps run, whose output carries each line's process.
    env = base_env(JBPS_TIMEOUT_S="60")
    args = ["-n", "2", "--servers", "2", "--local-devices", str(2 * DEVICES_PER_WORKER), PYTHON, SCRIPT]
    proc, out, err = jbps_run(args, env, timeout=600)
    return [(case_reports(lines), proc.returncode, err) for lines in worker_outputs(out, 2)]


# Cases a jax release breaks inside jax itself, from that release on (docs/limitations.md):
# jax 0.12.1 lowers a shard_map whose input is typed unreduced through its high-level types,
# and its own lower_jaxpr fails (AttributeError: 'UnreducedArray' object has no attribute
# 'val') when the body is jbps's psum, where lax.psum's passes; the grad case still passes.
# Expected to fail there, not skipped: the day it passes, the xfail reads XPASS.
BROKEN_SINCE = {"a psum of a value typed unreduced (explicit sharding)": (0, 12, 1)}


def expect_breakage(request, case):
    since = BROKEN_SINCE.get(case)
    if since is not None and jax_version(jax.__version__) >= since:
        reason = f"jax {jax.__version__} fails inside its own shard_map lowering (docs/limitations.md)"
        request.applymarker(pytest.mark.xfail(reason=reason, raises=AssertionError, strict=False))


@pytest.mark.parametrize("case", CASES)
def test_one_worker_alone_agrees_with_lax(alone, case, request):
    expect_breakage(request, case)
    check_case(alone, case)


@pytest.mark.parametrize("case", CASES)
def test_two_workers_agree_with_lax_over_both(two_workers, case, request):
    expect_breakage(request, case)
    check_case(two_workers, case)


def test_every_case_has_a_distinct_name():  # reports are keyed by name
    assert len(set(CASES)) == len(CASES)
