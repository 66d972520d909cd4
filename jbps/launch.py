"""`jbps run`: a whole job on this machine from one command.

    jbps run -n 2 [--servers 2] [--local-devices 4] python train.py args...
    jbps run -n 3 --min-workers 2 --max-workers 4 python train.py   # elastic (jbps.elastic.run)

Starts a scheduler (on a thread of this process, on a free loopback port),
the summation servers and the workers, with the DMLC_* variables of the
environment bootstrap and a job secret of its own (JBPS_JOB_SECRET, unless
set: only its children get in), so `jbps.init()` in train.py needs no setting. Every
line a child prints is prefixed with its role and rank. Ctrl-C (SIGINT) or
SIGTERM ends every child. The first child to fail ends the others, and its
exit code becomes ours; when every worker succeeds, the servers end on their
own and we exit 0. Children are ended by PID with everything they spawned
(jbps.procs), so nothing is left behind.

An elastic job (--min-workers, --max-workers) runs jbps/scheduler/elastic.py's
scheduler and no server processes (each worker runs its own server): a worker
that fails is started again (at most --max-restarts times in all) and joins
the others at their next commit, while they go on without it. With
--host-discovery-script its workers go to the hosts a script names, through an
ssh-like --launcher, and a host where a worker failed is blacklisted
(jbps/discovery.py). Its workers share a persistent compilation cache of jax's
for the job, one directory per host (unless the environment names one): each generation
traces its step afresh, and a worker started again loads the programs the
others compiled instead of compiling them while they wait.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from . import discovery as discovery_
from . import unknown_settings
from .compile_cache import COMPILE_EVERY_PROGRAM
from .config import Config, argparse_type, exit_for_environment
from .errors import JbpsError
from .procs import signal_group, terminate
from .scheduler.admission import new_secret
from .scheduler.elastic import ElasticScheduler
from .scheduler.rendezvous import Scheduler
from .server.settings import settings_from_environment as server_settings_from_environment

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
log = logging.getLogger("jbps.run")

# Variables of other bootstraps that would override the scheduler's answer.
_CLEARED = (
    "JBPS_SERVERS",
    "JBPS_NUM_WORKERS",
    "JBPS_WORKER_RANK",
    "JBPS_LOCAL_RANK",
    "JBPS_LOCAL_SIZE",
    "JBPS_SCHEDULER_HOST",
    "JBPS_SCHEDULER_PORT",
    "JBPS_NUM_SERVERS",
    "JBPS_ROLE",
    "DMLC_WORKER_ID",
)
# Set by _env for every child, whatever the environment says.
_SET = ("DMLC_ROLE", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT")


def _inherited() -> dict:
    """The environment every child starts from, before _env adds its own."""
    return {k: v for k, v in os.environ.items() if k not in _CLEARED}


def _environment_config(timeout_s: float | None) -> Config:
    """The settings the children will read from the environment we pass on,
    checked once here: a bad one is named in one line before anything starts,
    not by every server and worker as it starts. `timeout_s` (--timeout), when
    given, stands in for JBPS_TIMEOUT_S, as _env passes it on."""
    environ = {k: v for k, v in _inherited().items() if k not in _SET}
    server_settings_from_environment(environ)
    return Config.resolve({"timeout_s": timeout_s}, environ)


# What a server says of the worker that ended the job: its own uncaught
# exception (its goodbye carries it), or its loss. The first such line names
# the cause, whichever worker exits first (the others fail on its account).
_CAUSE = re.compile(
    rb"jbps: (worker \d+) \([^)]*\) (left the job: it exited with an uncaught exception: .*?|was lost: .*?); seen by"
)


class _Output:
    """Copies a child's output to ours line by line, each line prefixed, and
    keeps the first line that names the worker that ended the job (causes)."""

    lock = threading.Lock()

    def __init__(self, pipe, sink, prefix: str, causes: list):
        self.thread = threading.Thread(target=self._pump, args=(pipe, sink, prefix.encode(), causes), daemon=True)
        self.thread.start()

    @classmethod
    def _pump(cls, pipe, sink, prefix: bytes, causes: list) -> None:
        with pipe:
            for line in iter(pipe.readline, b""):
                with cls.lock:
                    sink.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                    sink.flush()
                    if not causes and (found := _CAUSE.search(line)):
                        causes.append((found.group(1).decode(), found.group(2).decode(errors="replace")))


class Job:
    def __init__(
        self,
        command: list[str],
        workers: int,
        servers: int,
        local_devices: int | None,
        timeout_s: float,
        secret: str,
        elastic: tuple[int, int, int] | None = None,
        discovery: discovery_.Discovery | None = None,
    ):
        self.command, self.workers, self.servers = command, workers, servers
        self.elastic = elastic  # (min workers, max workers, restarts allowed), or None
        self.discovery = discovery  # an elastic job whose hosts a script names
        self.placed: dict[str, str] = {}  # worker -> its host, with discovery
        self.removed: set[str] = set()  # workers ended because their host went away
        self.next_worker_id = 0 if discovery else workers  # the next worker started (DMLC_WORKER_ID)
        self.local_devices, self.timeout_s, self.secret = local_devices, timeout_s, secret
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.outputs: list[_Output] = []
        self.causes: list[tuple[str, str]] = []  # (worker, what happened to it): the first a server named
        self.scheduler_error: str | None = None
        self.scheduler_done = False  # its job finished (an elastic scheduler returns then)
        self.stop_signal: int | None = None  # the signal that ends the job, if one does
        self.ending = False
        self.compile_cache: str | None = None  # the elastic job's (made by run), on each host with discovery
        self.cache_hosts: set[str] = set()  # the hosts a worker of the job ran on, with discovery

    def _env(self, scheduler: Scheduler, role: str, extra: dict) -> dict:
        env = _inherited()
        host, _, port = scheduler.address.rpartition(":")
        env.update(
            DMLC_ROLE=role,
            DMLC_NUM_WORKER=str(self.workers),
            DMLC_NUM_SERVER=str(self.servers),
            DMLC_PS_ROOT_URI=host,
            DMLC_PS_ROOT_PORT=port,
            JBPS_TIMEOUT_S=str(self.timeout_s),
            JBPS_JOB_SECRET=self.secret,
            PYTHONUNBUFFERED="1",
            **{unknown_settings.CHECKED: "1"},  # named once, here, not by every child
            **extra,
        )
        if self.compile_cache and role == "worker":
            env["JAX_COMPILATION_CACHE_DIR"] = self.compile_cache
            for name, value in COMPILE_EVERY_PROGRAM.items():
                env.setdefault(name, value)  # the user's own thresholds stand
        if self.local_devices:
            flags = env.get("XLA_FLAGS", "")
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={self.local_devices}".strip()
        return env

    def _spawn(self, name: str, argv: list[str], env: dict, cwd: str | None = None) -> None:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.children.append((name, proc))
        self.outputs.append(_Output(proc.stdout, sys.stdout.buffer, f"[{name}] ", self.causes))
        self.outputs.append(_Output(proc.stderr, sys.stderr.buffer, f"[{name}] ", self.causes))

    def _rendezvous(self, scheduler: Scheduler) -> None:
        try:
            scheduler.run()
            self.scheduler_done = True
        except JbpsError as exc:
            self.scheduler_error = str(exc)  # every member was told, and fails with it
        finally:
            scheduler.close()

    def _spawn_worker(self, rank: int, scheduler: Scheduler, host: str | None = None) -> None:
        name, env = f"worker {rank}", self._env(scheduler, "worker", {"DMLC_WORKER_ID": str(rank)})
        if host is None:
            self._spawn(name, self.command, env)
            return
        assert self.discovery is not None
        self._spawn(name, discovery_.remote_argv(self.discovery.launcher, host, os.getcwd(), env, self.command), env)
        self.placed[name] = host
        self.cache_hosts.add(host)
        log.info("%s on host %s", name, host)

    def _discover(self) -> bool:
        """Runs the discovery script; False (and a warning) if it failed: the
        hosts it named last stand."""
        assert self.discovery is not None
        try:
            self.discovery.hosts = discovery_.discover(self.discovery.script)
            return True
        except JbpsError as exc:
            log.warning("%s; keeping the hosts it named last", exc)
            return False

    def _place(self, wanted: int) -> list[tuple[str, subprocess.Popen]]:
        """Starts up to `wanted` workers on the hosts' free slots; their names and processes."""
        assert self.discovery is not None
        running: dict[str, int] = {}
        for name, proc in self.children:
            if name in self.placed and proc.poll() is None:
                running[self.placed[name]] = running.get(self.placed[name], 0) + 1
        started = []
        for host in discovery_.placements(self.discovery.usable(time.monotonic()), running, wanted):
            self._spawn_worker(self.next_worker_id, self.scheduler, host)
            self.next_worker_id += 1
            started.append(self.children[-1])
        return started

    def _follow_hosts(self) -> list[tuple[str, subprocess.Popen]]:
        """One poll of the discovery script: ends the workers of hosts it no
        longer names, starts workers on free slots up to --max-workers (as _place)."""
        if not self._discover():
            return []
        assert self.discovery is not None
        named = {h.name for h in self.discovery.hosts}
        for name, proc in self.children:
            if name in self.placed and self.placed[name] not in named and proc.poll() is None:
                log.warning(
                    "host %s is no longer named by %s: ending %s", self.placed[name], self.discovery.script, name
                )
                self.removed.add(name)
                signal_group(proc, signal.SIGTERM)
        assert self.elastic is not None
        running = sum(1 for name, proc in self.children if name.startswith("worker") and proc.poll() is None)
        return self._place(self.elastic[1] - running)

    def run(self) -> int:
        scheduler: Scheduler
        if self.elastic:
            scheduler = ElasticScheduler(
                self.workers,
                self.elastic[0],
                self.elastic[1],
                bind=f"{self.discovery.address}:0" if self.discovery else "127.0.0.1:0",
                timeout_s=self.timeout_s,
                secret=self.secret,
            )
        else:
            scheduler = Scheduler(
                self.workers, self.servers, bind="127.0.0.1:0", timeout_s=self.timeout_s, secret=self.secret
            )
        self.scheduler = scheduler
        log.info(
            "scheduler on %s; %s: %s",
            scheduler.address,
            f"{self.workers} workers (elastic: {self.elastic[0]} to {self.elastic[1]})"
            if self.elastic
            else f"{self.servers} servers, {self.workers} workers",
            " ".join(self.command),
        )
        threading.Thread(target=self._rendezvous, args=(scheduler,), daemon=True).start()
        try:
            if self.elastic and "JAX_COMPILATION_CACHE_DIR" not in _inherited():
                # On the hosts a discovery script names: a path of the job's in each host's /tmp
                # (jax makes the directory), removed through the launcher at the end.
                self.compile_cache = (
                    f"/tmp/jbps-compile-cache-{secrets.token_hex(8)}"
                    if self.discovery
                    else tempfile.mkdtemp(prefix="jbps-compile-cache-")
                )
            for i in range(0 if self.elastic else self.servers):  # elastic: each worker runs its own
                # `-m` puts the working directory first on sys.path: from a source
                # checkout that would be the checkout's package. Servers run from the
                # folder holding the jbps this launcher imported, so they get the same.
                self._spawn(
                    f"server {i}",
                    [sys.executable, "-m", "jbps.server"],
                    self._env(scheduler, "server", {}),
                    cwd=_PACKAGE_PARENT,
                )
            if self.discovery:
                if not self._place(self.workers):
                    log.error("%s named no host with a free slot: no worker to start", self.discovery.script)
                    return 2
            else:
                for rank in range(self.workers):
                    self._spawn_worker(rank, scheduler)
            return self._wait()
        except OSError as exc:  # the command cannot be started (main checks it is there; it may still not run)
            log.error("cannot start %s: %s", " ".join(self.command), exc)
            return 126
        except KeyboardInterrupt:  # SIGINT or SIGTERM (main): said before the ending, so the log reads in order
            signum = self.stop_signal or signal.SIGINT
            others = [n for n, p in self.children if p.poll() is None]
            log.error(
                "%s: jbps run is ending the job%s",
                signal.Signals(signum).name,
                f" (stopping {', '.join(others)})" if others else "",
            )
            return 128 + signum
        finally:
            self.ending = True
            self._end()
            for out in self.outputs:
                out.thread.join(timeout=5)
            if self.compile_cache and self.discovery:
                discovery_.remove_on_hosts(self.discovery.launcher, sorted(self.cache_hosts), self.compile_cache)
            elif self.compile_cache:
                shutil.rmtree(self.compile_cache, ignore_errors=True)

    def _wait(self) -> int:
        """Waits for the job; returns its exit code: the first child to fail
        ends it (each child is waited on by a thread of its own, so the first
        is known exactly), and its code becomes ours."""
        exits: queue.Queue = queue.Queue()

        def watch(name: str, proc: subprocess.Popen) -> None:
            threading.Thread(target=lambda: exits.put((name, proc.wait())), daemon=True).start()

        for name, proc in self.children:
            watch(name, proc)
        workers = {name for name, _ in self.children if name.startswith("worker")}
        succeeded: set[str] = set()
        servers_done_by = None
        restarts = self.elastic[2] if self.elastic else 0
        restarted: set[str] = set()
        next_poll = time.monotonic() + discovery_.DISCOVERY_S
        while True:
            try:
                name, code = exits.get(timeout=0.2)
            except queue.Empty:
                if self.discovery and not self.scheduler_done and time.monotonic() > next_poll:
                    for new, proc in self._follow_hosts():
                        watch(new, proc)
                        restarted.add(new)  # joins a running job: nothing to wait for once it is over
                    next_poll = time.monotonic() + discovery_.DISCOVERY_S
                running = {n for n, p in self.children if p.poll() is None}
                if self.elastic and self.scheduler_done and servers_done_by is None and running <= restarted:
                    # The job is over: a worker started again and still on its way has nothing to join
                    # (the others, still running their own code after training, are waited for).
                    servers_done_by = time.monotonic() + 10
                if servers_done_by is not None and time.monotonic() > servers_done_by:
                    return 0
                continue
            if name in self.removed:
                # Its host went away: the others regroup without it, as after a loss.
                self.removed.discard(name)
                self.placed.pop(name, None)
                self.children = [(n, p) for n, p in self.children if n != name]
                continue
            if code != 0 and self.elastic and self.scheduler_done:
                # A worker started again too late to join: the job it would have joined is over.
                log.warning("%s exited with %d after the elastic job was over", name, code)
                code = 0
            if code != 0 and restarts > 0 and self.scheduler_error is None and len(succeeded) == 0:
                # Elastic: the others go on without it, and it joins them again at their next commit.
                restarts -= 1
                log.warning(
                    "%s exited with %d: starting it again (%d restart%s left)",
                    name,
                    code,
                    restarts,
                    "" if restarts == 1 else "s",
                )
                self.children = [(n, p) for n, p in self.children if n != name]
                if self.discovery:
                    # On a host with a free slot; not its own, which is left out (for a while,
                    # with --blacklist-cooldown-range), as horovodrun's blacklist does.
                    host = self.placed.pop(name)
                    seconds = self.discovery.blacklist(host, time.monotonic())
                    log.warning(
                        "host %s is blacklisted %s: %s failed on it",
                        host,
                        "for the rest of the job" if seconds == float("inf") else f"for {seconds:g} s",
                        name,
                    )
                    again = self._place(1)
                    if not again:
                        log.warning("no host the discovery script names has a free slot for %s's restart", name)
                    for new, proc in again:
                        restarted.add(new)
                        watch(new, proc)
                    continue
                restarted.add(name)
                self._spawn_worker(int(name.split()[1]), self.scheduler)
                watch(name, self.children[-1][1])
                continue
            if code != 0:
                # The servers' word on who started it may still be on its way: a moment for it.
                settle = time.monotonic() + 1.0
                while not self.causes and time.monotonic() < settle:
                    time.sleep(0.02)
                others = [n for n, p in self.children if n != name and p.poll() is None]
                stopping = f"stopping {', '.join(others)}" if others else ""
                cause = self.causes[0] if self.causes else None
                if cause and cause[0] != name:  # another worker's failure ended this one
                    why, ending = (
                        f"{cause[0]} {cause[1]}",
                        f"{name} exited with {code}" + (f", {stopping}" if others else ""),
                    )
                elif cause and cause[1].startswith("left the job"):
                    # The worker whose own exception started it exited first: that exception, not its code.
                    why, ending = f"{name} {cause[1]}", stopping
                else:
                    why, ending = f"{name} exited with {code}", stopping
                log.error("%s: jbps run is ending the job%s", why, f" ({ending})" if ending else "")
                return code if code > 0 else 128 - code  # killed by a signal: 128 + its number
            succeeded.add(name)
            if len(succeeded) == len(self.children):
                return 0
            if workers <= succeeded and servers_done_by is None:
                # Servers exit once every worker said goodbye; give them a moment.
                servers_done_by = time.monotonic() + 10

    def _end(self) -> None:
        """Ends what is still running. A worker killed first would close its
        connections without a goodbye, and its servers would report it lost,
        blaming a worker that did nothing wrong: workers are frozen (SIGSTOP),
        the servers stopped while nothing moves, then the workers ended."""
        workers = [p for name, p in self.children if name.startswith("worker") and p.poll() is None]
        servers = [p for name, p in self.children if name.startswith("server") and p.poll() is None]
        for p in workers:
            signal_group(p, signal.SIGSTOP)
        terminate(servers, grace_s=2.0, what="jbps run")
        for p in workers:
            signal_group(p, signal.SIGTERM)  # delivered as soon as it runs again
            signal_group(p, signal.SIGCONT)
        terminate(workers, grace_s=2.0, what="jbps run")


