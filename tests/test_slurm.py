"""`srun -n N python train.py` under a real Slurm (tests/slurm_cluster.py: the
distribution's slurmctld, slurmd and munged, one node, started and ended by
the test): the tasks find each other through the Slurm variables alone, sum
random trees as numpy does, and a task that fails ends the job naming it."""

import secrets
import time

import pytest

import jbps
from jbps.bootstrap import slurm as slurm_bootstrap
from conftest import check_results, job_free_env, last_json, worker_script
from leftovers import assert_nothing_left
from slurm_cluster import SlurmCluster, unavailable
from test_launch import PYTHON

needs_slurm = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")


@pytest.fixture(scope="module")
def slurm():
    with SlurmCluster() as cluster:
        yield cluster


@pytest.mark.parametrize(
    "nodelist, first",
    [("node07", "node07"), ("node[07-09,12]", "node07"), ("gpu[3,5],cpu1", "gpu3"), ("a-b.c,d", "a-b.c")],
)
def test_the_first_host_of_a_node_list(nodelist, first):
    assert slurm_bootstrap.first_host(nodelist) == first


def test_srun_is_recognised_by_its_step_variables_only():
    step = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n1"}
    assert slurm_bootstrap.under_srun(step)
    assert not slurm_bootstrap.under_srun({"SLURM_JOB_ID": "5", "SLURM_PROCID": "0"})  # an sbatch script itself


def test_every_task_derives_the_same_scheduler_port_and_a_given_one_wins():
    config = jbps.Config.resolve({}, {})
    ports = {slurm_bootstrap.scheduler_port(config, {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "3"}) for _ in range(3)}
    (port,) = ports
    assert slurm_bootstrap.PORT_BASE <= port < slurm_bootstrap.PORT_BASE + slurm_bootstrap.PORT_RANGE
    given = jbps.Config.resolve({}, {"JBPS_SCHEDULER_PORT": "7001"})
    assert slurm_bootstrap.scheduler_port(given, {"SLURM_JOB_ID": "812"}) == 7001


def env(**extra):
    import uuid

    return job_free_env(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=2",
        JBPS_TIMEOUT_S="30",
        JBPS_TEST_MARKER=uuid.uuid4().hex,
        **extra,
    )


class Task:
    def __init__(self, rank, returncode, stdout):
        self.rank, self.returncode, self.stdout, self.stderr = rank, returncode, stdout, ""


@needs_slurm
@pytest.mark.parametrize("tasks", [2, 4])
def test_srun_tasks_sum_random_trees_as_numpy(slurm, tasks):
    job_env = env()
    if tasks == 4:  # a batch script that exports a job secret: every task proves it at the rendezvous
        job_env["JBPS_JOB_SECRET"] = secrets.token_hex(16)
    proc = slurm.srun(
        ["-n", str(tasks), "--label", PYTHON, worker_script("random_trees.py"), "--rounds", "4", "--mode", "shard_map"],
        job_env,
        timeout_s=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    by_task = {}
    for line in proc.stdout.splitlines():  # --label: "RANK: line"
        rank, _, text = line.partition(": ")
        by_task.setdefault(int(rank), []).append(text)
    assert sorted(by_task) == list(range(tasks)), proc.stdout[-3000:]
    results = [Task(r, 0, "\n".join(lines)) for r, lines in sorted(by_task.items())]
    check_results(results, rounds=4)
    reports = [last_json(t.stdout) for t in results]
    assert sorted(r["rank"] for r in reports) == list(range(tasks))  # SLURM_PROCID is the worker rank
    assert len(reports[0]["servers"]) == 1  # one node: its first task's server
    assert_nothing_left(job_env)


@needs_slurm
def test_a_task_that_fails_ends_the_job_naming_it(slurm):
    job_env = env()
    start = time.monotonic()
    proc = slurm.srun(
        ["-n", "3", PYTHON, worker_script("raise_at_step.py"), "--raise-rank", "2", "--raise-step", "5"],
        job_env,
        timeout_s=120,
    )
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "ValueError: a bug in worker 2's own code at step 5" in proc.stderr, proc.stderr[-4000:]
    named = [line for line in proc.stderr.splitlines() if "jbps: worker 2 " in line and "left the job" in line]
    assert named, proc.stderr[-4000:]
    assert time.monotonic() - start < 60, "the job took longer than its timeout to end"
    assert_nothing_left(job_env)
