"""Starting jobs: mpirun (SPMD and MPMD), the DMLC_* scheduler bootstrap in
any start order, and `jbps run` (output, crashes, signals, two jobs at once).
Every job's sums are checked against numpy by its workers; every process is
ended by PID and checked gone."""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from conftest import job_free_env, last_json, worker_script
from leftovers import MpichSegments, assert_nothing_left, listening, processes_with
from jbps.errors import JbpsError
from jbps.launch import _this_host_address
from jbps.procs import terminate
from jbps.scheduler import Registration
from jbps.scheduler.admission import new_challenge, signed
from jbps.scheduler.rendezvous import _connect as connect_retrying

PYTHON = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PYTHON), "mpiexec")


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra):
    env = job_free_env()
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"  # not the test process's 4
    # Lets the test find every process of this job, and nothing else, in /proc.
    env["JBPS_TEST_MARKER"] = uuid.uuid4().hex
    env.update(extra)
    return env


class Result:
    def __init__(self, rank, proc, out, err):
        self.rank, self.returncode, self.stdout, self.stderr = rank, proc.returncode, out, err


def run(argv, env, timeout=180, cwd="/"):
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=cwd
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        terminate([proc], grace_s=3)
        out, err = proc.communicate()
        pytest.fail(f"{argv[:4]} timed out:\n{err[-3000:]}")
    finally:
        terminate([proc], grace_s=3)
    return proc, out, err


def per_rank_reports(stdout):
    """The workers' JSON reports out of a merged output. mpiexec forwards each
    rank's output in whatever pieces it reads, so reports may share a line."""
    decoder, reports, start = json.JSONDecoder(), [], 0
    while (start := stdout.find('{"rank"', start)) >= 0:
        report, end = decoder.raw_decode(stdout, start)
        reports.append(report)
        start = end
    return sorted(reports, key=lambda r: r["rank"])


def check_reports(reports, workers, rounds):
    assert [r["rank"] for r in reports] == list(range(workers))
    assert {r["rounds"] for r in reports} == {rounds}
    assert len({r["digest"] for r in reports}) == 1, reports


needs_mpi = pytest.mark.skipif(
    shutil.which(MPIEXEC) is None or not os.access(MPIEXEC, os.X_OK),
    reason="no mpiexec next to this Python: pip install 'jbps[mpi]'",
)


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpirun_every_rank_a_worker(ranks):
    env = base_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JBPS_TIMEOUT_S="60")
    proc, out, err = run(
        [MPIEXEC, "-n", str(ranks), PYTHON, worker_script("random_trees.py"), "--rounds", "3", "--seed", str(ranks)],
        env,
    )
    assert proc.returncode == 0, err[-3000:]
    check_reports(per_rank_reports(out), ranks, 3)
    assert_nothing_left(env)


@needs_mpi
def test_mpirun_mpmd_with_dedicated_server_ranks():
    env = base_env(JBPS_TIMEOUT_S="60")
    proc, out, err = run(
        [
            MPIEXEC,
            "-n",
            "3",
            PYTHON,
            worker_script("random_trees.py"),
            "--rounds",
            "3",
            "--mode",
            "jit",
            ":",
            "-n",
            "2",
            PYTHON,
            "-m",
            "jbps.server",
        ],
        env,
    )
    assert proc.returncode == 0, err[-3000:]
    check_reports(per_rank_reports(out), 3, 3)
    assert out.count("jbps.server listening on") == 2
    assert_nothing_left(env)


@needs_mpi
def test_mpirun_local_ranks_come_from_the_shared_memory_split():
    env = base_env(JBPS_TIMEOUT_S="60")
    proc, out, err = run([MPIEXEC, "-n", "3", PYTHON, worker_script("launch_probe.py")], env)
    assert proc.returncode == 0, err[-3000:]
    reports = per_rank_reports(out)
    assert [(r["rank"], r["size"], r["local_rank"], r["local_size"]) for r in reports] == [
        (0, 3, 0, 3),
        (1, 3, 1, 3),
        (2, 3, 2, 3),
    ]


def test_mpirun_without_mpi4py_says_what_is_missing():
    code = "import sys; sys.modules['mpi4py'] = None\nimport jbps\njbps.init()"
    env = base_env(PMI_RANK="0", PMI_SIZE="1")
    proc, out, err = run([PYTHON, "-c", code], env, timeout=60)
    assert proc.returncode != 0
    assert "mpirun" in err and "pip install 'jbps[mpi]'" in err, err[-2000:]


def start_member(role, env, argv, worker_id=None):
    extra = {"DMLC_ROLE": role}
    if worker_id is not None:
        extra["DMLC_WORKER_ID"] = str(worker_id)
    return subprocess.Popen(
        argv,
        env={**env, **extra},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd="/",
    )


