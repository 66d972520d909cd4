"""The compilation cache jbps gives an elastic job's workers on each host
(jbps/compile_cache.py): shared by the job's workers there, a killed one's
programs found by the worker started again, removed by the last to leave or,
after a kill, by the next worker that comes; a cache of the user's stands, and
a directory someone else could write is not used. Real processes, each with the
test's own temporary directory."""

import json
import os
import select
import signal
import subprocess
import sys

import pytest

from conftest import job_free_env, worker_script
from jbps.procs import terminate

MEMBER = worker_script("job_cache_member.py")
SECRET = "compile-cache-test-secret-0123"


class Member:
    """One worker process of a job: it takes the job's cache and compiles, then leaves or is killed."""

    def __init__(self, tmpdir, scheduler, *flags, **env):
        self.err = tmpdir / f"member-{os.urandom(4).hex()}.err"  # a file: nothing waits on it filling
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, MEMBER, scheduler, SECRET, *flags],
                env=job_free_env(JAX_PLATFORMS="cpu", TMPDIR=str(tmpdir), **env),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self.compiled = self._line()

    def _line(self, timeout=60):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"no line in {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"exited with {self.proc.wait(timeout=10)}: {self.stderr()[-2000:]}"
        return json.loads(line)

    def leave(self):
        self.proc.stdin.write("leave\n")
        self.proc.stdin.flush()
        left = self._line()
        assert self.proc.wait(timeout=30) == 0
        return left

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL

    def stderr(self):
        return self.err.read_text()


@pytest.fixture
def members(tmp_path):
    started = []

    def start(scheduler, *flags, **env):
        started.append(Member(tmp_path, scheduler, *flags, **env))
        return started[-1]

    yield start
    terminate([m.proc for m in started if m.proc.poll() is None], grace_s=2.0, what="test")


def job_dirs(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("jbps-job-cache-"))


def test_a_jobs_workers_on_a_host_share_its_cache_and_the_last_to_leave_removes_it(tmp_path, members):
    # The first compiles before it takes the cache, as a model's initialisation may: jax looks again.
    first = members("127.0.0.1:7001", "--compile-first")
    second = members("127.0.0.1:7001")
    assert first.compiled["used"] and first.compiled["dir"] == second.compiled["dir"], (first.compiled, second.compiled)
    assert os.path.dirname(first.compiled["dir"]) == str(tmp_path)
    # The second's step came from what the first compiled: jax's persistent cache gave it.
    assert first.compiled["hits"] == 0 and second.compiled["hits"] > 0, (first.compiled, second.compiled)
    assert first.leave() == {"removed": False, "dir_after": None}
    assert job_dirs(tmp_path) == [os.path.basename(first.compiled["dir"])]
    assert second.leave() == {"removed": True, "dir_after": None}
    assert job_dirs(tmp_path) == []


def test_a_killed_workers_programs_serve_its_restart_and_its_jobs_cache_goes_with_the_next_worker_of_another_job(
    tmp_path, members
):
    killed = members("127.0.0.1:7002")
    killed.kill()
    (kept,) = job_dirs(tmp_path)
    restarted = members("127.0.0.1:7002")  # the same job: its dead worker's programs stay
    assert restarted.compiled["hits"] > 0 and job_dirs(tmp_path) == [kept], restarted.compiled
    restarted.kill()
    other = members("127.0.0.1:7003")  # another job: the first's workers on this host are all gone
    assert job_dirs(tmp_path) == [os.path.basename(other.compiled["dir"])] != [kept]
    assert other.compiled["hits"] == 0
    assert other.leave()["removed"] and job_dirs(tmp_path) == []


def test_a_cache_directory_of_the_users_own_stands(tmp_path, members):
    own = tmp_path / "own-cache"
    member = members("127.0.0.1:7004", JAX_COMPILATION_CACHE_DIR=str(own))
    assert member.compiled["dir"] == str(own) and not member.compiled["used"], member.compiled
    assert job_dirs(tmp_path) == []  # and jax's thresholds stay the user's: nothing jbps sets
    assert member.leave() == {"removed": False, "dir_after": str(own)}


def test_a_job_directory_others_could_write_is_named_and_not_used_and_the_step_still_runs(tmp_path, members):
    from jbps.compile_cache import job_directory

    taken = tmp_path / job_directory("127.0.0.1:7005", SECRET).name  # made first by someone else, open to all
    taken.mkdir()
    taken.chmod(0o777)
    member = members("127.0.0.1:7005")
    assert member.compiled == {"dir": None, "used": False, "hits": 0}
    member.leave()
    (line,) = [line for line in member.stderr().splitlines() if "jbps" in line]
    assert f"{taken} is not a private directory of this user: no compilation cache" in line, line
    assert sorted(os.listdir(taken)) == []
