"""Elastic jobs (jbps.elastic, jbps/scheduler/elastic.py): a worker killed
mid-training leaves the others training, a restarted one joins them at a
commit, and every step's sum is checked by the workers against numpy for the
membership it ran in (tests/workers/elastic_train.py); the final parameters
against numpy's total over the sizes each step was committed with. Every
process is ended by PID and checked gone."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from benchmarks.elastic_log import generations
from conftest import ELASTIC_TRAINED, REPO, job_free_env, soaking, worker_outputs, worker_script
from leftovers import assert_nothing_left
from test_launch import run as launched
import jbps
from jbps import elastic, runtime
from jbps.config import Config
from jbps.cpu_loop_deadlock import _version as jax_version
from jbps.errors import JbpsError
from jbps.procs import terminate
from jbps.scheduler.elastic import ElasticScheduler
from jbps.scheduler.rendezvous import Scheduler

TRAIN = worker_script("elastic_train.py")
FEEDBACK = worker_script("elastic_feedback.py")
SECRET = "elastic-test-secret-0123456789"
# Whether this jax's CPU runtime runs multi-device computations again after one failed (a
# lost worker's step): jax 0.5.0 does not (every later one fails with that error); 0.10.2
# and 0.12 do. The versions between are not run here.
RUNTIME_RECOVERS = jax_version(jax.__version__) >= (0, 10)


def env_for(address, worker_id, devices=2, tmpdir=None, **extra):
    host, _, port = address.rpartition(":")
    env = job_free_env(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        DMLC_ROLE="worker",
        DMLC_PS_ROOT_URI=host,
        DMLC_PS_ROOT_PORT=port,
        DMLC_WORKER_ID=str(worker_id),
        JBPS_JOB_SECRET=SECRET,
        JBPS_TEST_MARKER=extra.pop("marker"),
        **extra,
    )
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir  # where jbps makes the job's compilation cache
    return env


class Job:
    """An elastic scheduler on a thread of the test process, and its workers."""

    def __init__(self, tmp_path, num_workers, min_workers, max_workers, timeout_s=60.0, devices=2):
        self.scheduler = ElasticScheduler(
            num_workers, min_workers, max_workers, bind="127.0.0.1:0", timeout_s=timeout_s, secret=SECRET
        )
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.tmp_path, self.timeout_s, self.devices = tmp_path, timeout_s, devices
        self.tmpdir = None if tmp_path is None else tmp_path / "tmp"  # the workers' temporary directory
        if self.tmpdir is not None:
            self.tmpdir.mkdir(exist_ok=True)
        self.marker = os.urandom(8).hex()
        self.procs = []

    def _run(self):
        try:
            self.scheduler.run()
        except JbpsError as exc:
            self.error = str(exc)
        finally:
            self.scheduler.close()

    def start(self, worker_id, *args, script=TRAIN, env=None):
        n = len(self.procs)
        env = env_for(
            self.scheduler.address,
            worker_id,
            self.devices,
            marker=self.marker,
            tmpdir=str(self.tmpdir),
            JBPS_TIMEOUT_S=str(self.timeout_s),
            **(env or {}),
        )
        out = open(self.tmp_path / f"worker{n}.out", "w")
        err = open(self.tmp_path / f"worker{n}.err", "w")
        proc = subprocess.Popen(
            [sys.executable, script, *args], env=env, stdout=out, stderr=err, start_new_session=True, cwd="/"
        )
        self.procs.append(proc)
        return n

    def lines(self, n):
        text = (self.tmp_path / f"worker{n}.out").read_text()
        return [
            json.loads(line) for line in text.splitlines(keepends=True) if line.startswith("{") and line.endswith("\n")
        ]

    def stderr(self, n):
        return (self.tmp_path / f"worker{n}.err").read_text()

    def wait_for_step(self, n, step, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(line.get("step", 0) >= step for line in self.lines(n)):
                return
            assert self.procs[n].poll() is None, f"worker {n} exited with {self.procs[n].returncode}: {self.stderr(n)}"
            time.sleep(0.05)
        raise AssertionError(f"worker {n} did not reach step {step} in {timeout} s: {self.stderr(n)}")

    def finish(self, timeout=180):
        codes = [p.wait(timeout=timeout) for p in self.procs]
        self.thread.join(timeout=30)
        return codes

    def close(self):
        terminate([p for p in self.procs if p.poll() is None], grace_s=2.0, what="test")
        env = {"JBPS_TEST_MARKER": self.marker}
        assert_nothing_left(env)


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(*args, **kwargs):
        jobs.append(Job(tmp_path, *args, **kwargs))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def final(job, n):
    done = [line for line in job.lines(n) if line.get("done")]
    assert done, f"worker {n} did not finish: {job.stderr(n)}"
    return done[-1]


def trained(job, n):
    """What worker n's training gave, from its last line: the counts of programs there differ by
    process (the warm-up thread's compile of the loss check may come before or after the training
    function's first run)."""
    done = final(job, n)
    return {key: done[key] for key in ELASTIC_TRAINED}


def test_a_killed_worker_leaves_the_others_training_and_a_restarted_one_rejoins_with_every_sum_exact(job_factory):
    job = job_factory(3, 2, 3)
    # The psum timeout given to jbps.elastic.run, over the job's JBPS_TIMEOUT_S (60 s).
    steps = ["--steps", "60", "--step-seconds", "0.15", "--timeout-s", "45", "--hold-at", "50", "--hold-for", "3"]
    for i in range(3):
        job.start(i, *steps)
    job.wait_for_step(2, 5)
    job.procs[2].send_signal(signal.SIGKILL)  # mid-training, psums of the next step on their way
    killed_at = time.time()
    if not RUNTIME_RECOVERS:
        # XLA keeps the failed step's error for every later multi-device computation: the
        # survivors cannot go on, and say why, naming the jax that does.
        codes = job.finish()
        assert codes == [1, 1, -signal.SIGKILL], [job.stderr(n) for n in range(3)]
        for n in (0, 1):
            assert (
                "so this worker cannot go on: with several local CPU devices an elastic job needs jax 0.10.2"
                in (job.stderr(n).splitlines()[-1])
            ), job.stderr(n)
        return
    job.wait_for_step(0, max(line["step"] for line in job.lines(0)) + 3)
    newcomer = job.start(2, *steps)
    codes = job.finish()
    assert codes == [0, 0, -signal.SIGKILL, 0], [job.stderr(n) for n in range(4)]
    assert job.error is None
    assert {line["timeout"] for n in (0, 1, 3) for line in job.lines(n) if "step" in line} == {45.0}
    results = [trained(job, n) for n in (0, 1, newcomer)]
    for result in results:
        assert result["exact"], result  # w equals numpy's total over the committed sizes
        assert result == results[0]  # every worker ends with the same state
    # Started by the scheduler's variables, with no cache of their own: jbps gave the job one
    # directory on this host, which the newcomer's fresh process loaded its step from (the
    # generation of 3 compiles what the first did), removed as the last worker left; after
    # jbps.elastic.run returned, jax has no cache directory again, as before it.
    done = [final(job, n) for n in (0, 1, newcomer)]
    caches = [(d["cache_dir"], d["cache_dir_after"]) for d in done]
    assert caches[0][0].startswith(str(job.tmpdir / "jbps-job-cache-")), caches
    assert all(c == (caches[0][0], None) for c in caches), caches
    assert done[2]["cache_hits"] > 0 and not os.listdir(job.tmpdir), (caches, os.listdir(job.tmpdir))
    # 2 local devices per worker: sizes 6 (3 workers), 4 after the loss, 6 after the join, in that order.
    sizes = results[0]["sizes"]
    runs = [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s]
    assert runs == [6, 4, 6], sizes
    # The survivors went on after the kill, and the newcomer ran the last steps with them.
    after_kill = [line for line in job.lines(0) if "step" in line and line["at"] > killed_at]
    assert {line["size"] for line in after_kill} == {2, 3}
    commits = [line for line in job.lines(0) if "step" in line]
    steps = sorted(b["at"] - a["at"] for a, b in zip(commits, commits[1:]) if a["size"] == b["size"])
    join = next(b["at"] - a["at"] for a, b in zip(commits, commits[1:]) if (a["size"], b["size"]) == (2, 3))
    print(
        f"survivors' next commit: {after_kill[0]['at'] - killed_at:.2f} s after the kill; at the join "
        f"{join:.2f} s between commits (median step {steps[len(steps) // 2]:.2f} s)"
    )
    assert job.lines(newcomer)[0]["step"] > 5 and job.lines(newcomer)[0]["size"] == 3
    assert "rolling back to the last commit and regrouping" in job.stderr(0)


def lose_and_restart_worker_2(job, steps, die_at, tmp_path, smaller_first=False, newcomer_env=None):
    """Workers 0 and 1 train `steps`; worker 2 kills itself at step `die_at`
    and is started again (with smaller_first, once worker 0 committed a step
    without it; with newcomer_env in its environment). The newcomer's index, and the 3 workers' last lines once the
    job ended well: every sum exact (against numpy), the same state."""
    for i in range(2):
        job.start(i, *steps)
    job.start(2, *steps, "--die-at", str(die_at), "--die-file", str(tmp_path / "died"))
    job.procs[2].wait(timeout=120)  # it killed itself
    deadline = time.monotonic() + 120
    while smaller_first and not any(line.get("size") == 2 for line in job.lines(0)):
        assert time.monotonic() < deadline and job.procs[0].poll() is None, job.stderr(0)
        time.sleep(0.05)
    newcomer = job.start(2, *steps, env=newcomer_env)
    codes = job.finish()
    assert codes == [0, 0, -signal.SIGKILL, 0], [job.stderr(n) for n in range(4)]
    assert job.error is None
    results = [trained(job, n) for n in (0, 1, newcomer)]
    assert all(r == results[0] and r["exact"] for r in results), results
    return newcomer, results


def test_a_steps_program_is_the_same_text_for_every_membership_and_its_sums_and_means_stay_exact(job_factory, tmp_path):
    # An elastic job's psum routes its chunks to no server (the engine deals them by each
    # generation's split) and its mean divides by the worker count read as the program runs,
    # so that after a loss or a join the step lowers to the program it was, which jax's
    # compilation cache then gives instead of a compile. The worker checks every sum and mean
    # against numpy and prints a digest of its step's program at every commit.
    job = job_factory(3, 2, 3, devices=2 if RUNTIME_RECOVERS else 1)
    steps = ["--steps", "40", "--step-seconds", "0.05", "--mean", "--hold-at", "34", "--hold-for", "3"]
    newcomer, results = lose_and_restart_worker_2(job, steps, 5, tmp_path, smaller_first=True)
    commits = [line for n in (0, 1, newcomer) for line in job.lines(n) if "program" in line]
    assert {line["size"] for line in commits} == {2, 3}, commits
    assert len({line["program"] for line in commits}) == 1, {(c["size"], c["program"]) for c in commits}


@pytest.mark.parametrize("in_trace", [False, True], ids=["step-reads-nothing", "step-reads-rank-and-size"])
def test_a_loss_and_a_join_keep_the_survivors_programs_unless_their_trace_read_the_membership(
    job_factory, tmp_path, in_trace
):
    # After a loss or a join, what a survivor's step took from the membership is unchanged unless
    # its trace read jbps.size() or jbps.rank(): then nothing is traced or lowered again (the
    # newcomer traces its own step, and its psums get the names the survivors' have, whatever the
    # order it traces in). A step that read them while jax traced it holds them baked in: every
    # member traces again, and the worker checks the size its program holds and every sum against
    # numpy.
    job = job_factory(3, 2, 3, devices=2 if RUNTIME_RECOVERS else 1)
    steps = ["--steps", "40", "--step-seconds", "0.05", "--hold-at", "34", "--hold-for", "3"]
    steps += ["--membership-in-trace"] if in_trace else []
    lose_and_restart_worker_2(job, steps, 5, tmp_path, smaller_first=True)
    for n in (0, 1):
        commits = [line for line in job.lines(n) if "lowered" in line]
        changes = [(a, b) for a, b in zip(commits, commits[1:]) if a["size"] != b["size"]]
        assert [(a["size"], b["size"]) for a, b in changes] == [(3, 2), (2, 3)], commits
        (before_loss, after_loss), (before_join, after_join) = changes
        assert (after_loss["lowered"] > before_loss["lowered"]) == in_trace, changes
        assert (after_join["lowered"] > before_join["lowered"]) == in_trace, changes
    assert ("programs kept" in job.stderr(0)) != in_trace, job.stderr(0)[-3000:]
    # The survivors held the same commit (worker 2 died after it): each went on from its own, with no
    # broadcast; the first generation and the join took rank 0's. Every sum and w checked above.
    for n in (0, 1):
        states = states_by_generation(job.stderr(n))
        assert states == [(3, "from rank 0"), (2, "kept"), (3, "from rank 0")], job.stderr(n)


def test_a_join_traces_again_on_every_member_where_the_newcomer_has_no_compilation_cache(job_factory, tmp_path):
    # A newcomer without jax's persistent cache would compile its step while the survivors wait
    # in their first psum (up to the psum timeout): every member traces again instead, as in a
    # first generation, and each compiles beside it. Every sum checked against numpy.
    job = job_factory(3, 2, 3, devices=2 if RUNTIME_RECOVERS else 1)
    steps = ["--steps", "40", "--step-seconds", "0.05", "--hold-at", "34", "--hold-for", "3"]
    newcomer_env = {"JAX_ENABLE_COMPILATION_CACHE": "0"}
    lose_and_restart_worker_2(job, steps, 5, tmp_path, smaller_first=True, newcomer_env=newcomer_env)
    for n in (0, 1):
        programs = [g["programs"] for g in generations(job.stderr(n))]
        assert len(programs) == 3 and programs[1].startswith("kept"), programs
        assert programs[2] == "forgotten (traced again: a member that traces afresh has no compilation cache)", programs


@pytest.mark.parametrize("warm_up", ["run", "compile"], ids=["runs-the-step", "step-reads-rank-and-size"])
def test_a_newcomer_that_warms_up_traces_its_step_before_it_asks_to_join(job_factory, tmp_path, warm_up):
    # With jbps.elastic.run(warm_up=...) a worker that joins a running job traces, compiles and runs
    # its step (with rank 0's sizing, from the scheduler; a rehearsal, whose psums return their
    # operands, checked by the worker) before it asks to join: at the join every member, the
    # newcomer too, keeps its programs and none traces the step while the others wait.
    # A warm-up whose trace reads jbps.rank() cannot run before the generation is known: it says so
    # and the newcomer traces at the join, as without one. Every sum checked against numpy.
    job = job_factory(3, 2, 3, devices=2 if RUNTIME_RECOVERS else 1)
    steps = ["--steps", "40", "--step-seconds", "0.05", "--hold-at", "34", "--hold-for", "3"]
    in_trace = warm_up == "compile"
    steps += ["--warm-up", warm_up] + (["--membership-in-trace"] if in_trace else [])
    newcomer, _ = lose_and_restart_worker_2(job, steps, 5, tmp_path, smaller_first=True)
    log = job.stderr(newcomer)
    programs = [g["programs"] for g in generations(log)]
    if in_trace:
        assert "jbps.elastic: warm_up could not trace the step before the join (jbps.rank() is not known" in log, log
        assert programs == ["forgotten (traced again)"], log
        return
    warmed = log.index("jbps.elastic: warmed up in")
    assert warmed < log.index("jbps.elastic: generation"), log  # before it joined
    assert programs == ["kept"], log
    for n in (0, 1):  # the first generation's workers had no running job to warm up for
        assert "warmed up" not in job.stderr(n)
        assert [g["programs"] for g in generations(job.stderr(n))][2] == "kept", job.stderr(n)


@pytest.mark.parametrize(
    "fault, error",
    [
        ("raise", "ValueError: the warm-up's own error"),
        ("donate", "jbps.elastic.run's warm_up deleted the state's ['w'] (a step that donates its arguments ran on"),
    ],
    ids=["raises", "donates-the-state"],
)
def test_a_newcomer_whose_warm_up_raises_ends_with_its_error_and_the_others_never_regroup(job_factory, fault, error):
    # The warm-up is the training's own code: its error ends the newcomer, as one in the training
    # function would; so does a warm-up that deletes the state it was given (a step donating its
    # arguments), which the join needs, named in one line. It had not asked to join yet, so the
    # running workers train on in their generation, and finish with every sum exact.
    if fault == "donate" and not RUNTIME_RECOVERS:
        pytest.skip(f"with jax {jax.__version__} the newcomer did not exit after naming the leaf (limitations.md)")
    job = job_factory(2, 2, 3, devices=2 if RUNTIME_RECOVERS else 1)
    steps = ["--steps", "60", "--step-seconds", "0.05", "--warm-up"]
    for i in range(2):
        job.start(i, *steps)
    job.wait_for_step(0, 5)
    # Paused (by PID) while the newcomer starts, so that their generation still runs when it
    # registers, however slowly it starts on a loaded machine.
    for i in range(2):
        job.procs[i].send_signal(signal.SIGSTOP)
    try:
        newcomer = job.start(2, "--steps", "60", "--warm-up", fault)
        assert job.procs[newcomer].wait(timeout=120) == 1, job.stderr(newcomer)
    finally:
        for i in range(2):
            job.procs[i].send_signal(signal.SIGCONT)
    assert error in job.stderr(newcomer), job.stderr(newcomer)
    assert job.finish()[:2] == [0, 0], [job.stderr(n) for n in range(2)]
    results = [trained(job, n) for n in range(2)]
    assert results[0] == results[1] and results[0]["exact"], results
    for n in range(2):  # one generation: the newcomer never asked to join
        assert [g["generation"] for g in generations(job.stderr(n))] == [1], job.stderr(n)


def test_a_rehearsal_sums_the_local_devices_only_until_it_ends_and_is_refused_while_the_engine_runs(server):
    # A newcomer's warm-up may run its step before it joins: no engine runs, and each psum sums
    # this worker's devices only (XLA's part of a psum), the mean dividing by the size foreseen.
    # Against numpy, with the conftest's 4 local devices.
    k = jax.local_device_count()

    def step():  # a function of its own each time: nothing traced for the rehearsal is reused
        return jax.pmap(lambda x: (jbps.psum(x, "i", name="rehearsed"), jbps.pmean(x, "i", name="mean")), "i")

    x = np.arange(1, k + 1, dtype=np.float32)[:, None] * np.linspace(0.5, 4.0, 8, dtype=np.float32)
    sizing = json.dumps(dataclasses.asdict(runtime._Sizing()))
    rehearsed = step()
    with runtime.tracing_ahead(Config.resolve({}, caller="the test"), sizing, 3):
        total, mean = jax.block_until_ready(rehearsed(x))
    np.testing.assert_array_equal(np.asarray(total), np.broadcast_to(x.sum(0), x.shape))
    np.testing.assert_allclose(np.asarray(mean), np.broadcast_to(x.sum(0) / (3 * k), x.shape), rtol=1e-6)
    # It lasts until the engine starts (a late call of it is still one), or until jbps.elastic.run
    # ends it where this worker never joined: its program, run without an engine, then fails.
    late, _ = jax.block_until_ready(rehearsed(x))
    np.testing.assert_array_equal(np.asarray(late), np.broadcast_to(x.sum(0), x.shape))
    runtime.end_rehearsal()
    if RUNTIME_RECOVERS:  # older jax's CPU runtime fails every later multi-device program after one fails
        with pytest.raises(Exception, match="engine is not running"):  # the psum's or the mean's words
            jax.block_until_ready(rehearsed(x))
    with jbps.init(servers=[server], num_workers=1, worker_rank=0, timeout_s=20):
        with pytest.raises(RuntimeError, match="a rehearsal runs before the engine starts, and the engine is running"):
            runtime._core.engine_set_rehearsal(2)
        total, mean = jax.block_until_ready(step()(x))  # the engine's sums
    np.testing.assert_array_equal(np.asarray(total), np.broadcast_to(x.sum(0), x.shape))
    np.testing.assert_allclose(np.asarray(mean), np.broadcast_to(x.sum(0) / k, x.shape), rtol=1e-6)


def test_a_warm_up_that_is_not_a_function_is_named_when_the_training_function_is_decorated():
    with pytest.raises(JbpsError, match=r"jbps\.elastic\.run\(warm_up=\.\.\.\) takes a function of the state, got int"):
        elastic.run(warm_up=3)


def states_by_generation(log):
    """(workers, where its state came from: "kept" or "from rank 0") for each generation a worker's log names."""
    return [(g["workers"], g["state"]) for g in generations(log)]


def test_a_worker_lost_while_steps_are_dispatched_back_to_back_leaves_the_others_training(job_factory, tmp_path):
    # As a training loop runs: steps dispatched without waiting (each checked at the next commit,
    # every 4 steps), 2 local devices per worker. Worker 2 kills itself at step 40, with the
    # others' steps in flight; they roll back, go on, and take a restarted worker back.
    job = job_factory(3, 2, 3)
    steps = ["--steps", "400", "--step-seconds", "0.02", "--commit-every", "4", "--back-to-back"]
    steps += ["--hold-at", "300", "--hold-for", "3"]  # the restarted worker joins by then
    _, results = lose_and_restart_worker_2(job, steps, 40, tmp_path)
    sizes = results[0]["sizes"]
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [6, 4, 6], sizes


def test_too_few_workers_left_fail_with_a_message_naming_the_minimum(job_factory):
    job = job_factory(2, 2, 2, timeout_s=4.0)
    for i in range(2):
        job.start(i, "--steps", "400", "--step-seconds", "0.05")
    job.wait_for_step(0, 3)
    job.procs[1].send_signal(signal.SIGKILL)
    codes = job.finish(timeout=60)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0
    assert "fewer than the job's minimum of 2 (--min-workers)" in job.stderr(0)
    assert "fewer than the job's minimum" in job.error


def test_jbps_run_starts_a_failed_worker_again_and_it_rejoins(tmp_path):
    marker = os.urandom(8).hex()
    env = job_free_env(JAX_PLATFORMS="cpu", JBPS_TEST_MARKER=marker)
    die = tmp_path / "died"
    argv = [sys.executable, "-m", "jbps", "run", "-n", "3", "--min-workers", "2", "--max-workers", "3"]
    argv += ["--local-devices", "2", sys.executable, TRAIN, "--steps", "40", "--step-seconds", "0.1"]
    argv += ["--die-at", "5", "--die-file", str(die), "--hold-at", "30", "--hold-for", "3"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, cwd="/")
    try:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert die.exists()
        assert "exited with -9: starting it again (2 restarts left)" in proc.stderr
        lines = [text.splitlines() for text in worker_outputs(proc.stdout, 3)]
        done = [json.loads(next(line for line in lines[n] if '"done"' in line)) for n in range(3)]
        caches = [(d.pop("cache_dir"), d.pop("cache_hits")) for d in done]
        assert all(d.pop("cache_dir_after") == c[0] for d, c in zip(done, caches)), caches  # the launcher's stands
        warmed = [d.pop("lowered_before_training") for d in done]
        assert len(done) == 3 and all(d["exact"] and d == done[0] for d in done), done
        # Every process, the restarted one's included, lowered jbps.elastic's warm-up program while
        # it waited for its first generation: its first step does not pay jax's first trace.
        assert all(n >= 1 for n in warmed), warmed
        # The job's compilation cache: one for its workers, removed at its end. The survivors keep
        # their programs through the loss and the join; the restarted process (no commit of the
        # generation of 2) loads the step the first generation compiled.
        assert caches[0][0] and all(c[0] == caches[0][0] for c in caches), caches
        restarted = [not any('"size": 2' in line for line in lines[n]) for n in range(3)]
        assert sorted(restarted) == [False, False, True], lines
        assert all(hits > 0 for (_, hits), fresh in zip(caches, restarted) if fresh), (caches, restarted)
        assert not os.path.exists(caches[0][0]), caches
    finally:
        assert_nothing_left({"JBPS_TEST_MARKER": marker})


def test_the_join_bench_times_a_join_that_includes_the_new_generations_whole_step():
    """benchmarks.elastic_join: a worker kills itself and joins again; from the
    survivors' regrouping commit to their next, and from the kill to their next
    commit, the new generation's step runs whole (its 0.3 s of computation is
    not skipped by the regroup)."""
    marker = os.urandom(8).hex()
    env = job_free_env(JAX_PLATFORMS="cpu", JBPS_TEST_MARKER=marker)
    argv = [sys.executable, "-m", "benchmarks.elastic_join", "--runs", "1", "--steps", "30"]
    try:
        # test_launch's run: its own session, the group ended after it, a timeout failing the test.
        proc, out, err = launched([*argv, "--work-seconds", "0.3", "--timeout-s", "180", "--json"], env, 240, REPO)
        assert proc.returncode == 0, err[-3000:]
        (run,) = json.loads(out)["runs"]
        assert 0.3 <= run["step_s"] < 3, run
        assert run["join_s"] >= 0.3 and run["broadcast_s"] >= 0, run
        assert run["loss_s"] >= 0.3, run  # the survivors redo the step after the kill, whole
        assert run["over_s"] == pytest.approx(run["join_s"] - run["broadcast_s"] - run["step_s"]), run
    finally:
        assert_nothing_left({"JBPS_TEST_MARKER": marker})


def test_the_join_bench_times_a_models_training_step():
    """benchmarks.elastic_join --model: the same loss and join with a model's
    training step (benchmarks/elastic_model_worker.py: jbps.optax.distributed
    inside jbps.elastic.run), a step a commit; the survivors' commit after the
    kill is found whether or not the restarted worker came back before it."""
    marker = os.urandom(8).hex()
    env = job_free_env(JAX_PLATFORMS="cpu", JBPS_TEST_MARKER=marker)
    argv = [sys.executable, "-m", "benchmarks.elastic_join", "--runs", "1", "--steps", "20", "--model", "mlp"]
    try:
        flags = ["--layers", "2", "--width", "64", "--batch", "8", "--timeout-s", "180", "--json"]
        proc, out, err = launched([*argv, *flags], env, 240, REPO)
        assert proc.returncode == 0, err[-3000:]
        (run,) = json.loads(out)["runs"]
        assert 0 < run["step_s"] < 3 and run["next_step_s"] > 0, run
        assert run["join_s"] >= run["step_s"] and run["loss_s"] > 0, run
        assert run["over_s"] == pytest.approx(run["join_s"] - run["broadcast_s"] - run["step_s"]), run
    finally:
        assert_nothing_left({"JBPS_TEST_MARKER": marker})


def failing_quietly(run):
    def call():
        try:
            run()
        except (JbpsError, OSError, ValueError):
            pass  # closed by the test: its socket (OSError) or its selector (ValueError)

    return call


def refused_by(scheduler, argv):
    """A member's run against `scheduler` (on a thread until the member is done, then closed)."""
    waiting = threading.Thread(target=failing_quietly(scheduler.run), daemon=True)
    waiting.start()
    marker = os.urandom(8).hex()
    try:
        # The timeouts are long: a fresh process under load may take seconds to register.
        env = env_for(scheduler.address, 0, marker=marker, JBPS_TIMEOUT_S="60")
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd="/")
    finally:
        scheduler.close()
        waiting.join(timeout=20)
        assert not waiting.is_alive()
        assert_nothing_left({"JBPS_TEST_MARKER": marker})