def scheduler_env(timeout_s):
    # Below the ephemeral range (32768 up), so no connection's own port takes
    # this port or the next (a fixed server port).
    port = 20000 + random.Random().randrange(12000)
    return base_env(
        DMLC_NUM_WORKER="2",
        DMLC_NUM_SERVER="2",
        DMLC_PS_ROOT_URI="127.0.0.1",
        DMLC_PS_ROOT_PORT=str(port),
        JBPS_TIMEOUT_S=str(timeout_s),
    )


def finish(procs, timeout):
    """Each process's (exit code, stdout, stderr) once all have exited; fails
    the test naming every one still running at the deadline."""
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            outputs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        hung = [p for p in procs if p.poll() is None]
        terminate(procs, grace_s=2)
        report = []
        for p in procs:
            out, err = p.communicate()
            state = "still running" if p in hung else f"exited {p.returncode}"
            report.append(f"{' '.join(p.args[-3:])}: {state}\n{out[-500:]}{err[-1500:]}")
        pytest.fail(f"not every member ended within {timeout} s:\n" + "\n".join(report))
    finally:
        terminate(procs, grace_s=2)
    return outputs


@pytest.mark.parametrize("seed", [0, 1])
def test_environment_bootstrap_in_any_start_order(seed):
    env = scheduler_env(60)
    fixed_port = int(env["DMLC_PS_ROOT_PORT"]) + 1  # a server a firewall expects on a known port
    members = [
        ("scheduler", [PYTHON, "-m", "jbps.scheduler"], None),
        ("server", [PYTHON, "-m", "jbps.server", "--bind", f":{fixed_port}"], None),
        ("server", [PYTHON, "-m", "jbps.server"], None),
        ("worker", [PYTHON, worker_script("random_trees.py"), "--rounds", "3", "--mode", "jit"], 0),
        ("worker", [PYTHON, worker_script("random_trees.py"), "--rounds", "3", "--mode", "jit"], None),
    ]
    rng = random.Random(seed)
    rng.shuffle(members)
    procs = []
    for role, argv, worker_id in members:
        procs.append(start_member(role, env, argv, worker_id))
        time.sleep(rng.uniform(0, 0.5))
    outputs = finish(procs, 180)
    for (role, argv, _), (code, out, err) in zip(members, outputs):
        assert code == 0, f"{role} failed:\n{err[-3000:]}"
    reports = [last_json(out) for (role, _, _), (_, out, _) in zip(members, outputs) if role == "worker"]
    check_reports(sorted(reports, key=lambda r: r["rank"]), 2, 3)
    assert all(f"127.0.0.1:{fixed_port}" in r["servers"] for r in reports), reports[0]["servers"]
    assert_nothing_left(env)


def test_a_server_that_cannot_start_fails_every_member():
    # The port of the second server is taken. The first server registered
    # first, so the scheduler has its address before the second one fails: it
    # must hear of the failure too, not wait for workers that never come.
    env = scheduler_env(20)
    fixed_port = int(env["DMLC_PS_ROOT_PORT"]) + 1
    with socket.create_server(("127.0.0.1", fixed_port)):
        procs = [
            start_member("scheduler", env, [PYTHON, "-m", "jbps.scheduler"]),
            start_member("server", env, [PYTHON, "-m", "jbps.server"]),
        ]
        time.sleep(1.0)  # the first server registers first, so it starts first
        procs += [
            start_member("server", env, [PYTHON, "-m", "jbps.server", "--bind", f":{fixed_port}"]),
            start_member("worker", env, [PYTHON, worker_script("launch_probe.py")], worker_id=0),
            start_member("worker", env, [PYTHON, worker_script("launch_probe.py")], worker_id=1),
        ]
        outputs = finish(procs, 60)
    for code, out, err in outputs:
        assert code != 0, err[-2000:]
        assert f"cannot listen on 127.0.0.1:{fixed_port}" in err, err[-2000:]
    assert_nothing_left(env)


