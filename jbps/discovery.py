"""Host discovery for an elastic `jbps run`, as horovodrun's
--host-discovery-script:

    jbps run -n 4 --min-workers 2 --max-workers 8 --host-discovery-script ./hosts.sh python train.py

Every DISCOVERY_S, jbps run runs the script; each line it prints names a host
that can run workers, `HOST` or `HOST:SLOTS` (one slot unless it says more).
Workers go to the hosts in the script's order, up to their slots and
--max-workers. A worker runs on its host through --launcher (default `ssh -o
BatchMode=yes`), called as `LAUNCHER HOST LINE`, as MPICH's hydra calls ssh:
LINE is one shell line that goes to the working directory of jbps run, sets
the job's variables (the scheduler's address, the job secret) and runs the
worker command. A host the script stops naming gets no new workers, and its
workers are ended (the others regroup without them); a new host gets workers
at the next poll, which join at the others' next commit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shlex
import subprocess
import time

from .errors import JbpsError

log = logging.getLogger("jbps.run")

DISCOVERY_S = 2.0  # between two runs of the script
SCRIPT_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclasses.dataclass
class Discovery:
    """An elastic job placed by a script: the script, the launcher, the
    scheduler's address (which the hosts reach), the hosts it named last, and
    the hosts left out for a failed worker (as horovodrun's blacklist: for the
    rest of the job, or with a cooldown range (MIN, MAX) seconds, for MIN after
    a host's first failure, doubling with each further one, at most MAX)."""

    script: str
    launcher: str
    address: str
    hosts: list[Host]
    cooldown: tuple[float, float] | None = None
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
    blacklisted_until: dict[str, float] = dataclasses.field(default_factory=dict)  # host -> monotonic time

    def blacklist(self, host: str, now: float) -> float:
        """Leaves `host` out after a failure of a worker on it; the seconds it stays out (inf: for good)."""
        self.failures[host] = self.failures.get(host, 0) + 1
        if self.cooldown is None:
            seconds = math.inf
        else:
            low, high = self.cooldown
            seconds = min(high, low * 2 ** (self.failures[host] - 1))
        self.blacklisted_until[host] = now + seconds
        return seconds

    def usable(self, now: float) -> list[Host]:
        """The hosts named last that are not left out at `now`."""
        return [h for h in self.hosts if self.blacklisted_until.get(h.name, -math.inf) <= now]


def parse_hosts(text: str, script: str) -> list[Host]:
    """The hosts the script printed (blank lines skipped); a line that is not
    HOST or HOST:SLOTS (SLOTS a positive integer) raises JbpsError naming it."""
    hosts: dict[str, Host] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        name, sep, slots = line.rpartition(":")
        if not sep:
            name, slots = line, "1"
        if not name or any(c.isspace() for c in name) or not slots.isdigit() or int(slots) < 1:
            raise JbpsError(f"{script} printed {line!r}: expected HOST or HOST:SLOTS (SLOTS at least 1)")
        hosts.setdefault(name, Host(name, int(slots)))
    return list(hosts.values())


def _last_line(text: str) -> str:
    """What a failed command said last (its error, usually), or nothing."""
    return (text.strip().splitlines() or [""])[-1]


def discover(script: str) -> list[Host]:
    """Runs the discovery script once: its hosts, or JbpsError (it failed, timed
    out or printed a bad line)."""
    try:
        done = subprocess.run(
            [script], capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise JbpsError(f"host discovery script {script}: {exc}") from None
    if done.returncode != 0:
        raise JbpsError(f"host discovery script {script} exited with {done.returncode}: {_last_line(done.stderr)}")
    return parse_hosts(done.stdout, script)


# The variables a worker on another host is given: the job's (the rest of this
# environment is this machine's, not the host's), and jax's compilation cache
# (each host's own directory of that path: jax makes it).
_PASSED_PREFIXES = ("DMLC_", "JBPS_", "BYTEPS_")
_PASSED = (
    "PYTHONUNBUFFERED",
    "XLA_FLAGS",
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)


def remote_argv(launcher: str, host: str, cwd: str, env: dict[str, str], command: list[str]) -> list[str]:
    """`LAUNCHER HOST LINE`: LINE runs `command` in `cwd` on `host`, with the
    job's variables of `env`."""
    passed = {k: v for k, v in env.items() if k.startswith(_PASSED_PREFIXES) or k in _PASSED}
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(passed.items()))
    line = f"cd {shlex.quote(cwd)} && exec env {assignments} {shlex.join(command)}"
    return [*shlex.split(launcher), host, line]


def remove_on_hosts(launcher: str, hosts: list[str], path: str, timeout_s: float = 10.0) -> None:
    """Removes `path` on each of `hosts` through the launcher, at once; a host
    that does not answer within timeout_s keeps it (a warning says so)."""
    line = f"rm -rf {shlex.quote(path)}"
    procs = []
    for host in hosts:
        try:
            argv = [*shlex.split(launcher), host, line]
            procs.append(
                (
                    host,
                    subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
                )
            )
        except OSError as exc:  # the job is over: say so, and go on with the other hosts
            log.warning("could not remove %s on host %s: %s", path, host, exc)
    deadline = time.monotonic() + timeout_s
    for host, proc in procs:
        try:
            _, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                said = _last_line(err.decode(errors="replace"))[:200]
                log.warning(
                    "could not remove %s on host %s: the launcher exited with %d %s", path, host, proc.returncode, said
                )
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.warning("could not remove %s on host %s: the launcher did not return in %g s", path, host, timeout_s)


def placements(hosts: list[Host], running: dict[str, int], wanted: int) -> list[str]:
    """Hosts for `wanted` more workers: the script's hosts in order, each up to
    its slots less the workers it runs (`running`: workers per host)."""
    out: list[str] = []
    for host in hosts:
        free = host.slots - running.get(host.name, 0)
        while free > 0 and len(out) < wanted:
            out.append(host.name)
            free -= 1
    return out