def test_an_elastic_worker_and_a_plain_job_refuse_each_other_with_one_line():
    plain = Scheduler(1, 1, bind="127.0.0.1:0", timeout_s=60.0, secret=SECRET)
    proc = refused_by(plain, [sys.executable, TRAIN, "--steps", "2"])
    assert proc.returncode != 0
    assert "runs a job that is not elastic: start it with --min-workers and --max-workers" in proc.stderr

    elastic = ElasticScheduler(1, 1, 1, bind="127.0.0.1:0", timeout_s=60.0, secret=SECRET)
    proc = refused_by(elastic, [sys.executable, "-c", "import jbps; jbps.init()"])
    assert proc.returncode != 0
    assert "this job is elastic: its workers train inside jbps.elastic.run" in proc.stderr


def test_a_stranger_without_the_secret_is_refused_and_the_job_goes_on(job_factory):
    job = job_factory(1, 1, 2)
    refused = job.tmp_path / "refused"  # the worker holds its step 5 until then, however slow the stranger
    job.start(0, "--steps", "30", "--step-seconds", "0.1", "--hold-at", "5", "--hold-until", str(refused))
    job.wait_for_step(0, 2)
    stranger = env_for(job.scheduler.address, 1, marker=job.marker, JBPS_TIMEOUT_S="10")
    stranger["JBPS_JOB_SECRET"] = "not-the-secret-of-this-job"
    proc = subprocess.run(
        [sys.executable, TRAIN, "--steps", "2"], env=stranger, capture_output=True, text=True, timeout=60, cwd="/"
    )
    assert proc.returncode != 0
    assert "its proof of the job secret is wrong" in proc.stderr
    refused.touch()
    assert job.finish() == [0]
    result = final(job, 0)
    assert result["exact"] and set(result["sizes"]) == {2}  # one worker, 2 devices, never regrouped