def test_a_scheduler_started_long_before_its_members_waits_for_them_and_then_for_the_rest_within_its_timeout():
    # A scheduler is often started before its members, whose start (imports, data, a first
    # compile) can take longer than the psum timeout: it waits for the first member (up to
    # rendezvous.FIRST_MEMBER_S), and then for the rest within its timeout, as
    # test_a_missing_worker_fails_everyone_naming_it checks.
    env = scheduler_env(2)
    address = f"127.0.0.1:{env['DMLC_PS_ROOT_PORT']}"
    scheduler = start_member("scheduler", env, [PYTHON, "-m", "jbps.scheduler"])
    try:
        time.sleep(6)  # three times its timeout
        servers = [Registration(address, "server", 30) for _ in range(2)]
        workers = [Registration(address, "worker", 30, worker_id=i) for i in range(2)]
        for i, r in enumerate(servers):  # each server learns its part, starts, and says where it listens
            assert r.receive()["num_workers"] == 2
            r.send({"address": f"127.0.0.1:{9000 + i}"})
        jobs = [r.receive() for r in workers]
        for r in servers + workers:
            r.close()
    except BaseException:
        terminate([scheduler], grace_s=2)
        raise
    code, _, err = finish([scheduler], 30)[0]
    assert code == 0, err[-2000:]
    assert [j["rank"] for j in jobs] == [0, 1], jobs
    assert sorted(jobs[0]["servers"]) == ["127.0.0.1:9000", "127.0.0.1:9001"], jobs
    assert_nothing_left(env)


def test_members_started_long_before_their_scheduler_wait_for_it_and_say_so(caplog):
    # The other order: members that find no scheduler keep trying (up to
    # rendezvous.FIRST_MEMBER_S, not only their timeout), saying once that they
    # are still waiting, and assemble when it comes.
    env = scheduler_env(2)
    address = f"127.0.0.1:{env['DMLC_PS_ROOT_PORT']}"
    registered, failed = {}, []

    def register(role, i):
        try:
            registered[role, i] = Registration(address, role, 2, worker_id=i if role == "worker" else None)
        except Exception as exc:
            failed.append(exc)

    members = [threading.Thread(target=register, args=(role, i)) for role in ("server", "worker") for i in range(2)]
    for t in members:
        t.start()
    time.sleep(6)  # three times their timeout
    scheduler = start_member("scheduler", env, [PYTHON, "-m", "jbps.scheduler"])
    try:
        for t in members:
            t.join(timeout=30)
        assert not failed and len(registered) == 4, failed
        for i in range(2):  # each server learns its part, starts, and says where it listens
            assert registered["server", i].receive()["num_workers"] == 2
            registered["server", i].send({"address": f"127.0.0.1:{9000 + i}"})
        jobs = [registered["worker", i].receive() for i in range(2)]
    except BaseException:
        terminate([scheduler], grace_s=2)
        raise
    finally:
        for r in registered.values():
            r.close()
    code, _, err = finish([scheduler], 30)[0]
    assert code == 0, err[-2000:]
    assert [j["rank"] for j in jobs] == [0, 1], jobs
    waiting = [r.getMessage() for r in caplog.records if "still no jbps scheduler at " + address in r.getMessage()]
    assert len(waiting) == 4, [r.getMessage() for r in caplog.records]  # once per member
    assert_nothing_left(env)


def test_a_scheduler_host_that_does_not_resolve_fails_the_member_at_once():
    start = time.monotonic()
    with pytest.raises(
        JbpsError, match=r"scheduler's host 'no-such-host\.invalid' \(DMLC_PS_ROOT_URI\) does not resolve"
    ):
        Registration("no-such-host.invalid:9000", "worker", 60)
    assert time.monotonic() - start < 10


def test_a_worker_that_never_connects_ends_the_servers_naming_it():
    # Both workers register and learn the job, then die before connecting (a
    # crash between the rendezvous and the engine): the servers, which have
    # their job, must not wait for them forever.
    env = scheduler_env(10)  # the rendezvous must fit in it too, on a loaded machine
    address = f"127.0.0.1:{env['DMLC_PS_ROOT_PORT']}"
    procs = [
        start_member("scheduler", env, [PYTHON, "-m", "jbps.scheduler"]),
        start_member("server", env, [PYTHON, "-m", "jbps.server"]),
        start_member("server", env, [PYTHON, "-m", "jbps.server"]),
    ]
    try:
        registrations = [Registration(address, "worker", 30, worker_id=i) for i in range(2)]
        jobs = [r.receive() for r in registrations]
        for r in registrations:
            r.close()
    except BaseException:
        terminate(procs, grace_s=2)
        raise
    t0 = time.monotonic()
    outputs = finish(procs, 60)
    assert time.monotonic() - t0 < 30
    assert outputs[0][0] == 0, outputs[0][2][-2000:]  # the scheduler's part went well
    named = set()
    for code, out, err in outputs[1:]:
        assert code == 0, err[-2000:]
        found = re.search(r"worker rank\(s\) 0, 1 never connected to summation server (\S+) within 10 s", err)
        assert found, err[-2000:]
        named.add(found[1])
    assert named == set(jobs[0]["servers"])
    assert_nothing_left(env)


