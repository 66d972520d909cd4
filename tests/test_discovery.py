"""Host discovery's pieces (jbps/discovery.py): the script's lines, where
workers go, and the line a launcher runs on a host. jbps run with a script
across emulated hosts: tests/test_multihost.py; its bad input: test_launch.py."""

import shlex
import subprocess
import sys

import pytest

from jbps import discovery
from jbps.errors import JbpsError


def test_the_scripts_lines_are_hosts_with_one_slot_unless_they_say_more():
    hosts = discovery.parse_hosts("node1\n\n  node2:4 \nnode1:3\n10.0.0.7:2\n", "hosts.sh")
    assert hosts == [discovery.Host("node1", 1), discovery.Host("node2", 4), discovery.Host("10.0.0.7", 2)]


@pytest.mark.parametrize("line", ["node:0", "node:x", ":2", "two words", "node:-1"])
def test_a_bad_line_is_named_with_the_script(line):
    with pytest.raises(JbpsError) as e:
        discovery.parse_hosts(f"good\n{line}\n", "hosts.sh")
    assert str(e.value) == f"hosts.sh printed {line!r}: expected HOST or HOST:SLOTS (SLOTS at least 1)"


def test_workers_go_to_the_free_slots_in_the_scripts_order():
    hosts = [discovery.Host("a", 2), discovery.Host("b", 1), discovery.Host("c", 3)]
    assert discovery.placements(hosts, {}, 4) == ["a", "a", "b", "c"]
    assert discovery.placements(hosts, {"a": 2, "c": 1}, 5) == ["b", "c", "c"]
    assert discovery.placements(hosts, {"a": 1}, 0) == []


def test_a_host_where_a_worker_failed_is_left_out_for_good_or_for_a_cooldown_that_doubles():
    hosts = [discovery.Host("a", 1), discovery.Host("b", 2)]
    for_good = discovery.Discovery("hosts.sh", "ssh", "10.0.0.1", hosts)
    assert for_good.blacklist("a", 100.0) == float("inf")
    assert for_good.usable(1e9) == [hosts[1]]
    assert discovery.placements(for_good.usable(1e9), {"b": 1}, 3) == ["b"]  # a's slot is not used again
    # horovodrun's --blacklist-cooldown-range: MIN after the first failure, doubling, at most MAX.
    timed = discovery.Discovery("hosts.sh", "ssh", "10.0.0.1", hosts, cooldown=(10.0, 25.0))
    assert [timed.blacklist("a", t) for t in (0.0, 100.0, 200.0)] == [10.0, 20.0, 25.0]
    assert timed.usable(224.9) == [hosts[1]] and timed.usable(225.0) == hosts
    assert timed.blacklist("b", 300.0) == 10.0 and timed.usable(305.0) == [hosts[0]]


def test_the_launchers_line_runs_the_command_in_the_directory_with_the_jobs_variables_only(tmp_path):
    env = {"DMLC_PS_ROOT_URI": "10.0.0.1", "JBPS_JOB_SECRET": "s e'cret", "HOME": "/here", "XLA_FLAGS": "--a --b"}
    env["JAX_COMPILATION_CACHE_DIR"] = "/tmp/jbps-compile-cache-1"  # an elastic job's, on every host
    env["JAX_PLATFORMS"] = "cpu"  # this machine's own choice: not carried
    argv = discovery.remote_argv("ssh -o BatchMode=yes", "node1", str(tmp_path), env, ["python", "it's.py"])
    assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "node1"] and len(argv) == 5
    # The line, run by a shell as ssh would on the host: the job's variables, not this machine's HOME.
    line = argv[4].replace("exec env", "exec env -i")
    # (Python sets LC_CTYPE itself in an empty environment.)
    names = "sorted(k for k in os.environ if k != 'LC_CTYPE')"
    printed = f"import os, sys; print(os.getcwd(), {names}, os.environ['JBPS_JOB_SECRET'], sys.argv[1:])"
    line = line.replace(shlex.join(["python", "it's.py"]), shlex.join([sys.executable, "-c", printed, "it's.py"]))
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout
    carried = "['DMLC_PS_ROOT_URI', 'JAX_COMPILATION_CACHE_DIR', 'JBPS_JOB_SECRET', 'XLA_FLAGS']"
    assert out.strip() == f"{tmp_path} {carried} s e'cret [\"it's.py\"]"


def test_the_jobs_cache_is_removed_through_the_launcher_and_a_host_that_keeps_it_is_named(tmp_path, caplog):
    # A launcher as ssh is one: `LAUNCHER HOST LINE` runs LINE (here on this machine, for any host but
    # "down", which fails as an unreachable host does, and "slow", which never answers).
    launcher = tmp_path / "launcher"
    launcher.write_text(
        '#!/bin/sh\ncase "$1" in down) echo "ssh: connect to host down: No route" >&2; exit 255;; '
        'slow) exec sleep 30;; esac\nexec sh -c "$2"\n'
    )
    launcher.chmod(0o755)
    cache = tmp_path / "jbps-compile-cache-x"
    (cache / "entries").mkdir(parents=True)
    with caplog.at_level("WARNING", logger="jbps.run"):
        discovery.remove_on_hosts(str(launcher), ["node1", "down", "slow"], str(cache), timeout_s=2.0)
    assert not cache.exists()
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"could not remove {cache} on host down: the launcher exited with 255 ssh: connect to host down: No route",
        f"could not remove {cache} on host slow: the launcher did not return in 2 s",
    ], said