def test_the_scheduler_hands_a_generation_the_links_rates_only_for_hosts_measured_before():
    # What rank 0 said its generation measured, by server host: a later generation whose servers
    # all sit on those hosts gets them (each server its host's slowest), one with a new host none.
    sched = ElasticScheduler(2, 1, 3)
    try:
        assert sched._known_rates(["127.0.0.2:5000"]) is None  # nothing measured yet
        sched.addresses = ["127.0.0.2:5000", "127.0.0.3:5001", "127.0.0.3:5002"]
        sched._keep_rates({"link": 1.2e8, "servers": [1.1e8, 5e7, 9e7]})
        assert sched._known_rates(["127.0.0.3:6000", "127.0.0.2:6001"]) == {"link": 1.2e8, "servers": [5e7, 1.1e8]}
        assert sched._known_rates(["127.0.0.2:6000", "127.0.0.4:6001"]) is None
        # A generation with a new host measures again; the hosts it left out keep their rates.
        sched.addresses = ["127.0.0.2:8000", "127.0.0.4:8001"]
        sched._keep_rates({"link": 1.1e8, "servers": [1e8, 7e7]})
        assert sched._known_rates(["127.0.0.3:9000", "127.0.0.4:9001", "127.0.0.2:9002"]) == {
            "link": 1.1e8,
            "servers": [5e7, 7e7, 1e8],
        }
        sched._keep_rates({"link": 1e8, "servers": None})  # one server, or the per-server probe failed
        assert sched._known_rates(["127.0.0.4:7000"]) == {"link": 1e8, "servers": None}
        sched._keep_rates({"link": "fast"})  # malformed: ignored, the last good ones stay
        assert sched._known_rates(["127.0.0.4:7000"]) == {"link": 1e8, "servers": None}
    finally:
        sched.close()