def test_a_missing_worker_fails_everyone_naming_it():
    env = scheduler_env(3)
    t0 = time.monotonic()
    procs = [
        start_member("scheduler", env, [PYTHON, "-m", "jbps.scheduler"]),
        start_member("server", env, [PYTHON, "-m", "jbps.server"]),
        start_member("server", env, [PYTHON, "-m", "jbps.server"]),
        start_member("worker", env, [PYTHON, worker_script("launch_probe.py")], worker_id=0),
    ]
    outputs = finish(procs, 60)
    assert time.monotonic() - t0 < 30
    for code, out, err in outputs:
        assert code != 0
        assert "1 of 2 workers and 2 of 2 servers registered; missing worker ids [1]" in err, err[-2000:]
    assert_nothing_left(env)


def _stranger(address, hello):
    """Says `hello` to the scheduler at `address` as a stranger would; returns its answer."""
    conn = connect_retrying(address, 30)  # as members reach it
    conn.settimeout(10)
    with conn, conn.makefile("r") as reader:
        assert "challenge" in json.loads(reader.readline())
        conn.sendall((json.dumps(hello) + "\n").encode())
        return json.loads(reader.readline())


def test_only_members_that_prove_the_job_secret_get_in():
    secret = "s3cret-of-this-job-" + uuid.uuid4().hex
    env = scheduler_env(60)
    env["JBPS_JOB_SECRET"] = secret
    address = f"127.0.0.1:{env['DMLC_PS_ROOT_PORT']}"
    scheduler = start_member("scheduler", env, [PYTHON, "-m", "jbps.scheduler"])
    procs = [scheduler]
    try:
        # Strangers come first, each claiming worker 0's place: none gets in, none is told the token.
        hello = {"role": "worker", "worker_id": 0, "challenge": "c"}
        answers = [_stranger(address, hello)]
        # A hello proven on another connection (recorded from the wire) fails this connection's challenge.
        answers.append(_stranger(address, signed(secret, "member", new_challenge(), hello)))
        for answer in answers:
            assert set(answer) == {"error"}, answer
        assert "did not prove the job secret" in answers[0]["error"], answers
        assert "proof of the job secret is wrong" in answers[1]["error"], answers
        # A jbps worker with another secret fails in one line naming it.
        wrong = start_member(
            "worker",
            {**env, "JBPS_JOB_SECRET": "another-secret-0123456789"},
            [PYTHON, "-c", "import jbps; jbps.init()"],
            0,
        )
        code, _, err = finish([wrong], 60)[0]
        assert code != 0 and "proof of the job secret is wrong" in err, err[-3000:]
        # The job itself assembles and sums exactly.
        worker = [PYTHON, worker_script("random_trees.py"), "--rounds", "3", "--mode", "jit"]
        members = [("server", [PYTHON, "-m", "jbps.server"], None)] * 2 + [("worker", worker, i) for i in range(2)]
        procs += [start_member(role, env, argv, worker_id) for role, argv, worker_id in members]
    except BaseException:
        terminate(procs, grace_s=2)
        raise
    outputs = finish(procs, 180)
    for code, out, err in outputs:
        assert code == 0, err[-3000:]
    check_reports(sorted((last_json(out) for _, out, _ in outputs[3:]), key=lambda r: r["rank"]), 2, 3)
    refused = [line for line in outputs[0][2].splitlines() if "refused" in line]
    assert len(refused) == 3 and secret not in outputs[0][2], outputs[0][2][-3000:]
    assert_nothing_left(env)


def test_a_member_with_the_secret_takes_no_job_from_a_scheduler_without_it():
    # Whoever answers at the scheduler's address (another job's scheduler, or
    # an impostor) must prove the secret before a worker believes its servers.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        listener.settimeout(30)

        def impostor():
            conn, _ = listener.accept()
            conn.settimeout(30)
            with conn, conn.makefile("r") as reader:
                conn.sendall(b'{"challenge": "c"}\n')
                reader.readline()
                job = {"servers": ["127.0.0.1:1"], "token": 1, "num_workers": 1, "rank": 0}
                conn.sendall((json.dumps({**job, "local_rank": 0, "local_size": 1}) + "\n").encode())
                reader.readline()  # until the member hangs up

        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        registration = Registration(address, "worker", 20, secret="a-secret-of-sixteen-chars")
        try:
            with pytest.raises(JbpsError, match=f"the jbps scheduler at {address} did not prove the job secret"):
                registration.receive()
        finally:
            registration.close()
        thread.join(timeout=10)


def test_a_short_job_secret_is_named_in_one_line_without_repeating_it():
    env = base_env(JBPS_JOB_SECRET="hunter2")
    proc, out, err = jbps_run(["-n", "2", PYTHON, worker_script("launch_probe.py")], env, timeout=60)
    assert proc.returncode == 2
    assert err.strip().startswith("jbps run: JBPS_JOB_SECRET=(hidden): is 7 characters;"), err
    assert "hunter2" not in err and len(err.strip().splitlines()) == 1, err


