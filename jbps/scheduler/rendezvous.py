"""The rendezvous of an environment-variable bootstrap (no MPI).

BytePS's names: DMLC_ROLE=scheduler|server|worker, DMLC_NUM_WORKER,
DMLC_NUM_SERVER, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, DMLC_WORKER_ID (JBPS_*
equivalents in config.py). One scheduler listens at ROOT_URI:ROOT_PORT; every
server and worker connects (retrying, so any start order works), says who it
is, and waits. Once everyone has registered, the scheduler:

 1. numbers the workers (DMLC_WORKER_ID where given, the rest in arrival order),
 2. tells each server the job token, the worker count and its role (dedicated
    when no worker shares its host, colocated otherwise),
 3. collects each server's listening address,
 4. tells each server the job has assembled (a server serves only then: had a
    later server failed to start, it would wait for workers that never come),
 5. tells each worker the server list, the token, its rank and its local rank.

If someone is missing after the timeout, every member that did register gets
an error naming who is missing, and the scheduler exits with an error. The
wire format is one JSON object per line over TCP. With a job secret, members
and scheduler prove it to each other (admission.py); a connection that does not
is refused with a log line, and the job goes on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import socket
import time
from typing import Any

from ..errors import JbpsError
from .admission import SECRET_HINT, new_challenge, proven, signed

log = logging.getLogger("jbps.scheduler")

ROLES = ("worker", "server")
# How long a connection may take to say its hello: members say it at once, and
# one that does not must not hold up the others' registration for long.
HELLO_TIMEOUT_S = 10.0


@dataclasses.dataclass
class Member:
    role: str
    host: str  # the address the member reached the scheduler from
    worker_id: int | None
    conn: socket.socket
    reader: Any  # a text file over conn
    challenge: str  # the member's own: the scheduler's answers prove the secret against it
    rank: int = -1
    warms_up: bool = False  # an elastic worker that traces its step before it joins (elastic.py)


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _recv(reader, what: str) -> dict:
    line = reader.readline()
    if not line:
        raise ConnectionError(f"{what} closed the connection")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError(f"{what} sent {line!r}, not a JSON object")
    return message


# A scheduler is often started before its members, and a worker's start (imports, its data, a
# first compile) can outlast a psum's timeout: the job's first member may take this long to
# come. From the first member on, the rest must come within the timeout (JBPS_TIMEOUT_S).
FIRST_MEMBER_S = 300.0


def assembly_wait_s(timeout_s: float, anyone_came: bool) -> float:
    """How long a scheduler waits for its job to assemble: the timeout from
    the first member's registration, FIRST_MEMBER_S (at least) before it."""
    return timeout_s if anyone_came else max(timeout_s, FIRST_MEMBER_S)


def assembly_timed_out(address: str, timeout_s: float, anyone_came: bool, missing: str) -> str:
    """The message of a job that did not assemble in time."""
    if not anyone_came:
        return (
            f"jbps scheduler {address}: no member registered within {assembly_wait_s(timeout_s, False):g} s "
            f"(is the job's DMLC_PS_ROOT_URI/PORT this scheduler's address?)"
        )
    return (
        f"jbps scheduler {address}: timed out after {timeout_s:g} s (JBPS_TIMEOUT_S) from the first member's "
        f"registration waiting for the job: {missing}"
    )