def test_elastic_run_names_a_bad_setting_when_the_function_is_decorated():
    import jbps.elastic

    with pytest.raises(
        JbpsError,
        match=r"^jbps.elastic.run\(\) cannot take num_workers, servers: each generation's membership decides$",
    ):
        jbps.elastic.run(servers=["h:1"], num_workers=2)
    with pytest.raises(JbpsError, match=r"^jbps.elastic.run\(timeout_s=...\)='soon': "):
        jbps.elastic.run(timeout_s="soon")
    with pytest.raises(TypeError, match=r"^jbps.elastic.run\(\) got unknown option\(s\) \['timeout'\]"):
        jbps.elastic.run(lambda state: None, timeout=3)


def test_a_state_names_its_values_and_refuses_others():
    import jbps.elastic

    state = jbps.elastic.State(params={"w": np.ones(3, np.float32)}, step=0)
    state.step = 5
    state.params = {"w": np.zeros(3, np.float32)}
    state.restore()  # to the values it was made with, its first commit
    assert state.step == 0 and np.array_equal(state.params["w"], np.ones(3, np.float32))
    with pytest.raises(AttributeError, match="has no value 'opt_state'.*holds params, step"):
        state.opt_state = {}
    with pytest.raises(JbpsError, match="needs the values training goes on from"):
        jbps.elastic.State()


