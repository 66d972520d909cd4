"""A helper process that guards one mpirun rank of a jbps job.

    python -I -S mpi_guard.py --pid PID --rank R --size N --local-size L --rank-variable PMI_RANK

jbps.init() under mpirun starts it before MPI starts, because MPI_Init waits
for every rank of the job while holding Python's lock: a rank that died before
it (a failed import, a typo in the script) leaves the others in MPI_Init
forever, and no thread of theirs can run. This process can: it reads commands
from its stdin, one per line,

    wait SECONDS PHASE   end the job unless another command comes within SECONDS
                         (PHASE "mpi": MPI is starting; "join": the ranks exchange roles)
    done                 the rank has joined: nothing to end

and when a wait runs out it says which ranks are missing and kills the rank,
which makes mpiexec end the whole job. It lives as long as the rank (its stdin
closes when the rank exits), and then removes the shared-memory files MPICH
made for this job (/dev/shm/mpich_shm_*) that the rank had mapped and no
process maps any more: MPICH removes them in MPI_Finalize, which an aborted or
killed job never reaches.

Only the standard library, and it is run isolated (-I -S): it must start even
where importing jbps fails, and must not import from the working directory.
Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time

MPICH_SEGMENT = "/dev/shm/mpich_shm_"
# When several ranks of a host time out together, the lowest running one
# speaks and ends the job; the others act only if the job is still there later.
OTHERS_DELAY_S = 2.0


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return {}
    env = {}
    for item in items:
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def running_ranks(pid: int, rank_variable: str) -> dict[int, int]:
    """{rank: pid} of the ranks of this job running on this host: the
    processes mpiexec's proxy started (the rank's siblings) that carry a rank."""
    parent = _ppid(pid)
    found = {}
    for other in _pids():
        if other == pid or _ppid(other) == parent:
            value = _environ(other).get(rank_variable, "")
            if value.isdigit() and _alive(other):
                found[int(value)] = other
    return found


def mapped_segments(pids) -> set[str]:
    """MPICH's shared-memory files (not yet removed) that any of `pids` maps."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        found.update(line.split()[-1] for line in lines if MPICH_SEGMENT in line and not line.endswith("(deleted)"))
    return found


def remove_unmapped(paths: set[str]) -> None:
    """Removes those of `paths` that no process maps any more."""
    existing = {p for p in paths if os.path.exists(p)}
    if not existing:
        return
    for path in existing - mapped_segments(_pids()):
        try:
            os.unlink(path)
        except FileNotFoundError:  # another guard was first
            pass


def _names(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def explain(args, phase: str, waited_s: float, running: dict[int, int]) -> str:
    prefix = f"jbps mpirun bootstrap: rank {args.rank} of {args.size}"
    waited = f"{waited_s:g} s (JBPS_TIMEOUT_S)"
    if phase == "mpi":
        local = int(args.local_size) if args.local_size.isdigit() else None
        gone = sorted(set(range(args.size)) - set(running))
        if local == args.size and gone:  # every rank was started here: the absent ones ended
            return (
                f"{prefix} waited {waited} for MPI to start in every rank; {_names(gone)} "
                f"{'is' if len(gone) == 1 else 'are'} no longer running: "
                f"{'it' if len(gone) == 1 else 'they'} ended before joining the job (see "
                f"{'its' if len(gone) == 1 else 'their'} own output). Ending the MPI job."
            )
        return (
            f"{prefix} waited {waited} for MPI to start in every rank; running on this host: "
            f"{_names(running)}. A rank ended before joining (see its output), or does not start MPI "
            "(jbps.init() in every rank, or python -m jbps.server). Ending the MPI job."
        )
    return (
        f"{prefix}: the ranks did not finish exchanging roles and addresses within {waited_s:g} s "
        "(JBPS_TIMEOUT_S and a grace period). Ending the MPI job."
    )


def end_job(args, phase: str, waited_s: float) -> None:
    running = running_ranks(args.pid, args.rank_variable)
    if running and min(running) != args.rank:
        time.sleep(OTHERS_DELAY_S)
        if not _alive(args.pid):
            return
        if min(running) not in running_ranks(args.pid, args.rank_variable):
            os.kill(args.pid, signal.SIGKILL)  # the lowest rank's guard has spoken and ended its rank
            return
    sys.stderr.write(explain(args, phase, waited_s, running) + "\n")
    sys.stderr.flush()
    os.kill(args.pid, signal.SIGKILL)  # mpiexec then ends every rank


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--local-size", default="")
    p.add_argument("--rank-variable", required=True)
    args = p.parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the job must not skip the clean-up
    deadline, phase, waited_s = None, "", 0.0
    segments: set[str] = set()
    buffered = b""
    stdin = sys.stdin.buffer.raw  # type: ignore[union-attr]  # stdin is a file here, not a BinaryIO stub
    while True:
        segments |= mapped_segments([args.pid])
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                segments |= mapped_segments(running_ranks(args.pid, args.rank_variable).values())
                end_job(args, phase, waited_s)
                deadline = None
                continue
        else:
            left = 1.0  # look at the rank's mappings now and then: MPICH maps its file in MPI_Init
        readable, _, _ = select.select([stdin], [], [], min(left, 1.0))
        if not readable:
            continue
        data = os.read(stdin.fileno(), 4096)
        if not data:  # the rank exited
            break
        buffered += data
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            words = line.decode().split()
            if words[:1] == ["wait"] and len(words) == 3:
                waited_s, phase = float(words[1]), words[2]
                deadline = time.monotonic() + waited_s
            elif words == ["done"]:
                deadline = None
    # The rank is gone: wait briefly for the job's other local processes to
    # let go of the files (mpiexec is ending them), then remove what is ours.
    give_up = time.monotonic() + 5
    while segments & mapped_segments(_pids()) and time.monotonic() < give_up:
        time.sleep(0.1)
    remove_unmapped(segments)


if __name__ == "__main__":
    main()