class Scheduler:
    """Listens at once (so the port is known); run() does the rendezvous."""

    def __init__(
        self,
        num_workers: int,
        num_servers: int,
        *,
        bind: str = "127.0.0.1:0",
        timeout_s: float = 60.0,
        token: int | None = None,
        secret: str | None = None,
    ):
        if num_workers < 1 or num_servers < 1:
            raise JbpsError(f"a job needs at least one worker and one server, got {num_workers} and {num_servers}")
        self.num_workers, self.num_servers, self.timeout_s = num_workers, num_servers, timeout_s
        self.token = token if token else secrets.randbits(63) or 1
        host, _, port = bind.rpartition(":")
        if not host:  # socket would take "" as every interface: that must be asked for by name
            raise JbpsError(
                f"no host in address {bind!r} (127.0.0.1 for this machine only, 0.0.0.0 for every interface)"
            )
        self.sock = socket.create_server((host, int(port)), reuse_port=False)
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.members: list[Member] = []
        self.secret = secret
        if not secret and not host.startswith("127."):
            log.warning(
                "no job secret: anyone who reaches %s can join this job and learn its token; set JBPS_JOB_SECRET "
                "to the same secret for every member (%s)",
                self.address,
                SECRET_HINT,
            )

    def close(self) -> None:
        for m in self.members:
            m.conn.close()
        self.sock.close()

    def _missing(self) -> str:
        workers = [m for m in self.members if m.role == "worker"]
        servers = [m for m in self.members if m.role == "server"]
        ids = {m.worker_id for m in workers if m.worker_id is not None}
        missing_ids = [i for i in range(self.num_workers) if i not in ids]
        detail = ""
        if len(ids) == len(workers) and missing_ids:  # every worker gave its id: name the absent ones
            detail = f"; missing worker ids {missing_ids}"
        return (
            f"{len(workers)} of {self.num_workers} workers and {len(servers)} of {self.num_servers} servers "
            f"registered{detail}"
        )

    def _answer(self, m: Member, message: dict) -> None:
        _send(m.conn, signed(self.secret, "scheduler", m.challenge, message) if self.secret else message)

    def _admit(self, hello: dict, challenge: str) -> None:
        """ValueError unless the hello proves the job secret (when the job has one)."""
        if not self.secret:
            return
        if "proof" not in hello:
            raise ValueError("it did not prove the job secret: it was started without JBPS_JOB_SECRET")
        if not proven(self.secret, "member", challenge, hello):
            raise ValueError(
                "its proof of the job secret is wrong: another JBPS_JOB_SECRET, or a hello replayed from "
                "another connection"
            )

    def _fail(self, message: str) -> None:
        log.error("%s", message)
        for m in self.members:
            try:
                _send(m.conn, {"error": message})
            except OSError:
                pass
        raise JbpsError(message)

    def _register(self, deadline: float) -> None:
        while (
            sum(m.role == "worker" for m in self.members) < self.num_workers
            or sum(m.role == "server" for m in self.members) < self.num_servers
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(assembly_timed_out(self.address, self.timeout_s, bool(self.members), self._missing()))
            self.sock.settimeout(min(left, 1.0))
            try:
                conn, peer = self.sock.accept()
            except socket.timeout:
                continue
            member = self._greet(conn, peer, deadline)
            if member is None:
                continue
            if not self.members:  # the rest must come within the timeout from now
                deadline = time.monotonic() + assembly_wait_s(self.timeout_s, True)
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            self.members.append(member)
            log.info("%s registered from %s (%s)", member.role, peer[0], self._missing())

    def _check_hello(self, hello: dict) -> None:
        """ValueError if this member cannot join the job as it says."""
        role, worker_id = hello.get("role"), hello.get("worker_id")
        if hello.get("elastic"):
            raise ValueError(
                "it runs jbps.elastic.run, and this job is not elastic: start the scheduler with --min-workers "
                "and --max-workers (or jbps run with them)"
            )
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        if worker_id is not None and not (isinstance(worker_id, int) and 0 <= worker_id < self.num_workers):
            raise ValueError(f"worker id {worker_id!r} is out of range for {self.num_workers} workers")
        if (
            role == "worker"
            and worker_id is not None
            and any(m.worker_id == worker_id for m in self.members if m.role == "worker")
        ):
            raise ValueError(f"worker id {worker_id} registered twice")
        count = sum(m.role == role for m in self.members)
        if count == (self.num_workers if role == "worker" else self.num_servers):
            raise ValueError(f"one {role} too many: the job has {count}")

    def _opening(self, challenge: str) -> dict:
        """The scheduler's first line on a connection."""
        return {"challenge": challenge}

    def _greet(self, conn: socket.socket, peer, deadline: float) -> Member | None:
        """Reads a new connection's hello; the member, or None (the connection
        refused with a log line and closed)."""
        conn.settimeout(max(1.0, min(HELLO_TIMEOUT_S, deadline - time.monotonic())))
        reader = conn.makefile("r")
        challenge = new_challenge()
        try:
            _send(conn, self._opening(challenge))
            hello = _recv(reader, f"{peer[0]}:{peer[1]}")
            self._admit(hello, challenge)
            if not isinstance(hello.get("challenge"), str):
                raise ValueError("its hello has no challenge for the scheduler to answer")
            self._check_hello(hello)
        except (OSError, ValueError, ConnectionError) as exc:
            log.warning("refused %s:%d: %s", peer[0], peer[1], exc or type(exc).__name__)
            try:
                _send(conn, {"error": f"jbps scheduler refused this member: {exc}"})
            except OSError:
                pass
            conn.close()
            return None
        member = Member(hello["role"], conn.getpeername()[0], hello.get("worker_id"), conn, reader, hello["challenge"])
        member.warms_up = hello.get("warms_up") is True
        return member

    def run(self) -> None:
        """Registers everyone, hands out roles and addresses; raises JbpsError
        (after telling every member) if the job does not assemble in time."""
        deadline = time.monotonic() + assembly_wait_s(self.timeout_s, False)
        self._register(deadline)
        workers = [m for m in self.members if m.role == "worker"]
        servers = [m for m in self.members if m.role == "server"]
        free = iter(sorted(set(range(self.num_workers)) - {m.worker_id for m in workers}))
        for m in workers:
            m.rank = m.worker_id if m.worker_id is not None else next(free)
        workers.sort(key=lambda m: m.rank)
        worker_hosts = [m.host for m in workers]
        for i, m in enumerate(servers):
            role = "colocated" if m.host in worker_hosts else "dedicated"
            self._answer(m, {"token": self.token, "num_workers": self.num_workers, "role": role, "index": i})
        addresses = []
        for m in servers:
            try:
                reply = _recv(m.reader, f"server at {m.host}")
            except (OSError, ValueError, ConnectionError) as exc:
                self._fail(f"jbps scheduler: server at {m.host} failed to start: {exc}")
            if "error" in reply:
                self._fail(f"jbps scheduler: server at {m.host} failed to start: {reply['error']}")
            addresses.append(reply["address"])
        for m in servers:
            try:
                self._answer(m, {"assembled": True})
            except OSError as exc:
                self._fail(f"jbps scheduler: server at {m.host} left before the job assembled: {exc}")
        for m in workers:
            same_host = [w for w in workers if w.host == m.host]
            self._answer(
                m,
                {
                    "servers": addresses,
                    "token": self.token,
                    "num_workers": self.num_workers,
                    "rank": m.rank,
                    "local_rank": same_host.index(m),
                    "local_size": len(same_host),
                },
            )
        log.info("job assembled: %d workers, servers %s", self.num_workers, ",".join(addresses))


def _connect(address: str, timeout_s: float) -> socket.socket:
    """Connects to the scheduler, retrying while nothing listens there: it may
    start after its members, as they may after it (FIRST_MEMBER_S, at least the
    timeout). A host name that does not resolve fails at once."""
    host, _, port = address.rpartition(":")
    start = time.monotonic()
    deadline = start + assembly_wait_s(timeout_s, anyone_came=False)
    said = False
    while True:
        left = deadline - time.monotonic()
        try:
            return socket.create_connection((host, int(port)), timeout=max(0.1, min(timeout_s, left)))
        except socket.gaierror as exc:
            raise JbpsError(
                f"the jbps scheduler's host {host!r} (DMLC_PS_ROOT_URI) does not resolve to an address: {exc}"
            ) from None
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise JbpsError(
                    f"could not reach the jbps scheduler at {address} (DMLC_PS_ROOT_URI/PORT) within "
                    f"{deadline - start:g} s: {exc}"
                ) from None
            if not said and time.monotonic() - start >= timeout_s:
                said = True
                log.warning(
                    "still no jbps scheduler at %s (DMLC_PS_ROOT_URI/PORT) after %g s (%s); trying until %g s",
                    address,
                    timeout_s,
                    exc,
                    deadline - start,
                )
        time.sleep(0.1)


class Registration:
    """A member's side: connect (retrying while no scheduler listens, _connect),
    say who we are (proving the job secret when we have one), and wait for the
    job to assemble, `timeout_s` from the connection on."""

    def __init__(
        self,
        address: str,
        role: str,
        timeout_s: float,
        worker_id: int | None = None,
        secret: str | None = None,
        **extra: Any,
    ):
        self.address, self.timeout_s, self.secret = address, timeout_s, secret
        self.conn = _connect(address, timeout_s)
        self.deadline = time.monotonic() + timeout_s
        self.reader = self.conn.makefile("r")
        # The address we reach the scheduler from is the one others can reach us at.
        self.local_host = self.conn.getsockname()[0]
        try:
            self.opening = self._read()
            challenge = self.opening.get("challenge")
            if not isinstance(challenge, str):
                raise JbpsError(
                    f"{address} (DMLC_PS_ROOT_URI/PORT) did not open as a jbps scheduler does: is it another "
                    "program, or the scheduler of another jbps version?"
                )
            self.challenge = new_challenge()
            hello = {"role": role, "worker_id": worker_id, "challenge": self.challenge, **extra}
            self.send(signed(secret, "member", challenge, hello) if secret else hello)
        except BaseException:  # no half-open connection is left behind
            self.close()
            raise

    def _read(self) -> dict:
        # The scheduler answers when the whole job has registered, or fails it
        # after its own timeout: allow a little beyond ours for its message.
        self.conn.settimeout(max(0.1, self.deadline - time.monotonic()) + 5.0)
        try:
            message = _recv(self.reader, f"the jbps scheduler at {self.address}")
        except socket.timeout:
            raise JbpsError(
                f"the jbps scheduler at {self.address} did not assemble the job within "
                f"{self.timeout_s:g} s (JBPS_TIMEOUT_S)"
            ) from None
        except (OSError, ValueError, ConnectionError) as exc:
            raise JbpsError(f"lost the jbps scheduler at {self.address}: {exc}") from None
        if "error" in message:
            raise JbpsError(message["error"])
        return message

    def receive(self) -> dict:
        message = self._read()
        if self.secret and not proven(self.secret, "scheduler", self.challenge, message):
            raise JbpsError(
                f"the jbps scheduler at {self.address} did not prove the job secret (JBPS_JOB_SECRET): it was "
                "started without it or with another one, or it is not this job's scheduler"
            )
        message.pop("proof", None)
        return message

    def send(self, message: dict) -> None:
        try:
            _send(self.conn, message)
        except OSError as exc:
            raise JbpsError(f"lost the jbps scheduler at {self.address}: {exc}") from None

    def close(self) -> None:
        self.reader.close()
        self.conn.close()


def refuse(bind: str, reason: str, timeout_s: float) -> None:
    """A scheduler that cannot run the job (its own settings are wrong) still
    answers every member that comes, for `timeout_s`, with `reason`: they fail
    at once saying why, instead of waiting out their timeout for a scheduler
    that is gone."""
    host, _, port = bind.rpartition(":")
    if not host or not port.isdigit() or int(port) == 0:
        return  # no fixed address: nobody could have been told where to come
    try:
        sock = socket.create_server((host, int(port)), reuse_port=False)
    except OSError:
        return
    deadline = time.monotonic() + timeout_s
    message = f"jbps scheduler refused this member: {reason}"
    with sock:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(min(left, 1.0))
            try:
                conn, _ = sock.accept()
            except socket.timeout:
                continue
            with conn:
                conn.settimeout(2.0)
                try:  # a member reads the scheduler's first line before it says anything
                    _send(conn, {"error": message})
                except (OSError, ValueError, ConnectionError):
                    pass
