"""Entry point of a summation server process.

    python -m jbps.server --bind 127.0.0.1:9001 --num-workers 2 [--role dedicated] [--deterministic]

Prints "jbps.server listening on HOST:PORT" once ready (port 0 picks a free
port, and this line says which). Exits when every worker has said goodbye
(unless --keep-alive), or on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from ..config import env_value, parse_option
from ..errors import JbpsError
from ..partition.assign import COLOCATED, ROLES

log = logging.getLogger("jbps.server")


def _env(*names: str, default=None):
    """Server-only variables; those shared with workers come from jbps.config."""
    return next((os.environ[n] for n in names if os.environ.get(n, "").strip()), default)


def _option_type(name: str):
    """argparse `type=` that checks a flag exactly as jbps.init() checks the option."""
    def parse(text: str):
        try:
            return parse_option(name, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return parse


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jbps.server", description="jbps summation server")
    try:
        num_workers = env_value("num_workers", default=None)
        token = env_value("job_token")
        timeout_s = env_value("timeout_s")
    except JbpsError as exc:
        p.error(str(exc))
    p.add_argument("--bind", default=_env("JBPS_SERVER_BIND", default="127.0.0.1:0"),
                   help="host:port to listen on (default 127.0.0.1:0, a free loopback port; env JBPS_SERVER_BIND)")
    p.add_argument("--num-workers", type=_option_type("num_workers"), default=num_workers,
                   help="worker processes in the job (env JBPS_NUM_WORKERS / DMLC_NUM_WORKER)")
    p.add_argument("--engine-threads", type=int,
                   default=int(_env("JBPS_SERVER_ENGINE_THREADS", "BYTEPS_SERVER_ENGINE_THREAD", default=0)),
                   help="summation threads (default: min(4, cores); env JBPS_SERVER_ENGINE_THREADS / "
                        "BYTEPS_SERVER_ENGINE_THREAD)")
    p.add_argument("--token", type=_option_type("job_token"), default=token,
                   help="job token workers must present (env JBPS_JOB_TOKEN)")
    p.add_argument("--timeout", type=_option_type("timeout_s"), default=timeout_s,
                   help="seconds a half-received message or a blocked send may stall (env JBPS_TIMEOUT_S)")
    p.add_argument("--role", choices=ROLES, default=_env("JBPS_SERVER_ROLE", default=COLOCATED),
                   help="colocated: on a worker's machine (the default); dedicated: on a CPU-only machine. "
                        "Workers give each role its share of the bytes by the optimal split (env JBPS_SERVER_ROLE)")
    p.add_argument("--deterministic", action="store_true",
                   default=_env("JBPS_DETERMINISTIC", default="0").strip() not in ("", "0"),
                   help="add pushes in worker-rank order, so sums are bitwise identical run to run "
                        "(env JBPS_DETERMINISTIC=1)")
    p.add_argument("--keep-alive", action="store_true",
                   help="keep serving after every worker said goodbye (for a following job)")
    args = p.parse_args(argv)
    if args.role not in ROLES:
        p.error(f"JBPS_SERVER_ROLE={args.role!r}: expected one of {', '.join(ROLES)}")
    if args.num_workers is None:
        p.error("--num-workers is required (or set JBPS_NUM_WORKERS)")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = parse_args(argv)
    from .. import _core

    try:
        server = _core.Server(args.bind, args.num_workers, args.token, args.engine_threads, args.timeout,
                              args.keep_alive, args.role, args.deterministic)
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    host = args.bind.rpartition(":")[0]
    print(f"jbps.server listening on {host}:{server.port} for {args.num_workers} workers "
          f"({args.role}{', deterministic' if args.deterministic else ''})", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # Short waits so signal handlers run promptly on the main thread.
    while not stop.is_set() and not server.wait(0.2):
        pass
    server.stop()
    stats = server.stats()
    log.info("done: %d pushes, %.1f MiB received, %d sums sent, %d connections refused",
             stats["pushes"], stats["bytes_received"] / 2**20, stats["sums_sent"], stats["rejected"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