def test_members_go_on_from_their_own_state_only_where_each_took_it_in_one_generation_and_committed_as_often():
    # A generation's start skips the state's broadcast where every member's row (State._held, as
    # _what_members_hold gathers it) is the same taken commit; a commit counts in it.
    import jbps.elastic
    from jbps.elastic import _hold_one_commit

    state = jbps.elastic.State(step=0)
    object.__setattr__(state, "_held", (3, 0))  # as a generation's start leaves it
    state.commit()
    state.commit()
    assert state._held == (3, 2)

    def rows(*held):
        return np.array([[*h, 7, 7, 7, 7] for h in held], np.int32)

    assert _hold_one_commit(rows((3, 2), (3, 2), (3, 2)))  # a loss's survivors
    assert not _hold_one_commit(rows((3, 2), (3, 1)))  # a loss between one survivor's commit and another's
    assert not _hold_one_commit(rows((3, 2), (2, 2)))
    assert not _hold_one_commit(rows((3, 2), (0, 0)))  # a newcomer
    assert not _hold_one_commit(rows((0, 0), (0, 0)))  # the first generation: each its own fresh state


@pytest.mark.parametrize(
    "make",
    [
        lambda devices: jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices), ("i",)), P("i")),
        lambda devices: jax.sharding.NamedSharding(
            jax.sharding.Mesh(np.array(devices[::-1]).reshape(2, -1), ("a", "b")), P(None, ("b", "a")), memory_kind=None
        ),
        lambda devices: jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(devices[:2]), ("x",)), P()),
    ],
    ids=["pmap-like", "2d-reversed", "replicated-on-two"],
)
def test_sharding_words_rebuild_a_mesh_sharding_on_this_processs_devices(make):
    import json

    from jbps import sharding_words

    sharding = make(jax.local_devices())
    words = json.loads(json.dumps(sharding_words.to_words(sharding)))  # as the root's travel
    rebuilt = sharding_words.from_words(words)
    assert rebuilt == sharding, (words, rebuilt)
    x = jax.device_put(
        np.arange(8 * len(jax.local_devices()), dtype=np.float32).reshape(len(jax.local_devices()), -1), sharding
    )
    assert jax.device_put(np.asarray(x), rebuilt).sharding == x.sharding


