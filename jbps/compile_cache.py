"""An elastic job's compilation cache on each host, for workers the environment started.

A join makes every member trace its step again (jbps/elastic.py), and the
program text is the one compiled before; with jax's persistent cache each
member loads it instead of compiling it for seconds. `jbps run` gives its
elastic workers a cache directory and removes it at the end (jbps/launch.py).
Workers started by the scheduler's variables on hosts no launcher of ours
reached get one here: a directory of the job's in this host's temporary
directory (named by a digest of the scheduler's address and the job secret,
so a worker started again on the host finds what it compiled before), which
the last of the job's workers on the host removes as it leaves. Each worker
notes itself in it (host, pid, the process's start time); one killed before it
could leave is seen dead by the next worker that comes, which removes such a
directory of any ended job of this user.

Nothing is done where jax already has a cache directory (JAX_COMPILATION_CACHE_DIR,
`jax.config.update`, the launcher's) or the cache is off (JAX_ENABLE_COMPILATION_CACHE=0).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("jbps.compile_cache")

# jax's persistent cache keeps only programs that took a second to compile by default;
# a generation's step is usually quicker, and its trace and compile hold the others up.
COMPILE_EVERY_PROGRAM = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}

_PREFIX = "jbps-job-cache-"
_MEMBERS = "members"


def _process_start(pid: int) -> str:
    """The process's start time (clock ticks since boot), which a pid reused
    by another process does not share: '0' where /proc does not say, 'Z' for
    a process that ended and was not yet waited for (a killed worker whose
    launcher has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return "Z" if fields[0] in (b"Z", b"X") else fields[19].decode()
    except (OSError, IndexError):
        return "0"


def _entry_alive(name: str, host: str) -> bool:
    """Whether the worker a member entry names still runs. An entry of another
    host (a temporary directory shared between hosts) counts as alive."""
    entry_host, _, rest = name.rpartition("@")
    pid, _, started = rest.partition("-")
    if entry_host != host:
        return True
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _process_start(int(pid)) == started


@contextlib.contextmanager
def _locked(directory: Path):
    """Holds an exclusive lock on the directory itself; yields False where it
    was removed (or replaced) before the lock was had."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held = os.fstat(fd)
        try:
            now = os.lstat(directory)
            same = (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev) and held.st_nlink > 0
        except FileNotFoundError:
            same = False
        yield same
    finally:
        os.close(fd)


def _own_private_dir(directory: Path) -> bool:
    """A directory of this user's that no one else may write: jax loads
    programs from it and runs them (a shared temporary directory's name could
    be taken by someone else first)."""
    info = os.lstat(directory)
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


def _live_members(directory: Path, host: str, drop_dead: bool) -> list[str]:
    members = directory / _MEMBERS
    alive = []
    for entry in sorted(os.listdir(members)) if members.is_dir() else []:
        if _entry_alive(entry, host):
            alive.append(entry)
        elif drop_dead:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(members / entry)
    return alive


def _remove_if_ended(directory: Path, host: str, entry: str | None = None) -> bool:
    """Under the directory's lock: drops `entry` (this worker's), and removes
    the directory where no worker of the job on this host is alive. Returns
    whether it removed it."""
    with _locked(directory) as here:
        if not here:
            return False
        if entry is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / _MEMBERS / entry)
        if _live_members(directory, host, drop_dead=entry is not None):
            return False
        shutil.rmtree(directory, ignore_errors=True)
        return True


class JobCache:
    """This worker's use of its job's cache directory on this host (use(): None where jax has one)."""

    def __init__(self, directory: Path, entry: str, restore: dict):
        self.directory = directory
        self.entry = entry
        self._restore = restore  # jax's settings as they were, put back by leave()

    def leave(self) -> bool:
        """Stops jax using the directory and, where no other worker of the job on
        this host uses it, removes it. Returns whether it was removed."""
        import jax
        from jax.experimental.compilation_cache import compilation_cache

        for name, value in self._restore.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
        try:
            return _remove_if_ended(self.directory, socket.gethostname(), self.entry)
        except OSError as exc:
            log.warning("jbps: could not remove the job's compilation cache %s: %s", self.directory, exc)
            return False


def _sweep(parent: Path, keep: Path, host: str) -> None:
    """Removes this user's job cache directories whose workers on this host all
    ended without leaving (killed), other than keep."""
    for directory in parent.glob(f"{_PREFIX}{os.getuid()}-*"):
        if directory == keep:
            continue
        try:
            if _own_private_dir(directory):
                _remove_if_ended(directory, host)
        except OSError:
            continue  # another worker removed it first, or it is not ours to look at


def persistent_cache_on() -> bool:
    """Whether jax's persistent compilation cache is on in this process (a
    directory set, the cache enabled): a step traced afresh then loads the
    program the job compiled before instead of compiling it."""
    import jax

    return bool(jax.config.jax_compilation_cache_dir) and bool(jax.config.jax_enable_compilation_cache)


def job_directory(scheduler: str, secret: str | None) -> Path:
    """The job's directory on this host: the same for every worker of one job
    (its scheduler and secret), another for each job and user."""
    digest = hashlib.sha256(f"jbps-compile-cache\0{scheduler}\0{secret or ''}".encode()).hexdigest()[:20]
    return Path(tempfile.gettempdir()) / f"{_PREFIX}{os.getuid()}-{digest}"


def use(scheduler: str, secret: str | None) -> JobCache | None:
    """Points jax's persistent compilation cache at the job's directory on this
    host, keeping every program (unless the environment sets the thresholds),
    where jax has no cache directory and the cache is on. None otherwise, or
    where the directory cannot be had (logged: only time is at stake)."""
    import jax  # here: the launcher takes COMPILE_EVERY_PROGRAM without importing jax

    if jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
        return None
    from jax.experimental.compilation_cache import compilation_cache

    directory = job_directory(scheduler, secret)
    host = socket.gethostname()
    entry = f"{host}@{os.getpid()}-{_process_start(os.getpid())}"
    try:
        for _ in range(3):  # the last worker of an ended run of this job may remove it as this one comes
            os.makedirs(directory, mode=0o700, exist_ok=True)
            if not _own_private_dir(directory):
                log.warning("jbps: %s is not a private directory of this user: no compilation cache", directory)
                return None
            with _locked(directory) as here:
                if not here:
                    continue
                os.makedirs(directory / _MEMBERS, mode=0o700, exist_ok=True)
                _live_members(directory, host, drop_dead=True)
                (directory / _MEMBERS / entry).touch()
                break
        else:
            return None
    except OSError as exc:
        log.warning("jbps: no compilation cache for this elastic job (%s): %s", directory, exc)
        return None
    _sweep(directory.parent, directory, host)
    restore: dict[str, Any] = {"jax_compilation_cache_dir": None}
    for name, value in COMPILE_EVERY_PROGRAM.items():
        if name not in os.environ:  # the user's own thresholds stand
            option = name.lower()
            was = restore[option] = getattr(jax.config, option)
            jax.config.update(option, type(was)(value))  # a float of seconds, an int of bytes
    jax.config.update("jax_compilation_cache_dir", str(directory))
    compilation_cache.reset_cache()  # a jax that looked for a cache at an earlier compile looks again
    log.info("jbps: this elastic job's compilation cache on this host: %s", directory)
    return JobCache(directory, entry, restore)
