"""Every knob of jbps: a keyword of ``jbps.init()`` and an environment variable.

BytePS names are accepted as aliases where the meaning is the same. Keywords
override the environment; the JBPS_* name wins over its alias.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable, Mapping, NoReturn

from .errors import JbpsError
from .scheduler.admission import check_secret
from .sizes import parse_bytes

ROLES = ("worker", "server", "scheduler")

DEFAULT_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Option:
    name: str  # keyword of jbps.init()
    env: tuple[str, ...]  # environment variables, preferred first
    parse: Callable[[str], Any]
    default: Any
    help: str
    # Read when none of `env` is set: BytePS spells some settings as two variables.
    # Returns (variable, raw value) or None.
    fallback: Callable[[Mapping[str, str]], tuple[str, str] | None] | None = None
    hidden: bool = False  # a secret: never repeated in an error or a repr


def _servers(text: str) -> tuple[str, ...]:
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    for item in items:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not host:port")
    return items


def _int(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _positive_bytes(text: str) -> int:
    value = parse_bytes(text)
    if value < 1:
        raise ValueError("must be at least 1 byte")
    return value


def _non_negative_bytes(text: str) -> int:
    value = parse_bytes(text)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number (of seconds, e.g. 60 or 2.5)") from None
    if not value > 0:
        raise ValueError("must be positive")
    return value


def _token(text: str) -> int:
    value = _int(text)
    if not 0 <= value < 1 << 64:
        raise ValueError("must be an integer in [0, 2**64)")
    return value


def _switch(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError("must be 1 or 0 (true/false, yes/no, on/off)")


def _text(text: str) -> str:
    if not text:
        raise ValueError("must not be empty")
    return text


def _role(text: str) -> str:
    if text not in ROLES:
        raise ValueError(f"must be one of {', '.join(ROLES)}")
    return text


def _port(text: str) -> int:
    value = _int(text)
    if not 0 < value < 65536:
        raise ValueError("must be a port number, 1 to 65535")
    return value


def _byteps_trace_dir(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """BYTEPS_TRACE_DIR counts only with BYTEPS_TRACE_ON=1, as in BytePS."""
    if environ.get("BYTEPS_TRACE_ON", "").strip() == "1" and environ.get("BYTEPS_TRACE_DIR", "").strip():
        return "BYTEPS_TRACE_DIR", environ["BYTEPS_TRACE_DIR"]
    return None


OPTIONS = (
    Option("servers", ("JBPS_SERVERS",), _servers, None, "comma-separated host:port of every summation server"),
    Option(
        "num_workers",
        ("JBPS_NUM_WORKERS", "DMLC_NUM_WORKER"),
        _positive_int,
        None,
        "number of worker processes in the job (default 1 with JBPS_SERVERS; a bootstrap finds it)",
    ),
    Option(
        "worker_rank",
        ("JBPS_WORKER_RANK", "DMLC_WORKER_ID"),
        _non_negative_int,
        None,
        "this worker's rank, 0 .. num_workers-1 (default 0 with JBPS_SERVERS; a bootstrap assigns it)",
    ),
    Option(
        "local_rank",
        ("JBPS_LOCAL_RANK",),
        _non_negative_int,
        None,
        "this worker's rank among the workers on its host (default 0; a bootstrap assigns it)",
    ),
    Option(
        "local_size",
        ("JBPS_LOCAL_SIZE",),
        _positive_int,
        None,
        "worker processes on this host (default 1; a bootstrap finds it)",
    ),
    Option(
        "role",
        ("JBPS_ROLE", "DMLC_ROLE"),
        _role,
        None,
        "worker, server or scheduler: which part of an environment bootstrap this process is",
    ),
    Option(
        "num_servers",
        ("JBPS_NUM_SERVERS", "DMLC_NUM_SERVER"),
        _positive_int,
        None,
        "summation server processes the scheduler waits for",
    ),
    Option(
        "scheduler_host",
        ("JBPS_SCHEDULER_HOST", "DMLC_PS_ROOT_URI"),
        _text,
        None,
        "host of the scheduler (environment bootstrap)",
    ),
    Option(
        "scheduler_port",
        ("JBPS_SCHEDULER_PORT", "DMLC_PS_ROOT_PORT"),
        _port,
        None,
        "port of the scheduler (environment bootstrap)",
    ),
    Option(
        "colocated_servers",
        ("JBPS_COLOCATED_SERVERS",),
        _non_negative_int,
        1,
        "under mpirun: summation servers jbps starts inside the first worker of each host",
    ),
    Option(
        "partition_bytes",
        ("JBPS_PARTITION_BYTES", "BYTEPS_PARTITION_BYTES"),
        _positive_bytes,
        None,
        "largest chunk of a tensor sent as one message (bytes, or e.g. 4M); default 1 MiB on one host, and across hosts "
        "sized to each psum (see jbps/partition/defaults.py)",
    ),
    Option(
        "scheduling_credit",
        ("JBPS_SCHEDULING_CREDIT", "BYTEPS_SCHEDULING_CREDIT"),
        _positive_int,
        None,
        "chunks pushed and not yet acknowledged, per worker (the credit window); default "
        "max(4, 2 x servers) on one host, across hosts the servers that get bytes + 2",
    ),
    Option(
        "bucket_bytes",
        ("JBPS_BUCKET_BYTES",),
        _non_negative_bytes,
        None,
        "a psum of a larger tree is split into calls (buckets) of about this many bytes, in the order the "
        "backward pass produces the leaves, so each can start while the rest is computed; 0: one call; default "
        "4 MiB on one host, and across hosts sized to the tree and the link (see jbps/partition/defaults.py)",
    ),
    Option(
        "timeout_s",
        ("JBPS_TIMEOUT_S",),
        _positive_float,
        DEFAULT_TIMEOUT_S,
        "seconds before connecting or a psum gives up with an error",
    ),
    Option(
        "shm",
        ("JBPS_SHM",),
        _switch,
        True,
        "share memory with summation servers on the same host instead of sending bytes through loopback "
        "TCP (0: TCP only); servers read it too",
    ),
    Option("job_token", ("JBPS_JOB_TOKEN",), _token, 0, "shared secret of the job; servers refuse workers without it"),
    Option(
        "job_secret",
        ("JBPS_JOB_SECRET",),
        check_secret,
        None,
        "the job's secret (16 characters or more), the same for every member: the scheduler admits only members "
        "that prove it, and members take the job only from a scheduler that proves it (`jbps run` draws one)",
        hidden=True,
    ),
    Option(
        "trace_dir",
        ("JBPS_TRACE_DIR",),
        _text,
        None,
        "write a Chrome/Perfetto trace of every chunk to DIR/<rank>/comm.json at shutdown",
        fallback=_byteps_trace_dir,
    ),
    Option(
        "huge_pages",
        ("JBPS_HUGE_PAGES",),
        _switch,
        True,
        "back a psum's fresh output buffers (of a parameter the caller keeps, 2 MiB and more) with transparent "
        "huge pages (madvise), so their first touch faults in 2 MiB pages, not 4 KiB ones; 0: as allocated",
    ),
    Option(
        "follow_rates",
        ("JBPS_FOLLOW_RATES",),
        _switch,
        True,
        "across hosts: re-plan the split while the job runs when a server's link slows or recovers "
        "(jbps/replan.py); 0: keep the split jbps.init measured. Set it alike on every worker",
    ),
)


_BY_NAME = {o.name: o for o in OPTIONS}
_NO_DEFAULT = object()


def _parse(opt: Option, raw: str, source: str) -> Any:
    try:
        return opt.parse(raw.strip())
    except ValueError as exc:
        shown = "(hidden)" if opt.hidden else repr(raw)
        raise JbpsError(f"{source}={shown}: {exc}") from None


def env_value(name: str, environ: Mapping[str, str] | None = None, default: Any = _NO_DEFAULT) -> Any:
    """Option `name` from the environment (its JBPS_* name first, then aliases),
    parsed and checked; the option's default (or `default`) when unset. A bad
    value raises JbpsError naming the variable. Workers and servers share it."""
    environ = os.environ if environ is None else environ
    opt = _BY_NAME[name]
    source = next((e for e in opt.env if environ.get(e, "").strip()), None)
    if source is None and opt.fallback is not None:
        found = opt.fallback(environ)
        if found is not None:
            return _parse(opt, found[1], found[0])
    if source is None:
        return opt.default if default is _NO_DEFAULT else default
    return _parse(opt, environ[source], source)


def deterministic_sums(environ: Mapping[str, str] | None = None) -> bool:
    """JBPS_DETERMINISTIC=1: servers add pushes in worker-rank order."""
    environ = os.environ if environ is None else environ
    return environ.get("JBPS_DETERMINISTIC", "0").strip() not in ("", "0")


def exit_for_environment(prog: str, exc: JbpsError) -> NoReturn:
    """Ends a command whose environment holds a bad setting: one line naming
    the variable (exit 2, as argparse), no usage block, since no flag was wrong."""
    print(f"{prog}: {exc}", file=sys.stderr)
    raise SystemExit(2)


def parse_option(name: str, text: str) -> Any:
    """Parses a command-line value of option `name`."""
    return _BY_NAME[name].parse(text)


def argparse_type(name: str) -> Callable[[str], Any]:
    """argparse `type=` that checks a flag exactly as jbps.init() checks option `name`."""
    import argparse

    def parse(text: str) -> Any:
        try:
            return parse_option(name, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None

    return parse


@dataclasses.dataclass(frozen=True)
class Config:
    servers: tuple[str, ...] | None
    num_workers: int | None
    worker_rank: int | None
    local_rank: int | None
    local_size: int | None
    role: str | None
    num_servers: int | None
    scheduler_host: str | None
    scheduler_port: int | None
    colocated_servers: int
    partition_bytes: int | None  # None: sized per call (jbps/partition/defaults.py)
    scheduling_credit: int | None  # None until init() knows the servers' roles
    bucket_bytes: int | None  # 0: one custom call per psum; None: sized per psum (jbps/partition/defaults.py)
    timeout_s: float
    shm: bool
    job_token: int
    job_secret: str | None = dataclasses.field(repr=False)
    trace_dir: str | None
    huge_pages: bool
    follow_rates: bool

    @property
    def scheduler(self) -> str | None:
        """host:port of the scheduler when both are set."""
        if self.scheduler_host and self.scheduler_port:
            return f"{self.scheduler_host}:{self.scheduler_port}"
        return None

    @classmethod
    def resolve(
        cls, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None, caller: str = "jbps.init"
    ) -> "Config":
        """Builds the config from keywords, then the environment, then defaults;
        `caller` names the function the keywords were given to in errors."""
        environ = os.environ if environ is None else environ
        known = {o.name for o in OPTIONS}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"{caller}() got unknown option(s) {unknown}; known: {sorted(known)}")
        values = {}
        for opt in OPTIONS:
            if opt.name in overrides and overrides[opt.name] is not None:
                raw, source = overrides[opt.name], f"{caller}({opt.name}=...)"
                if isinstance(raw, (list, tuple)):
                    raw = ",".join(raw)  # servers=["h:p", ...]
                raw = str(raw)
                values[opt.name] = _parse(opt, raw, source)
            else:
                values[opt.name] = env_value(opt.name, environ)
        return cls(**values)

    def complete(self) -> "Config":
        """The settings a worker's engine starts with: servers known (given,
        or filled in by a bootstrap), defaults filled, ranges checked."""
        if not self.servers:
            raise JbpsError(
                "no summation servers: set JBPS_SERVERS=host:port[,host:port...] or pass "
                "jbps.init(servers=[...]); or start the job with `jbps run`, under mpirun, or with a "
                "scheduler (DMLC_PS_ROOT_URI and DMLC_PS_ROOT_PORT)"
            )
        done = dataclasses.replace(
            self,
            num_workers=self.num_workers or 1,
            worker_rank=self.worker_rank or 0,
            local_rank=self.local_rank or 0,
            local_size=self.local_size or 1,
        )
        if done.worker_rank >= done.num_workers:
            raise JbpsError(
                f"worker rank {done.worker_rank} (JBPS_WORKER_RANK) is out of range for "
                f"{done.num_workers} workers (JBPS_NUM_WORKERS)"
            )
        if done.local_rank >= done.local_size:
            raise JbpsError(
                f"local rank {done.local_rank} (JBPS_LOCAL_RANK) is out of range for "
                f"{done.local_size} local workers (JBPS_LOCAL_SIZE)"
            )
        return done