def jbps_run(args, env, timeout=180):
    return run([PYTHON, "-m", "jbps.cli", "run", *args], env, timeout=timeout)


def test_jbps_run_job_with_prefixed_output():
    env = base_env()
    proc, out, err = jbps_run(
        [
            "-n",
            "2",
            "--servers",
            "1",
            "--local-devices",
            "2",
            PYTHON,
            worker_script("random_trees.py"),
            "--rounds",
            "3",
        ],
        env,
    )
    assert proc.returncode == 0, err[-3000:]
    check_reports(per_rank_reports(out), 2, 3)
    assert "[worker 0] {" in out and "[worker 1] {" in out and "[server 0] jbps.server listening" in out
    assert "[jbps.scheduler]" not in err and "[jbps.run] scheduler on" not in err, err[-3000:]  # quiet unless -v
    assert_nothing_left(env)


def test_the_launcher_and_its_servers_run_without_loading_jax():
    # A summation server on a spare CPU host, the scheduler and `jbps run` need no jax; importing
    # it cost each of them ~1 s of CPU and ~120 MB (jbps/__init__.py loads it on first use).
    env = base_env(PYTHONPROFILEIMPORTTIME="1")  # every process prints each module it imports
    proc, out, err = jbps_run(
        ["-n", "2", "--servers", "1", PYTHON, worker_script("random_trees.py"), "--rounds", "1"], env
    )
    assert proc.returncode == 0, err[-3000:]
    check_reports(per_rank_reports(out), 2, 1)

    def imported(prefix):  # the modules of the process whose stderr lines start with `prefix`
        lines = [line for line in err.splitlines() if line.startswith(prefix + "import time:")]
        return {line.rsplit("|", 1)[1].strip() for line in lines}

    assert "jax" in imported("[worker 0] ")  # a worker's are seen
    for who in ("", "[server 0] "):  # the launcher (its scheduler a thread of it), the server
        modules = imported(who)
        assert "jbps" in modules and {m for m in modules if m.split(".")[0] in ("jax", "jaxlib")} == set(), who


def test_jbps_run_propagates_a_crash_and_leaves_nothing():
    env = base_env()
    proc, out, err = jbps_run(
        [
            "-n",
            "3",
            "--servers",
            "2",
            "--timeout",
            "30",
            "--verbose",
            PYTHON,
            worker_script("launch_probe.py"),
            "--crash-rank",
            "1",
            "--sleep",
            "5",
        ],
        env,
    )
    assert proc.returncode == 3, err[-3000:]
    assert "worker 1 exited with 3: jbps run is ending the job" in err
    assert err.count("[jbps.scheduler] worker registered") == 3, err[-3000:]  # --verbose tells the rendezvous
    assert_nothing_left(env)


def test_jbps_run_names_the_worker_that_raised_not_the_one_it_ended():
    # Worker 1's own code raises at step 20; worker 0 is healthy. Worker 1's
    # goodbye carries the exception, so the servers end the job naming it,
    # and worker 0 (ended by the job's failure, or by jbps run) is blamed nowhere.
    # Worker 1 lingers before it exits, so worker 0 exits first: jbps run's
    # summary still names worker 1 and its exception (as it does when worker 1
    # exits first).
    env = base_env()
    proc, out, err = jbps_run(
        [
            "-n",
            "2",
            PYTHON,
            worker_script("raise_at_step.py"),
            "--raise-rank",
            "1",
            "--raise-step",
            "20",
            "--linger",
            "5",
        ],
        env,
    )
    assert proc.returncode == 1, err[-3000:]
    cause = (
        "jbps: worker 1 (127.0.0.1:",
        ") left the job: it exited with an uncaught exception: ValueError: a bug in "
        "worker 1's own code at step 20; seen by summation server",
    )
    blamed = [
        line
        for line in err.splitlines()
        if line.startswith("[server") and "jbps: worker" in line and "ended early" not in line
    ]
    assert blamed and all(cause[0] in line and cause[1] in line for line in blamed), err[-3000:]
    assert "jbps: worker 0 " not in err and "was lost" not in err, err[-3000:]
    summary = [line for line in err.splitlines() if line.startswith("[jbps.run]")]
    assert len(summary) == 1, err[-3000:]
    # Worker 0 usually exits first; on a loaded machine worker 1 may still beat it, and
    # worker 0 may then be gone too by the time jbps run looks (nothing left to stop).
    head = (
        "[jbps.run] worker 1 left the job: it exited with an uncaught exception: ValueError: a bug in worker 1's own "
        "code at step 20: jbps run is ending the job"
    )
    assert summary[0].startswith(head + " (worker 0 exited with 1") or summary[0] in (
        head + " (stopping worker 0)",
        head,
    ), summary
    # The cause said once per process that saw it: worker 1's traceback, one line per server,
    # worker 0's traceback, and jbps run's summary.
    said = [line for line in (out + err).splitlines() if "a bug in worker 1's own code at step 20" in line]
    assert len(said) == 5, "\n".join(said)
    assert_nothing_left(env)