def test_sharding_words_leave_what_has_no_such_form_on_the_host():
    from jbps import sharding_words

    assert sharding_words.to_words(jax.numpy.ones(3).sharding) is None  # one device: placed from the host
    assert sharding_words.to_words(None) is None
    devices = len(jax.local_devices())
    assert sharding_words.from_words([["i"], [devices + 1], list(range(devices + 1)), ["i"], [], None]) is None
    assert sharding_words.from_words([["i"], [1], [0], ["i"], ["NoSuchAxisType"], None]) is None
    assert sharding_words.from_words(["not", "words"]) is None
    assert sharding_words.from_words(None) is None


def test_a_synced_state_keeps_its_arrays_placement_so_a_sharded_step_does_not_compile_again(session):
    # A generation starts from State.sync: the root's values, each placed as this worker's leaf was
    # at its last commit. From host arrays a sharded step compiles a second program (for inputs not
    # placed as its outputs are) at every membership change; jax's compile events count it.
    from jax.sharding import Mesh, NamedSharding

    import jbps.elastic
    from jbps.data_parallel import shard_map

    mesh = Mesh(np.array(jax.local_devices()), ("d",))
    step = jax.jit(
        shard_map(
            lambda w, x: (w + jax.lax.pmean(x.sum(), "d"), x),
            mesh=mesh,
            in_specs=(P(), P("d")),
            out_specs=(P(), P("d")),
        )
    )
    x = np.arange(2 * len(jax.local_devices()), dtype=np.float32).reshape(-1, 2)
    w, x = step(*step(np.zeros((3,), np.float32), x))  # as a loop holds them: the step's outputs, fed back
    state = jbps.elastic.State(params={"w": w, "x": x}, host={"n": np.ones(2, np.float32)}, step=4)
    state.commit()
    compiles, counting = [], [True]

    def listener(event, _secs, **_):  # jax keeps it for the process: it counts while this test runs
        if counting and event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        state.params = {"w": w + 1, "x": x}
        state.restore()  # as after a fault: host arrays
        jax.clear_caches()  # as each generation starts
        state.sync(root=0)
        assert isinstance(state.params["w"], jax.Array) and state.params["w"].sharding == w.sharding
        assert state.params["x"].sharding == x.sharding and isinstance(state.params["x"].sharding, NamedSharding)
        assert isinstance(state.host["n"], np.ndarray) and state.step == 4  # host values stay on the host
        before = len(compiles)
        out, _ = step(*step(state.params["w"], state.params["x"]))
        jax.block_until_ready(out)
        assert len(compiles) - before == 1, compiles[before:]  # the generation's first step's program serves the next
    finally:
        counting.clear()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(w) + np.asarray(x).mean() * 4)


