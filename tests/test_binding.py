"""Servers listen where they are told, on loopback by default, and on every
interface only when asked (0.0.0.0); an address without a host is refused."""

import re
import subprocess
import sys

import pytest

from conftest import job_free_env
from leftovers import listening
from jbps.procs import terminate


def start_server(*args):
    return subprocess.Popen(
        [sys.executable, "-m", "jbps.server", "--num-workers", "1", *args],
        env=job_free_env(),
        cwd="/",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def listening_address(proc):
    line = proc.stdout.readline()
    match = re.search(r"listening on (\S+):(\d+)", line)
    assert match, line + proc.stderr.read()
    return match.group(1), int(match.group(2))


@pytest.mark.parametrize("args,ip", [((), "127.0.0.1"), (("--bind", "0.0.0.0:0"), "0.0.0.0")])
def test_server_listens_on_loopback_unless_told_otherwise(args, ip):
    proc = start_server(*args)
    try:
        host, port = listening_address(proc)
        assert host == ip
        assert listening(proc.pid) == [(ip, port)]
    finally:
        terminate([proc], grace_s=3)


def test_an_address_without_a_host_is_refused_not_taken_as_every_interface():
    proc = start_server("--bind", ":0")
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        terminate([proc])
    assert proc.returncode == 1
    assert "no host" in err and "0.0.0.0" in err, err