def test_a_stalled_workers_timeout_names_it_once_with_its_repeats_collapsed():
    # Worker 1 stops pushing; worker 0 dispatched its last steps back to back behind
    # the stalled psum, so its error usually reaches it through a wrapping per step
    # ("Error dispatching computation: " each time), said once with its count. A
    # dispatch that comes after the timeout (the loaded CI machine, now and then)
    # raises it unwrapped: either way one line, naming the worker. (The hook's
    # collapse alone: test_api.py, test_an_uncaught_errors_traceback_prints_...)
    env = base_env(JBPS_TIMEOUT_S="6")
    proc, out, err = jbps_run(
        ["-n", "2", PYTHON, worker_script("raise_at_step.py"), "--steps", "12", "--raise-step", "3", "--stall"], env
    )
    assert proc.returncode != 0, err[-3000:]
    failure = [line for line in err.splitlines() if line.startswith("[worker 0]") and "jbps: psum timed out" in line]
    assert len(failure) == 1, err[-5000:]
    if "Error dispatching computation" in failure[0]:
        assert re.search(r"Error dispatching computation \(x\d+\): ", failure[0]), failure[0]
    assert "Error dispatching computation: Error dispatching computation" not in err, err[-3000:]
    assert "worker 1 has not pushed tensor" in failure[0], failure[0]
    assert_nothing_left(env)


