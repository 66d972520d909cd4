"""The server's settings from the environment, checked in one place: by the
server as it starts, and by jbps run before it starts anything."""

from __future__ import annotations

import os
from typing import Mapping

from ..config import Config, deterministic_sums, env_value
from ..errors import JbpsError
from ..partition.assign import COLOCATED, ROLES

_ENGINE_THREADS = ("JBPS_SERVER_ENGINE_THREADS", "BYTEPS_SERVER_ENGINE_THREAD")


def _env(environ: Mapping[str, str], *names: str, default=None):
    """Server-only variables; those shared with workers come from jbps.config."""
    return next((environ[n] for n in names if environ.get(n, "").strip()), default)


def check_port(bind: str, what: str) -> None:
    """JbpsError unless `bind` (host:port) ends in a port number; `what` names where it came from."""
    port = bind.rpartition(":")[2]
    if not port.isdigit() or int(port) > 65535:
        raise JbpsError(f"{what}{bind!r}: the port must be a number from 0 to 65535 (0: any free port)")


def settings_from_environment(environ: Mapping[str, str] | None = None) -> dict:
    """The server's settings from the environment, each checked: a bad one
    raises JbpsError naming the variable. jbps run calls this before it starts
    anything, so a bad server setting is named once, by the launcher."""
    environ = os.environ if environ is None else environ
    name = next((n for n in _ENGINE_THREADS if environ.get(n, "").strip()), None)
    threads = environ[name].strip() if name else "0"
    if not threads.isdigit():
        raise JbpsError(f"{name}={environ[name]!r}: must be a whole number of threads (0: min(4, cores))")
    role = _env(environ, "JBPS_SERVER_ROLE", default=COLOCATED)
    if role not in ROLES:
        raise JbpsError(f"JBPS_SERVER_ROLE={role!r}: expected one of {', '.join(ROLES)}")
    bind = _env(environ, "JBPS_SERVER_BIND", default="127.0.0.1:0")
    check_port(bind, "JBPS_SERVER_BIND=")
    return {
        "token": env_value("job_token", environ),
        "secret": env_value("job_secret", environ),
        "timeout_s": env_value("timeout_s", environ),
        "shm": env_value("shm", environ),
        "sum_threads": int(threads),
        "scheduler": Config.resolve({}, environ).scheduler,
        "num_workers": env_value("num_workers", environ, default=None),
        "role": role,
        "bind": bind,
        "deterministic": deterministic_sums(environ),
    }