def test_a_newcomer_places_its_state_as_the_root_does_so_its_second_step_does_not_compile_again(job_factory):
    # A pmap adds each step's sums to a state leaf that starts on the host. A newcomer takes rank
    # 0's values and, having no commit of its own, rank 0's placement: the step it compiles first
    # serves its later steps too (from host arrays its second step would compile another program,
    # for the first one's outputs, and the others would wait for it). jax's compile events count it.
    job = job_factory(1, 1, 2)
    args = ["--steps", "24", "--step-seconds", "0.1", "--placed-state", "--hold-at", "12", "--hold-for", "2"]
    job.start(0, *args)
    job.wait_for_step(0, 3)
    newcomer = job.start(1, *args)
    codes = job.finish()
    assert codes == [0, 0], [job.stderr(n) for n in range(2)]
    results = [final(job, n) for n in (0, newcomer)]
    for result in results:
        assert result["exact"] and result["acc_exact"], result
    joined = [line for line in job.lines(newcomer) if "step" in line]
    assert len(joined) >= 3 and {line["size"] for line in joined} == {2}, joined
    # Every program the newcomer runs was compiled by its first commit.
    assert [line["compiles"] for line in joined] == [joined[0]["compiles"]] * len(joined), joined
    # The same on rank 0 in the generation the newcomer joined (its first, from host arrays, compiled
    # its second step again, as any job's first steps do).
    commits = [line for line in job.lines(0) if line.get("size") == 2]
    assert len(commits) >= 3 and [c["compiles"] for c in commits] == [commits[0]["compiles"]] * len(commits), commits


def test_error_feedback_residuals_stay_each_workers_own_across_a_loss_and_a_join(job_factory):
    # jbps.optax.distributed(adam, compression="onebit"): each worker's residuals are what its own
    # encodings have not sent yet. At a generation's start every worker takes rank 0's values but
    # keeps its own residuals (rank 0's would be counted once per worker and the others' dropped):
    # a survivor goes on with those of the commit it rolled back to, a newcomer with its own zeros.
    job = job_factory(3, 2, 3, devices=1)
    args = ["--steps", "30", "--step-seconds", "0.1", "--hold-at", "20", "--hold-for", "3"]
    for i in range(3):
        extra = ["--die-at", "6", "--die-file", str(job.tmp_path / "die")] if i == 2 else []
        job.start(i, *args, *extra, script=FEEDBACK)
    job.wait_for_step(0, 9)
    newcomer = job.start(2, *args, script=FEEDBACK)
    codes = job.finish()
    assert codes == [0, 0, -signal.SIGKILL, 0], [job.stderr(n) for n in range(4)]
    workers = (0, 1, newcomer)
    done = [[line for line in job.lines(n) if line.get("done")] for n in workers]
    assert all(done), [job.stderr(n) for n in workers]
    assert len({d[-1]["params"] for d in done}) == 1, done  # the same sums applied everywhere
    starts = {n: [line for line in job.lines(n) if "start" in line] for n in workers}
    assert [s["size"] for s in starts[0]] == [3, 2, 3], starts[0]
    checked = 0
    for n in workers:
        lines = job.lines(n)
        first_start = next(at for at, line in enumerate(lines) if "start" in line)
        for at, line in enumerate(lines):
            if "start" not in line or line["start"] == 0:
                continue
            # Rank 0 of the same generation (its start line has the same step and size).
            root = [s for m in workers for s in starts[m] if s["rank"] == 0 and s["start"] == line["start"]]
            assert len(root) == 1, (line, starts)
            if n == newcomer and at == first_start:
                assert line["residuals_abs"] == 0.0, line
                assert root[0]["residuals_abs"] > 0.0, root
                checked += 1
                continue
            saved = [s for s in lines[:at] if s.get("saving") == line["start"]]
            assert saved and line["residuals"] == saved[-1]["residuals"], (n, line, saved)
            if line["rank"] != 0:
                assert line["residuals"] != root[0]["residuals"], (line, root)
                checked += 1
    assert checked >= 3, checked  # worker 1 after the loss and the join, and the newcomer


def test_a_worker_joining_with_another_model_is_refused_naming_the_leaf_and_the_job_goes_on(job_factory):
    job = job_factory(2, 2, 3)
    refused = job.tmp_path / "refused"  # the two hold their step 10 until then, however slow the joiner
    for i in range(2):
        job.start(i, "--steps", "40", "--step-seconds", "0.1", "--hold-at", "10", "--hold-until", str(refused))
    job.wait_for_step(0, 3)
    stranger = job.start(2, "--steps", "40", "--width", "999")
    job.procs[stranger].wait(timeout=150)
    refused.touch()
    codes = job.finish()
    assert codes[:2] == [0, 0] and codes[stranger] != 0
    assert "it has w: (999,) float32 where rank 0 has w: (1000,) float32" in job.stderr(stranger)
    results = [trained(job, n) for n in range(2)]
    assert results[0] == results[1] and results[0]["exact"], results
    assert set(results[0]["sizes"]) == {4}  # 2 workers x 2 devices throughout: the bad joiner never summed


class Members(Job):
    """Workers' sides of an elastic rendezvous (jbps/bootstrap/elastic.py's Membership, each with
    the summation server it starts) against a real scheduler on a thread: its generations
    without training, so a test can put a newcomer exactly where it wants it."""

    def __init__(self, num_workers, min_workers, max_workers, timeout_s=10.0):
        super().__init__(None, num_workers, min_workers, max_workers, timeout_s=timeout_s)
        self.members, self.servers = [], []

    def register(self, worker_id):
        from jbps.bootstrap.elastic import Membership
        from jbps.config import Config

        env = env_for(self.scheduler.address, worker_id, marker=self.marker, JBPS_TIMEOUT_S=str(self.timeout_s))
        self.members.append(Membership(Config.resolve({}, environ=env, caller="test")))
        return self.members[-1]

    def join(self, *members):
        """Each member's next generation (they join it together), as join() returns it."""
        jobs = [None] * len(members)

        def one(i):
            _, hosted, jobs[i] = members[i].join()
            self.servers += hosted

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(members))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert all(jobs), jobs
        return jobs

    def two_running_and_a_newcomer(self):
        """Workers 0 and 1 in generation 1, then worker 2 registered: generation 1 is asked to regroup."""
        first, second = self.register(0), self.register(1)
        assert [j["generation"] for j in self.join(first, second)] == [1, 1]
        late = self.register(2)
        asked_to_regroup(second)
        return first, second, late

    def close(self):
        for server in self.servers:
            server.stop()
        for m in self.members:
            m.close()
        self.thread.join(timeout=30)  # the scheduler ends once its members are gone
        super().close()


@pytest.fixture
def members():
    made = []
    yield lambda *args: made.append(Members(*args)) or made[-1]
    for job in made:
        job.close()