def _this_host_address() -> str:
    """The address this machine's host name resolves to (what other hosts reach)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    prog = prog or "python -m jbps.launch"
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--workers", type=int, required=True, help="worker processes")
    p.add_argument("--servers", type=int, default=None, help="summation server processes (default: as many as workers)")
    p.add_argument(
        "--local-devices",
        type=int,
        default=None,
        help="CPU devices per worker (sets --xla_force_host_platform_device_count); with jax < 0.12, wait for a "
        "step's result every few steps, or loops of steps can deadlock in XLA (docs/guide/loops.md; worker 0 warns)",
    )
    p.add_argument(
        "--timeout",
        type=argparse_type("timeout_s"),
        default=None,
        help="seconds for the job to assemble, and for each psum (default: JBPS_TIMEOUT_S, else 60)",
    )
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="say how the job assembles: the scheduler's address, each member registering",
    )
    p.add_argument(
        "--min-workers",
        type=int,
        default=None,
        help="an elastic job (jbps.elastic.run): the fewest workers it goes on with (with --max-workers)",
    )
    p.add_argument("--max-workers", type=int, default=None, help="an elastic job: the most workers it takes in")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="an elastic job: how many times in all a failed worker is started again (default 3)",
    )
    p.add_argument(
        "--host-discovery-script",
        default=None,
        help="an elastic job across hosts: a script printing one HOST or HOST:SLOTS per line, run every "
        f"{discovery_.DISCOVERY_S:g} s; workers start on its hosts' free slots through --launcher",
    )
    p.add_argument(
        "--launcher",
        default="ssh -o BatchMode=yes",
        help="with --host-discovery-script: run as `LAUNCHER HOST LINE` to start a worker on HOST, LINE a shell "
        "line (default: ssh -o BatchMode=yes)",
    )
    p.add_argument(
        "--blacklist-cooldown-range",
        nargs=2,
        type=float,
        metavar=("MIN", "MAX"),
        default=None,
        help="with --host-discovery-script: a host where a worker failed takes workers again after MIN seconds, "
        "doubling with each failure there up to MAX (default: never again, as horovodrun)",
    )
    p.add_argument(
        "--scheduler-address",
        default=None,
        help="with --host-discovery-script: this machine's address that the hosts reach (default: its host name's)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the worker command, e.g. python train.py")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="[%(name)s] %(message)s")
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        p.error("give the command each worker runs, e.g. `jbps run -n 2 python train.py`")
    servers = args.servers if args.servers is not None else args.workers
    if args.workers < 1 or servers < 1 or (args.local_devices is not None and args.local_devices < 1):
        p.error("--workers, --servers and --local-devices must be at least 1")
    elastic = None
    if args.min_workers is not None or args.max_workers is not None:
        if args.min_workers is None or args.max_workers is None:
            p.error("an elastic job needs both --min-workers and --max-workers")
        if not 1 <= args.min_workers <= args.workers <= args.max_workers:
            p.error("an elastic job needs 1 <= --min-workers <= --workers <= --max-workers")
        if args.servers is not None:
            p.error("an elastic job runs a summation server in each worker: --servers does not apply")
        if args.max_restarts < 0:
            p.error("--max-restarts must be at least 0")
        elastic = (args.min_workers, args.max_workers, args.max_restarts)
    discovery = None
    if args.blacklist_cooldown_range is not None and args.host_discovery_script is None:
        p.error("--blacklist-cooldown-range applies to hosts a --host-discovery-script names")
    if args.host_discovery_script is not None:
        if elastic is None:
            p.error("--host-discovery-script needs an elastic job (--min-workers and --max-workers)")
        if not shlex.split(args.launcher):
            p.error("--launcher must name a command")
        cooldown = args.blacklist_cooldown_range
        if cooldown is not None and not 0 <= cooldown[0] <= cooldown[1] < float("inf"):
            p.error("--blacklist-cooldown-range needs MIN and MAX seconds with 0 <= MIN <= MAX")
        address = args.scheduler_address or _this_host_address()
        if args.scheduler_address is None and address.startswith("127."):
            print(
                f"{prog}: warning: this machine's host name resolves to {address}, which other hosts cannot "
                "reach: give --scheduler-address",
                file=sys.stderr,
                flush=True,
            )
        try:
            # A bad script is named before anything starts.
            hosts = discovery_.discover(args.host_discovery_script)
            discovery = discovery_.Discovery(
                args.host_discovery_script,
                args.launcher,
                address,
                hosts,
                (cooldown[0], cooldown[1]) if cooldown is not None else None,
            )
        except JbpsError as exc:
            print(f"{prog}: {exc}", file=sys.stderr, flush=True)
            return 2
    try:
        config = _environment_config(args.timeout)
    except JbpsError as exc:
        exit_for_environment(prog, exc)
    for line in unknown_settings.messages({k: v for k, v in _inherited().items() if k not in _SET}):
        print(f"{prog}: {line.removeprefix('jbps: ')}", file=sys.stderr, flush=True)
    if shutil.which(args.command[0]) is None:
        print(f"{prog}: {args.command[0]}: command not found (not on PATH, or not executable)", file=sys.stderr)
        return 127  # as a shell says of a command it cannot find

    # The job's own secret unless the environment gives one: only its children get in.
    secret = config.job_secret or new_secret()
    job = Job(args.command, args.workers, servers, args.local_devices, config.timeout_s, secret, elastic, discovery)

    def on_signal(signum, _frame):
        if not job.ending:  # a second Ctrl-C must not cut the ending short
            job.stop_signal = signum
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    return job.run()


if __name__ == "__main__":
    sys.exit(main())
