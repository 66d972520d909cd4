"""Shared fixtures. In-process tests get 4 host devices and a real summation
server running on threads of the test process (real sockets on loopback)."""

import fcntl
import json
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

import jbps
from jbps import _core

# The checkout, last on the path: its benchmarks/ (the lab: local and emulated
# clusters, the peers) are found there, while `import jbps` stays the installed package.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.append(REPO)

from benchmarks import emulated_job  # noqa: E402
from benchmarks.local_cluster import _REPO_ROOT, LocalCluster, last_json_line  # noqa: E402

# Before jax loads (importing jbps does not load it): this process's models and those of every
# process a test starts (45 s less of the examples', elastic and checkpoint tests).
os.environ.setdefault(*emulated_job.QUICK_MODEL_INIT)

WORKERS = os.path.join(os.path.dirname(__file__), "workers")


def job_free_env(**extra):
    """This environment without any job variables, importing the jbps under
    test (PYTHONPATH first), plus `extra`: for processes a test starts itself."""
    pythonpath = os.pathsep.join(p for p in (_REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    return emulated_job.job_free_env(**{"PYTHONPATH": pythonpath, **extra})


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", help="run the long soak (2,000 rounds; also JBPS_SOAK=1)")


def soaking(config) -> bool:
    """Whether the soaks run their long versions: `pytest --soak` or JBPS_SOAK=1."""
    return config.getoption("--soak") or os.environ.get("JBPS_SOAK") == "1"


@pytest.fixture
def server():
    """A one-worker summation server on a free loopback port."""
    srv = _core.Server("127.0.0.1:0", 1, keep_alive=True)
    yield f"127.0.0.1:{srv.port}"
    srv.stop()


@pytest.fixture
def session(server):
    """jbps initialised as the only worker of a job, shut down afterwards."""
    with jbps.init(servers=[server], num_workers=1, worker_rank=0, timeout_s=20) as s:
        yield s


# examples/mnist_elastic.py's epochs in the elastic tests that kill, restart and cut its workers:
# room for every event before the training ends on a loaded machine.
MNIST_ELASTIC_EPOCHS = 24


@pytest.fixture(scope="session")
def mnist_elastic_clean_accuracy(tmp_path_factory, worker_id):
    """examples/mnist_elastic.py's test accuracy after MNIST_ELASTIC_EPOCHS with 3
    workers of one device and no fault (`jbps run`): the reference the elastic
    tests with faults end within 0.01 of (test_examples, test_multihost), run
    once per session: with pytest-xdist, once for all its workers (the first
    to need it runs it, under a lock in the run's own temporary directory, and
    keeps the result there for the others)."""
    if worker_id == "master":  # no xdist: this process is the whole session
        return _mnist_elastic_clean_accuracy()
    shared = tmp_path_factory.getbasetemp().parent  # this run's, shared by its xdist workers
    with open(shared / "mnist_elastic_clean.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # held at most as long as the run (its timeout) by another worker
        kept = shared / "mnist_elastic_clean.json"
        if not kept.exists():
            kept.write_text(json.dumps(_mnist_elastic_clean_accuracy()))
        return json.loads(kept.read_text())


def _mnist_elastic_clean_accuracy() -> float:
    from leftovers import assert_nothing_left
    from test_examples import CHECKOUT, mnist_elastic_argv
    from test_launch import base_env, run

    env = base_env()
    proc, out, err = run(mnist_elastic_argv(), env, timeout=400, cwd=CHECKOUT)
    assert proc.returncode == 0, err[-3000:]
    assert_nothing_left(env)
    return float(re.search(r"\[worker 0\] .*test accuracy ([0-9.]+)", out).group(1))


# What tests/workers/elastic_train.py's last line says training gave, the same on every worker of a
# job; the rest of that line (programs lowered, cache hits) is each process's own.
ELASTIC_TRAINED = ("w", "expected", "exact", "acc_exact", "sizes")


def newcomer_waits_to_join(scheduler_log: str, registered: int) -> bool:
    """Whether the elastic scheduler's log shows the `registered`-th worker waiting to join: it
    registered, and where it warms up first (a generation ran as it came), it has warmed up."""
    if scheduler_log.count("worker registered from") < registered:
        return False
    return "to warm up first" not in scheduler_log or "warmed up and waits to join" in scheduler_log


def worker_script(name):
    return os.path.join(WORKERS, name)


def run_job(script_args, *, workers, servers, devices=1, env=None, env_per_rank=None, timeout_s=180):
    """Runs a multi-process job; returns the WorkerResults (asserting none timed out)."""
    with LocalCluster(
        workers, servers, local_devices=devices, timeout_s=timeout_s, env=env, python=sys.executable
    ) as cluster:
        return cluster.run_workers(script_args, env_per_rank=env_per_rank)


def last_json(text):
    report = last_json_line(text)
    assert report is not None, f"no JSON line in output:\n{text[-2000:]}"
    return report


def case_reports(stdout):
    """{case: report} from the JSON lines a case-by-case worker prints ({"case", "ok", "detail"})."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            report = json.loads(line)
            found[report["case"]] = report
    return found


def worker_outputs(out, workers):
    """Each worker's lines of `jbps run`'s output, whose lines say their process ("[worker N] ...")."""
    by_rank = {rank: [] for rank in range(workers)}
    for line in out.splitlines():
        m = re.match(r"\[worker (\d+)\] (.*)", line)
        if m and int(m.group(1)) in by_rank:
            by_rank[int(m.group(1))].append(m.group(2))
    return ["\n".join(lines) for lines in by_rank.values()]


def check_case(workers, case):
    """Every worker, given as (case_reports, exit code, stderr), reported `case` as ok."""
    for rank, (found, returncode, stderr) in enumerate(workers):
        assert case in found, f"worker {rank} (exit {returncode}) did not report {case!r}:\n{stderr[-4000:]}"
        assert found[case]["ok"], f"worker {rank}: {found[case]['detail']}"


def check_results(results, rounds):
    """Every worker of a random_trees.py job passed its numpy checks, ran every
    round, and got bitwise the same sums as the others."""
    for r in results:
        assert r.returncode == 0, f"worker {r.rank} failed:\n{r.stderr[-4000:]}"
    reports = [last_json(r.stdout) for r in results]
    assert [rep["rounds"] for rep in reports] == [rounds] * len(results)
    digests = {rep["digest"] for rep in reports}
    assert len(digests) == 1, f"workers got different sums: {reports}"


def _emulated_hosts_unavailable() -> str | None:
    """Why network namespaces cannot be made here (not root, no iproute2), or None."""
    from benchmarks.emulated_network import NetworkError, check_tools

    try:
        check_tools()
    except NetworkError as exc:
        return str(exc)
    return None


# Tests across emulated hosts (benchmarks/emulated_network.py): skipped, saying why, where they cannot run.
needs_emulated_hosts = pytest.mark.skipif(
    _emulated_hosts_unavailable() is not None, reason=_emulated_hosts_unavailable() or ""
)


# What each test file needs, as markers (`pytest -m ...` picks; README, Tests):
#   unit       one process: the in-process engine and a server on threads, or pure Python
#   cluster    real server and worker processes on this machine (jbps run, LocalCluster, mpirun)
#   multihost  emulated hosts: network namespaces (root and iproute2)
#   gpu        a CUDA device
#   packaging  wheels, checkouts, the build files, Bazel
#   docs       the documentation: its links, commands and build
# and `slow`: the tests that take more than about 3 s on 2 cores (SLOW below).
FILE_MARKERS = {
    "test_api.py": "unit",
    "test_bazel_smoke.py": "packaging",
    "test_bench_latency.py": "cluster",
    "test_bench_network.py": "multihost",
    "test_bench_smoke.py": "cluster",
    "test_binding.py": "cluster",
    "test_buckets.py": "cluster",
    "test_scan.py": "cluster",
    "test_scan_faults_and_compression.py": "cluster",
    "test_build_sources.py": "packaging",
    "test_checkout.py": "packaging",
    "test_checkpoints.py": "cluster",
    "test_compression.py": "cluster",
    "test_compile_cache.py": "unit",
    "test_cuda_build.py": "packaging",
    "test_cuda_gpu.py": "gpu",
    "test_data_parallel.py": "cluster",
    "test_docs.py": "docs",
    "test_elastic.py": "cluster",
    "test_engine_units.py": "unit",
    "test_errors.py": "cluster",
    "test_examples.py": "cluster",
    "test_discovery.py": "unit",
    "test_faults.py": "cluster",
    "test_fresh_outputs.py": "unit",
    "test_hostile_input.py": "cluster",
    "test_keep_alive.py": "unit",
    "test_launch.py": "cluster",
    "test_lax_conformance.py": "cluster",
    "test_loops.py": "cluster",
    "test_mixed_transports.py": "cluster",
    "test_models.py": "unit",
    "test_multihost.py": "multihost",
    "test_onebit.py": "cluster",
    "test_onebit_adam.py": "cluster",
    "test_optax.py": "cluster",
    "test_partition.py": "unit",
    "test_plots.py": "unit",
    "test_portable_kernels.py": "cluster",
    "test_places.py": "cluster",
    "test_psum_cluster.py": "cluster",
    "test_replan.py": "cluster",
    "test_scheduling.py": "cluster",
    "test_shm.py": "cluster",
    "test_shutdown.py": "cluster",
    "test_side_streams.py": "unit",
    "test_slurm.py": "cluster",
    "test_soak.py": "cluster",
    "test_sum_kernels.py": "unit",
    "test_topk.py": "unit",
    "test_wheel.py": "packaging",
}
# The tests that start a job of several processes or take more than about 3 s on
# 2 cores (from `pytest --durations=0`, 2026-11-28 and 2026-11-30), by node id without
# parameters, and whole files whose module fixtures start jobs.
SLOW = (
    "tests/test_launch.py::test_a_misspelled_setting",
    "tests/test_launch.py::test_a_scheduler_missing",
    "tests/test_launch.py::test_a_scheduler_started_long_before",
    "tests/test_launch.py::test_members_started_long_before",
    "tests/test_launch.py::test_a_stalled_workers_timeout",
    "tests/test_launch.py::test_only_members_that_prove",
    "tests/test_checkpoints.py::test_a_checkpoint_moves_between",
    "tests/test_checkpoints.py::test_a_resumed_run_ends_where",
    "tests/test_checkpoints.py::test_a_checkpoint_restores_into",
    "tests/test_bench_smoke.py::",
    "tests/test_bench_latency.py::",
    "tests/test_bench_network.py::",
    "tests/test_elastic.py::test_a_killed_worker",
    "tests/test_elastic.py::test_a_steps_program",
    "tests/test_elastic.py::test_too_few_workers",
    "tests/test_elastic.py::test_jbps_run_starts",
    "tests/test_elastic.py::test_the_join_bench",
    "tests/test_elastic.py::test_a_newcomer_places",
    "tests/test_elastic.py::test_error_feedback_residuals",
    "tests/test_elastic.py::test_an_elastic_worker_and",
    "tests/test_elastic.py::test_a_stranger",
    "tests/test_elastic.py::test_a_worker_joining",
    "tests/test_elastic.py::test_a_newcomer_waits",
    "tests/test_elastic.py::test_randomized_membership",
    "tests/test_elastic.py::test_a_worker_lost_while_steps",
    "tests/test_multihost.py::",
    "tests/test_buckets.py::test_random_trees_in_small_buckets_match_numpy",
    "tests/test_buckets.py::test_a_training_step_pushes_its_first_bucket",
    "tests/test_launch.py::test_jbps_run_names_a_discovery_script",
    "tests/test_replan.py::test_new_splits_move_every_psum",
    "tests/test_replan.py::test_a_split_not_every_worker_announced",
    "tests/test_checkout.py::test_the_readme_mpmd_line_runs_from_the_checkout_root",
    "tests/test_compression.py::test_compressed_sums_equal_numpys_sum_of_the_rounded_inputs",
    "tests/test_data_parallel.py::test_one_worker_trains",
    "tests/test_data_parallel.py::test_two_workers_train",
    "tests/test_docs.py::test_every_command_the_docs_show_still_parses",
    "tests/test_docs.py::test_the_docs_build_without_a_warning",
    "tests/test_errors.py::test_a_timeout_names_the_worker_that_has_not_pushed",
    "tests/test_errors.py::test_workers_cutting_a_tree_into_different_chunks_all_raise_at_once",
    "tests/test_errors.py::test_workers_disagreeing_after_agreeing_all_raise_naming_it",
    "tests/test_errors.py::test_workers_disagreeing_on_a_tensor_all_raise_naming_it",
    "tests/test_examples.py::test_mesh_example_equals_one_process_with_two_workers",
    "tests/test_examples.py::test_mnist_reaches_95_percent_with_two_workers",
    "tests/test_examples.py::test_mnist_elastic",
    "tests/test_examples.py::test_mnist_with_onebit_compression_reaches_97_percent",
    "tests/test_examples.py::test_nnx_mesh_example_reaches_95_percent",
    "tests/test_examples.py::test_resnet_under_mpirun_reports_throughput",
    "tests/test_examples.py::test_transformer_runs_alone_and_its_loss_goes_down",
    "tests/test_faults.py::test_a_killed_server_fails_every_workers_psums_naming_it",
    "tests/test_faults.py::test_a_killed_worker_fails_every_other_workers_psums_naming_it",
    "tests/test_hostile_input.py::test_server_survives_hostile_connections_and_keeps_summing",
    "tests/test_launch.py::test_a_missing_worker_fails_everyone_naming_it",
    "tests/test_launch.py::test_a_server_that_cannot_start_fails_every_member",
    "tests/test_launch.py::test_a_worker_that_never_connects_ends_the_servers_naming_it",
    "tests/test_launch.py::test_communication_share_is_the_jobs_not_a_workers_waits",
    "tests/test_launch.py::test_environment_bootstrap_in_any_start_order",
    "tests/test_launch.py::test_jbps_run_job_with_prefixed_output",
    "tests/test_launch.py::test_jbps_run_listens_on_loopback_only_and_ctrl_c_ends_everything",
    "tests/test_launch.py::test_jbps_run_names_the_worker_that_raised_not_the_one_it_ended",
    "tests/test_launch.py::test_jbps_run_propagates_a_crash_and_leaves_nothing",
    "tests/test_launch.py::test_mpirun_every_rank_a_worker",
    "tests/test_launch.py::test_mpirun_mpmd_with_dedicated_server_ranks",
    "tests/test_launch.py::test_mpirun_rank_that_ends_before_joining_ends_the_job_naming_it",
    "tests/test_launch.py::test_mpirun_rank_that_never_joins_aborts_the_job_within_the_timeout",
    "tests/test_launch.py::test_two_jobs_at_once_on_one_host",
    "tests/test_lax_conformance.py::test_one_worker_alone_agrees_with_lax",
    "tests/test_lax_conformance.py::test_two_workers_agree_with_lax_over_both",
    "tests/test_loops.py::test_loops_dispatched_back_to_back_finish_with_numpy_sums",
    "tests/test_mixed_transports.py::test_many_fused_pushes_in_one_write_over_tcp",
    "tests/test_mixed_transports.py::test_workers_on_tcp_and_on_shared_memory_sum_together",
    "tests/test_onebit.py::test_a_large_leaf_sent_in_pieces_sums_as_numpy_with_residuals_going_in",
    "tests/test_onebit.py::test_error_feedback_makes_the_mean_of_the_sums_approach_the_true_sum",
    "tests/test_onebit.py::test_sums_and_residuals_equal_numpys_decode_sum_encode",
    "tests/test_onebit_adam.py::test_two_workers_end_with_the_same_parameters_and_fit",
    "tests/test_optax.py::test_broadcast_gives_every_worker_the_roots_bits",
    "tests/test_optax.py::test_multisteps_communicates_once_per_real_step",
    "tests/test_optax.py::test_optax_multisteps_around_distributed_is_correct",
    "tests/test_optax.py::test_two_workers_end_where_one_process_on_the_full_batch_ends",
    "tests/test_partition.py::test_routing_identical_across_processes",
    "tests/test_portable_kernels.py::test_the_portable_loops_give_the_bits_of_the_vector_kernels",
    "tests/test_psum_cluster.py::test_fifty_rounds_with_a_slow_worker",
    "tests/test_psum_cluster.py::test_random_trees_match_numpy",
    "tests/test_scan.py::test_scanned_steps_train_as_plain_optax",
    "tests/test_scan.py::test_the_next_steps_forward_pass",
    "tests/test_scan_faults_and_compression.py::",
    "tests/test_scheduling.py::test_deterministic_sums_are_bitwise_stable",
    "tests/test_scheduling.py::test_high_priority_call_overtakes_queued_chunks",
    "tests/test_shm.py::test_one_worker_on_tcp_and_one_on_shared_memory",
    "tests/test_shm.py::test_shared_memory_and_tcp_give_the_same_sums",
    "tests/test_slurm.py::test_srun_tasks",
    "tests/test_slurm.py::test_a_task_that_fails",
    "tests/test_shutdown.py::test_shutdown_twice_then_init_again_leaves_no_socket_thread_or_child",
    "tests/test_soak.py::test_soak_rounds_match_numpy_and_memory_stays_flat",
)


# Soaks whose long version (--soak) outlasts the suite's 900 s timeout per test on 2 cores
# (1,000 membership changes: 900-1,100 s, mostly new workers' starts; 2026-12-06).
LONG_WHEN_SOAKING = ("tests/test_elastic.py::test_randomized_membership_changes_never_give_a_wrong_sum",)


# Files whose outcome depends on the jax version (tracing, lowering, optax and
# flax, XLA's runtime): CI runs them, slow or not, on the oldest and newest jax
# too; elsewhere it runs the quick part (.ci/run).
JAX_VERSIONS = {
    "test_buckets.py",
    "test_compile_cache.py",
    "test_compression.py",
    "test_data_parallel.py",
    "test_examples.py",
    "test_lax_conformance.py",
    "test_loops.py",
    "test_onebit.py",
    "test_onebit_adam.py",
    "test_optax.py",
    "test_places.py",
    "test_psum_cluster.py",
    "test_scan.py",
    "test_side_streams.py",
}


# Tests of those files that exercise the engine or the launcher, not jax, run on
# the first jax only: every transform and device count of the random-tree
# matrix runs with 1 or 2 workers on every jax, the 3-worker cases (and a slow
# worker's rounds, and the 1-worker trees) on the first; the loops run each
# device count once on every jax (4 devices with 1 worker, 1 and 2 with 2
# workers), every pairing on the first. The ResNet example under mpirun is
# mpirun's launch; the elastic mnist example is the launcher's restart and the
# engine's regrouping (jbps.elastic's state on every jax: ELASTIC_ON_EVERY_JAX);
# the mnist example with onebit is the plain one's training with the codec, whose
# psums and optimizer test_onebit and test_onebit_adam check on every jax; the
# other flax examples train on every jax.
ENGINE_ONLY = (
    "tests/test_psum_cluster.py::test_random_trees_match_numpy[1-",
    "tests/test_psum_cluster.py::test_random_trees_match_numpy[3-",
    "tests/test_psum_cluster.py::test_fifty_rounds_with_a_slow_worker",
    "tests/test_loops.py::test_loops_dispatched_back_to_back_finish_with_numpy_sums[3w-",
    "tests/test_loops.py::test_loops_dispatched_back_to_back_finish_with_numpy_sums[1w-1d]",
    "tests/test_loops.py::test_loops_dispatched_back_to_back_finish_with_numpy_sums[1w-2d]",
    "tests/test_loops.py::test_loops_dispatched_back_to_back_finish_with_numpy_sums[2w-4d]",
    "tests/test_examples.py::test_resnet_under_mpirun",
    "tests/test_examples.py::test_mnist_elastic",
    "tests/test_examples.py::test_mnist_with_onebit_compression",
)

# Tests of other files that depend on the jax version: jbps.elastic's state
# (a pytree of arrays on 2 devices per worker, committed, restored and
# broadcast to a worker that rejoins), and a newcomer's placement of it (jax's
# sharding classes, described and rebuilt).
ELASTIC_ON_EVERY_JAX = (
    "tests/test_elastic.py::test_a_killed_worker_leaves_the_others_training_and_a_restarted_one_rejoins",
    "tests/test_elastic.py::test_a_newcomer_places",
    "tests/test_elastic.py::test_sharding_words",
)


# Files whose outcome the jax version cannot change: the launcher and its
# rendezvous (jbps run, the scheduler, srun), what servers bind, host discovery,
# the summation kernels, the engine's units, the figures, packaging and docs. CI
# runs them on the first jax only (.ci/run: not jax_free).
JAX_FREE = {
    "test_bazel_smoke.py",
    "test_binding.py",
    "test_build_sources.py",
    "test_checkout.py",
    "test_discovery.py",
    "test_docs.py",
    "test_engine_units.py",
    "test_launch.py",
    "test_plots.py",
    "test_slurm.py",
    "test_sum_kernels.py",
    "test_wheel.py",
}


# pyproject.toml's addopts run the suite as `-n auto --dist loadfile`: each test file on one of
# this many pytest-xdist workers at a time. Most files start jobs of several processes that wait on
# sockets, timeouts and emulated links: one file at a time kept 2 cores 57% busy (test_launch,
# test_elastic and test_checkpoints, 2026-12-01), two took the whole suite from 1259 s to 846 s. Two
# also on larger machines: the tests' waits are sized for a loaded 2-core machine, not for more jobs
# at once than that. `pytest -n N` chooses.
TEST_FILES_AT_ONCE = 2


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without it, one file at a time
def pytest_xdist_auto_num_workers(config):
    return min(TEST_FILES_AT_ONCE, os.cpu_count() or 1)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = os.path.basename(str(item.fspath))
        if name not in FILE_MARKERS:
            raise pytest.UsageError(f"tests/conftest.py: {name} has no entry in FILE_MARKERS (what it needs)")
        item.add_marker(getattr(pytest.mark, FILE_MARKERS[name]))
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        if (name in JAX_VERSIONS and not item.nodeid.startswith(ENGINE_ONLY)) or item.nodeid.startswith(
            ELASTIC_ON_EVERY_JAX
        ):
            item.add_marker(pytest.mark.jax_versions)
        if name in JAX_FREE:
            item.add_marker(pytest.mark.jax_free)
        if item.nodeid.startswith(LONG_WHEN_SOAKING) and soaking(config):
            item.add_marker(pytest.mark.timeout(3600))
