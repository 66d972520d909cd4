"""A one-node Slurm cluster for the tests: munged, slurmctld and slurmd from the
distribution's packages (slurm-wlm, munge), configured in a directory of its
own (its own munge key and socket, its own ports, state and logs), started by
PID and ended by PID. `unavailable()` says why it cannot run here (not root,
the packages missing), for a skip."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from jbps.procs import terminate
from leftovers import processes_with

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")
NODE = "jbpsnode"


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "a Slurm cluster needs root (slurmd runs tasks as any user)"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CONF = """\
ClusterName=jbpstest
SlurmctldHost={hostname}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/linear
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={node} NodeAddr=127.0.0.1 NodeHostname={hostname} CPUs=8 State=UNKNOWN
PartitionName=jbps Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class SlurmCluster:
    """with SlurmCluster() as slurm: slurm.srun(["-n", "2", ...])."""

    def __init__(self, timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.dir = tempfile.mkdtemp(prefix="jbps-slurm-")
        self.procs: list[subprocess.Popen] = []
        for sub in ("state", "spool"):
            os.makedirs(os.path.join(self.dir, sub))
        self.conf = os.path.join(self.dir, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(
                CONF.format(
                    node=NODE,
                    hostname=socket.gethostname().split(".")[0],
                    dir=self.dir,
                    ctld_port=_free_port(),
                    slurmd_port=_free_port(),
                )
            )
        # The daemons' marker: slurmd's step daemons (slurmstepd) inherit it, and detach from slurmd.
        self.marker = f"slurm-cluster-{os.path.basename(self.dir)}"
        self.env = {**os.environ, "SLURM_CONF": self.conf, "JBPS_TEST_MARKER": self.marker}

    def _start(self, argv: list[str], log: str) -> None:
        out = open(os.path.join(self.dir, log), "w")
        self.procs.append(
            subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        )
        out.close()

    def __enter__(self) -> "SlurmCluster":
        try:
            key = os.path.join(self.dir, "munge.key")
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o600)
            self._start(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={self.dir}/munge.sock",
                    f"--pid-file={self.dir}/munged.pid",
                    f"--log-file={self.dir}/munged.log",
                    f"--seed-file={self.dir}/munged.seed",
                ],
                "munged.out",
            )
            self._wait_for(lambda: os.path.exists(f"{self.dir}/munge.sock"), "munged's socket")
            self._start(["slurmctld", "-D", "-i", "-f", self.conf], "slurmctld.out")
            self._start(["slurmd", "-D", "-N", NODE, "-f", self.conf], "slurmd.out")
            self._wait_for(self._node_idle, f"node {NODE} idle in sinfo")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _node_idle(self) -> bool:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True, timeout=10
        ).stdout
        return out.strip() in ("idle", "mixed", "allocated")

    def _wait_for(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode} before {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} after {self.timeout_s:g} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        text = []
        for name in sorted(os.listdir(self.dir)):
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    text.append(f"--- {name}\n{f.read()[-2000:]}")
        return "\n".join(text)

    def srun(self, args: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
        """srun ARGS in this cluster, with `env` (plus SLURM_CONF); bounded by timeout_s
        (srun's own --time could not end a task blocked in a system call)."""
        proc = subprocess.Popen(
            ["srun", "--kill-on-bad-exit=1", *args],
            env={**env, "SLURM_CONF": self.conf},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            terminate([proc], grace_s=5)
            out, err = proc.communicate()
            raise RuntimeError(f"srun {args} timed out after {timeout_s:g} s:\n{err[-3000:]}\n{self.logs()}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def __exit__(self, *exc) -> None:
        terminate(list(reversed(self.procs)), grace_s=5)
        for pid in processes_with(self.marker):  # a step daemon still waiting on its ended slurmd
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)