def test_jbps_run_listens_on_loopback_only_and_ctrl_c_ends_everything():
    env = base_env()
    proc = subprocess.Popen(
        [PYTHON, "-m", "jbps.cli", "run", "-n", "2", PYTHON, worker_script("launch_probe.py"), "--sleep", "120"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd="/",
    )
    try:
        ready = 0
        deadline = time.monotonic() + 120
        while ready < 2 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            ready += line.startswith("[worker") and " ready " in line
        assert ready == 2, "workers never got ready"
        # A local job is reachable from this machine only: scheduler and servers on loopback.
        sockets = {pid: listening(pid) for pid in processes_with(env["JBPS_TEST_MARKER"])}
        assert sum(map(len, sockets.values())) >= 2, sockets  # at least the two servers
        assert all(ip == "127.0.0.1" for found in sockets.values() for ip, _ in found), sockets
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        assert proc.returncode == 128 + signal.SIGINT
        err = proc.stderr.read()
    finally:
        terminate([proc], grace_s=3)
    assert_nothing_left(env)
    # The launcher says it ends the job, and no server blames a worker the launcher ended.
    assert "[jbps.run] SIGINT: jbps run is ending the job" in err, err[-3000:]
    assert "was lost" not in err, err[-3000:]


def test_jbps_run_names_a_bad_environment_variable_in_one_line():
    env = base_env(JBPS_TIMEOUT_S="-1")
    proc, out, err = jbps_run(["-n", "2", PYTHON, worker_script("launch_probe.py")], env, timeout=60)
    assert proc.returncode == 2
    assert err.strip() == "jbps run: JBPS_TIMEOUT_S='-1': must be positive", err  # no --timeout, no usage


@pytest.mark.parametrize(
    "name, value",
    [("JBPS_PARTITION_BYTES", "4X"), ("JBPS_SERVER_ENGINE_THREADS", "x"), ("JBPS_SERVER_ROLE", "gpu")],
)
def test_jbps_run_checks_every_setting_before_starting_the_job(name, value):
    # A setting only servers or workers use is checked by the launcher too:
    # one line from it, not one from every child as it starts.
    env = base_env(**{name: value})
    proc, out, err = jbps_run(["-n", "2", PYTHON, worker_script("launch_probe.py")], env, timeout=60)
    assert proc.returncode != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jbps run: {name}='{value}': "), err
    assert "[server" not in out + err and "[worker" not in out + err, (out, err)
    assert_nothing_left(env)


def test_jbps_run_says_in_one_line_that_the_command_is_not_found():
    env = base_env()
    proc, out, err = jbps_run(["-n", "2", "pythn", "x.py"], env, timeout=60)
    assert proc.returncode == 127
    assert err.strip() == "jbps run: pythn: command not found (not on PATH, or not executable)", err
    assert_nothing_left(env)


def test_jbps_run_names_a_discovery_script_that_prints_a_bad_line_before_starting_anything(tmp_path):
    script = tmp_path / "hosts.sh"
    script.write_text("#!/bin/sh\necho node1:2\necho 'node2:none'\n")
    script.chmod(0o755)
    env = base_env()
    elastic = ["-n", "2", "--min-workers", "1", "--max-workers", "3", "--host-discovery-script", str(script)]
    elastic += ["--scheduler-address", "127.0.0.1"]  # (this machine's own name may resolve to a loopback address)
    proc, out, err = jbps_run([*elastic, PYTHON, worker_script("launch_probe.py")], env, timeout=60)
    assert proc.returncode == 2
    assert err.strip() == f"jbps run: {script} printed 'node2:none': expected HOST or HOST:SLOTS (SLOTS at least 1)", (
        err
    )
    assert_nothing_left(env)
    script.write_text("#!/bin/sh\necho no hosts today >&2\nexit 3\n")
    proc, out, err = jbps_run([*elastic, PYTHON, worker_script("launch_probe.py")], env, timeout=60)
    assert proc.returncode == 2
    assert err.strip() == f"jbps run: host discovery script {script} exited with 3: no hosts today", err
    # Discovery places the workers of an elastic job only; without an address, a loopback one is named.
    proc, out, err = jbps_run(["-n", "2", "--host-discovery-script", str(script), PYTHON, "x.py"], env, timeout=60)
    assert proc.returncode == 2 and "--host-discovery-script needs an elastic job" in err, err
    # A blacklist's cooldown: two numbers, MIN <= MAX, with a discovery script.
    for bad in (["5", "1"], ["-1", "3"], ["1", "inf"], ["nan", "2"]):
        proc, out, err = jbps_run([*elastic, "--blacklist-cooldown-range", *bad, PYTHON, "x.py"], env, timeout=60)
        assert proc.returncode == 2 and err.strip().endswith(
            "--blacklist-cooldown-range needs MIN and MAX seconds with 0 <= MIN <= MAX"
        ), (bad, err)
    proc, out, err = jbps_run(["-n", "2", "--blacklist-cooldown-range", "1", "2", PYTHON, "x.py"], env, timeout=60)
    assert proc.returncode == 2 and "--blacklist-cooldown-range applies to hosts a --host-discovery-script names" in err
    proc, out, err = jbps_run([*elastic[:-2], PYTHON, "x.py"], env, timeout=60)
    named = "which other hosts cannot reach: give --scheduler-address" in err
    assert named == _this_host_address().startswith("127."), err
    assert_nothing_left(env)


def test_communication_share_is_the_jobs_not_a_workers_waits():
    # Worker 1 computes 0.1 s longer per step: worker 0's psums wait for it, so
    # its own busy share is large, worker 1's small. The communication share is
    # worker 1's on both; worker 0's excess is waiting, not communication.
    env = base_env()
    proc, out, err = jbps_run(["-n", "2", PYTHON, worker_script("communication_share.py")], env)
    assert proc.returncode == 0, err[-3000:]
    fast, slow = per_rank_reports(out)
    assert fast["own"] > 0.5 and slow["own"] < fast["own"] / 2, (fast, slow)
    assert fast["communication"] == slow["communication"] == pytest.approx(slow["own"], abs=1e-6), (fast, slow)
    assert fast["waiting"] == pytest.approx(fast["own"] - slow["own"], abs=1e-6) and slow["waiting"] == 0
    assert_nothing_left(env)


def test_two_jobs_at_once_on_one_host():
    envs = [base_env(), base_env()]
    procs = [
        subprocess.Popen(
            [
                PYTHON,
                "-m",
                "jbps.cli",
                "run",
                "-n",
                "2",
                PYTHON,
                worker_script("random_trees.py"),
                "--rounds",
                "4",
                "--seed",
                str(i),
                "--mode",
                "jit",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            cwd="/",
        )
        for i, env in enumerate(envs)
    ]
    outputs = finish(procs, 240)
    digests = []
    for code, out, err in outputs:
        assert code == 0, err[-3000:]
        reports = per_rank_reports(out)
        check_reports(reports, 2, 4)
        digests.append(reports[0]["digest"])
    assert digests[0] != digests[1]  # different seeds: the jobs did not mix
    for env in envs:
        assert_nothing_left(env)


@needs_mpi
def test_mpirun_rank_that_never_joins_aborts_the_job_within_the_timeout():
    env = base_env(JBPS_TIMEOUT_S="3")
    t0 = time.monotonic()
    with MpichSegments(env) as segments:
        proc, out, err = run([MPIEXEC, "-n", "2", PYTHON, worker_script("mpi_absent_rank.py")], env, timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 30
    assert "waited 3 s (JBPS_TIMEOUT_S) for the other ranks to join; rank 1 never did" in out + err, err[-2000:]
    assert_nothing_left(env)
    segments.assert_none_left()  # MPI_Abort skips MPI_Finalize, where MPICH removes its file


@needs_mpi
def test_mpirun_rank_that_ends_before_joining_ends_the_job_naming_it():
    # MPI_Init waits for every rank, holding Python's lock: a rank that ended
    # before MPI started (here: at once; in real life a failed import) used to
    # leave the others spinning in MPI_Init forever.
    env = base_env(JBPS_TIMEOUT_S="5")
    t0 = time.monotonic()
    with MpichSegments(env) as segments:
        proc, out, err = run(
            [
                MPIEXEC,
                "-n",
                "2",
                PYTHON,
                worker_script("launch_probe.py"),
                ":",
                "-n",
                "1",
                PYTHON,
                "-c",
                "raise SystemExit('this rank ends before it joins')",
            ],
            env,
            timeout=90,
        )
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 30
    assert "waited 5 s (JBPS_TIMEOUT_S) for MPI to start in every rank; rank 2 is no longer running" in out + err, err[
        -2000:
    ]
    assert_nothing_left(env)
    segments.assert_none_left()


@needs_mpi
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_mpirun_job_leaves_nothing(sig):
    # Killed ranks never reach MPI_Finalize, where MPICH removes its file; each
    # rank's guard removes it once no process of the job maps it.
    env = base_env(JBPS_TIMEOUT_S="60")
    with MpichSegments(env) as segments:
        proc = subprocess.Popen(
            [MPIEXEC, "-n", "2", PYTHON, worker_script("launch_probe.py"), "--sleep", "120"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            cwd="/",
        )
        try:
            # mpiexec forwards the ranks' output in whatever pieces it reads: look for both
            # ranks' words anywhere in it, not one per line.
            output, deadline = "", time.monotonic() + 120
            while len(set(re.findall(r"ready (\d+)", output))) < 2 and time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                output += line
            assert set(re.findall(r"ready (\d+)", output)) == {"0", "1"}, output[-3000:]
            proc.send_signal(sig)
            proc.wait(timeout=30)
        finally:
            terminate([proc], grace_s=3)
        assert_nothing_left(env)
    segments.assert_none_left()


def test_a_misspelled_setting_is_named_once_with_the_nearest_known_one():
    # jbps run names it before it starts anything; its children do not repeat it.
    env = base_env(JBPS_TIMOUT_S="5", JBPS_PARTITON_BYTES="4M", BYTEPS_LOG_LEVEL="INFO")
    proc, out, err = jbps_run(["-n", "2", PYTHON, worker_script("launch_probe.py")], env)
    assert proc.returncode == 0, err[-3000:]
    said = [line for line in err.splitlines() if "is not a setting jbps reads" in line]
    assert said == [
        "jbps run: BYTEPS_LOG_LEVEL is not a setting jbps reads: it has no effect",
        "jbps run: JBPS_PARTITON_BYTES is not a setting jbps reads: did you mean JBPS_PARTITION_BYTES?",
        "jbps run: JBPS_TIMOUT_S is not a setting jbps reads: did you mean JBPS_TIMEOUT_S?",
    ], err[-3000:]
    assert_nothing_left(env)


def test_a_scheduler_missing_its_worker_count_refuses_the_members_at_once():
    # DMLC_NUM_WORKERS for DMLC_NUM_WORKER: the scheduler cannot run the job, and
    # tells every member that comes why, so they fail at once, not after JBPS_TIMEOUT_S.
    port = str(free_port())
    common = dict(DMLC_NUM_WORKERS="1", DMLC_NUM_SERVER="1", DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=port)
    env = base_env(JBPS_TIMEOUT_S="60", **common)
    scheduler = subprocess.Popen(
        [PYTHON, "-m", "jbps.scheduler"],
        env={**env, "DMLC_ROLE": "scheduler"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        start = time.monotonic()
        proc, out, err = run([PYTHON, "-c", "import jbps; jbps.init()"], {**env, "DMLC_ROLE": "worker"}, timeout=60)
        took = time.monotonic() - start
        assert proc.returncode != 0 and took < 30, (took, err[-3000:])
        assert "jbps scheduler refused this member" in err and "did you mean DMLC_NUM_WORKER?" in err, err[-3000:]
    finally:
        terminate([scheduler], grace_s=3)
    assert "did you mean DMLC_NUM_WORKER?" in scheduler.stderr.read()
    assert_nothing_left(env)
