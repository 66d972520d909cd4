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


def test_the_launchers_line_runs_the_command_in_the_directory_with_the_jobs_variables_only(tmp_path):
    env = {"DMLC_PS_ROOT_URI": "10.0.0.1", "JBPS_JOB_SECRET": "s e'cret", "HOME": "/here", "XLA_FLAGS": "--a --b"}
    argv = discovery.remote_argv("ssh -o BatchMode=yes", "node1", str(tmp_path), env, ["python", "it's.py"])
    assert argv[:4] == ["ssh", "-o", "BatchMode=yes", "node1"] and len(argv) == 5
    # The line, run by a shell as ssh would on the host: the job's variables, not this machine's HOME.
    line = argv[4].replace("exec env", "exec env -i")
    # (Python sets LC_CTYPE itself in an empty environment.)
    names = "sorted(k for k in os.environ if k != 'LC_CTYPE')"
    printed = f"import os, sys; print(os.getcwd(), {names}, os.environ['JBPS_JOB_SECRET'], sys.argv[1:])"
    line = line.replace(shlex.join(["python", "it's.py"]), shlex.join([sys.executable, "-c", printed, "it's.py"]))
    out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"{tmp_path} ['DMLC_PS_ROOT_URI', 'JBPS_JOB_SECRET', 'XLA_FLAGS'] s e'cret [\"it's.py\"]"