def asked_to_regroup(member, timeout=20):
    deadline = time.monotonic() + timeout
    while not member.asked_to_regroup():
        assert time.monotonic() < deadline, "the running worker was not asked to regroup"
        time.sleep(0.02)


def test_a_newcomer_that_comes_as_the_job_finishes_is_told_it_is_over_and_never_trains_it_alone(members):
    # Rank 0 has finished, rank 1 is finishing, and a newcomer registers: nobody is left to hand it
    # the last commit, so it must not start a generation of its own (min 1 allows one) from its
    # fresh state: the job is over.
    job = members(2, 1, 3)
    first, second, late = job.two_running_and_a_newcomer()
    first.finish()
    second.finish()
    with pytest.raises(JbpsError, match="is over: its workers finished before this one could join them"):
        late.join()
    job.thread.join(timeout=30)
    assert not job.thread.is_alive() and job.error is None, job.error
    assert job.scheduler.finished == 2 and job.scheduler.generation == 1


def test_a_newcomer_left_alone_by_a_generation_that_is_all_gone_gets_its_loss_not_a_fresh_start(members):
    job = members(2, 1, 3)
    first, second, late = job.two_running_and_a_newcomer()
    first.close()  # both gone without finishing: their commit with them
    second.close()
    with pytest.raises(JbpsError, match="every worker of generation 1 is gone and none finished: the state"):
        late.join()
    job.thread.join(timeout=30)
    assert "the state they committed is lost (1 newcomer(s) cannot start from it)" in job.error
    assert job.scheduler.generation == 1


def test_a_newcomer_whose_first_state_broadcast_failed_is_never_the_root_of_the_next_generation(members):
    # Generation 2 takes a newcomer in; its state broadcast fails (rank 0 lost on the way), so the
    # newcomer regroups with the fresh state it was made with. With the two who trained gone, it
    # must not be the root of a generation of its own (min 1 allows one).
    job = members(2, 1, 3)
    first, second, late = job.two_running_and_a_newcomer()
    first.leave_generation()
    second.leave_generation()
    assert [j["rank"] for j in job.join(first, second, late)] == [0, 1, 2]
    late.leave_generation()  # no State.sync: holds_state stays False
    first.close()
    second.close()
    with pytest.raises(JbpsError, match="every worker of generation 2 is gone and none finished: the state"):
        late.join()


def test_a_survivor_of_the_last_generation_goes_on_with_a_newcomer_after_another_finished(members):
    # Rank 0 finished; rank 1 regrouped instead (its last step's psums failed, say): it holds the
    # last commit, so it and the newcomer make the next generation, rank 1 first.
    job = members(2, 1, 3)
    first, second, late = job.two_running_and_a_newcomer()
    first.finish()
    second.leave_generation()
    jobs = job.join(second, late)
    assert [(j["generation"], j["rank"], j["num_workers"]) for j in jobs] == [(2, 0, 2), (2, 1, 2)]


def test_a_newcomer_waits_for_a_commit_further_off_than_the_timeout_and_nobody_is_dropped(job_factory):
    # Commits every 120 steps of ~0.05 s (6 s or more apart), JBPS_TIMEOUT_S 4: the newcomer waits
    # longer than the timeout for the others' next commit, told by the scheduler that the job goes on.
    job = job_factory(2, 2, 3, timeout_s=4.0)
    args = ["--steps", "360", "--step-seconds", "0.05", "--commit-every", "120", "--hold-at", "240", "--hold-for", "3"]
    for i in range(2):
        job.start(i, *args)
    job.wait_for_step(0, 120)
    newcomer = job.start(2, *args)
    codes = job.finish()
    assert codes == [0, 0, 0], [job.stderr(n) for n in range(3)]
    assert job.error is None
    results = [trained(job, n) for n in (0, 1, newcomer)]
    assert all(r == results[0] and r["exact"] for r in results), results
    sizes = results[0]["sizes"]
    assert [s for i, s in enumerate(sizes) if i == 0 or sizes[i - 1] != s] == [4, 6], sizes


def test_randomized_membership_changes_never_give_a_wrong_sum(job_factory, request):
    """Workers killed and started at random (1 to 3 of them): after every change the test waits
    for a commit of the new membership; every worker checks every step's sum against numpy for
    the size it ran with and exits 3 on a wrong one. Every other worker started gives
    jbps.elastic.run a warm_up (it runs its step as a rehearsal, or only compiles it, before it
    asks to join, with whatever changes meanwhile). The suite runs 8 changes; `pytest --soak` (or
    JBPS_SOAK=1) runs 1,000. Two devices per worker: a step whose psum failed on one device fails
    on the other too (the engine completes a step's device calls together), so no survivor is
    left waiting in XLA's all-gather of the two."""
    import random

    changes = 1000 if soaking(request.config) else 8
    rng = random.Random(7)
    job = job_factory(2, 1, 3, devices=2)
    args = ["--steps", "1000000", "--step-seconds", "0.02", "--commit-every", "5"]
    running = [job.start(i, *args) for i in range(2)]

    def committed_with(size, since):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for n in running:
                assert job.procs[n].poll() is None, f"worker {n} exited {job.procs[n].returncode}: {job.stderr(n)}"
            if all(any(line.get("size") == size and line["at"] > since for line in job.lines(n)) for n in running):
                return
            time.sleep(0.05)
        raise AssertionError(f"no commit with {size} workers within 120 s: {[job.stderr(n) for n in running]}")

    committed_with(2, 0.0)
    for change in range(changes):
        since = time.time()
        if len(running) == 3 or (len(running) > 1 and rng.random() < 0.5):
            victim = running.pop(rng.randrange(len(running)))
            job.procs[victim].send_signal(signal.SIGKILL)
            job.procs[victim].wait(timeout=30)
        else:
            started = len(job.procs)  # every other one warms up: it runs its step, or compiles it
            warms_up = ["--warm-up", "run" if started % 4 == 1 else "compile"] if started % 2 else []
            running.append(job.start(len(job.procs), *args, *warms_up))
        committed_with(len(running), since)
        if (change + 1) % 100 == 0:
            print(f"{change + 1} membership changes so far", flush=True)
    for n in range(len(job.procs)):
        assert not any("wrong" in line for line in job.lines(n)), job.lines(n)
    warmed = sum("jbps.elastic: warmed up in" in job.stderr(n) for n in range(len(job.procs)))
    print(f"{changes} membership changes, {len(job.procs)} workers started ({warmed} warmed up), no wrong sum")
