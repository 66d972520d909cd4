"""The rendezvous of an elastic job: workers may be lost and may join, and the job goes on.

    jbps run -n 3 --min-workers 2 --max-workers 4 python train.py
    python -m jbps.scheduler --num-workers 3 --num-servers 1 --min-workers 2 --max-workers 4

The scheduler stays up for the job's life and assembles it in *generations*.
Each generation is a job of its own: a fresh token (so a server refuses any
frame of an older membership, and no sum mixes two), the workers numbered
0..n-1, a summation server inside every worker, and the dedicated servers
(`python -m jbps.server` on CPU machines) that are there, each starting a
fresh server for it. Each member keeps one connection for its life; on it the
scheduler hands out generations, and learns:

- "regroup": the member left its generation (a worker at a commit, or after its
  psums failed; a server once its workers have left or one was lost) and waits
  for the next; a worker says whether it holds the job's state (it took a
  generation's state from its root, or was in the first generation);
- "done": a worker's training returned;
- "rates": rank 0's word on the links' rates its generation measured, which
  a later generation whose servers are all on hosts measured before reuses
  (so its workers skip the link probe);
- "sizing": rank 0's word on the chunk and bucket sizing its programs were
  lowered with (jbps/runtime.py, programs_sizing). A newcomer that warms up
  (jbps.elastic.run's warm_up) is told it as it registers while a generation
  runs, with the size the job will have with it; it traces its step with them
  and only then says "ready" and waits. The running workers are not asked to
  regroup for it before, so they do not wait for its trace;
- the connection's end: the member is gone (a lost server's keys go to the
  others in the next generation's plan).

A generation is assembled as soon as no member of the running one is still
running (each has regrouped, finished or gone) and at least --min-workers
workers wait, one of them from the last generation holding its state. Without
one, nobody holds the last commit: the job is over if a worker finished (a
newcomer still waiting is told so), and its state is lost if none did (the job
fails); a newcomer never starts the job again from its own fresh state. The
first waits for --num-workers workers and --num-servers dedicated servers (or,
after the timeout, for --min-workers workers). The survivors keep their order,
those holding the state first, so rank 0 of the next generation holds the last
commit; newcomers follow. When a newcomer (worker or server) waits and the
running generation has room, its workers are told to regroup, which they do
together at their next commit (jbps/elastic.py).
A member whose host vanishes without closing its connection is noticed as its
peers notice it (TCP keepalive, the engine's liveness bound). Every wait is
bounded by the timeout: a running member that says nothing for that long after
the others regrouped is dropped; fewer than --min-workers for
that long fail every waiting member with a message saying so.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import selectors
import socket
import time

from ..errors import JbpsError
from .rendezvous import HELLO_TIMEOUT_S, Member, Scheduler, _recv, assembly_timed_out, assembly_wait_s

log = logging.getLogger("jbps.scheduler")

_POLL_S = 0.1


def watch_liveness(conn: socket.socket, timeout_s: float) -> None:
    """The bound the engine's own connections have (xla_ext/transport/net.cc,
    SetLiveness): a member whose host vanishes without closing the connection
    (power loss, a cut link) is noticed within max(4 s, timeout_s / 2), as its
    peers notice it, and not after the scheduler's whole timeout."""
    probe_s = max(1, int(timeout_s / 8))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, probe_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, probe_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 4 * probe_s * 1000)


@dataclasses.dataclass
class ElasticMember(Member):
    generation: int = 0  # the last generation it ran in (0: none yet)
    told_to_regroup: bool = False
    waiting_since: float = 0.0
    told_waiting: float = 0.0  # when it was last told the job goes on without it for now
    holds: bool = False  # a worker that regrouped holding the job's state (jbps/bootstrap/elastic.py)


def _host(address: str) -> str:
    return address.rpartition(":")[0]


def _workers(members: list[ElasticMember]) -> list[ElasticMember]:
    return [m for m in members if m.role == "worker"]


class ElasticScheduler(Scheduler):
    def __init__(
        self,
        num_workers: int,
        min_workers: int,
        max_workers: int,
        *,
        num_servers: int = 0,
        bind: str = "127.0.0.1:0",
        timeout_s: float = 60.0,
        secret: str | None = None,
    ):
        if not 1 <= min_workers <= num_workers <= max_workers:
            raise JbpsError(
                f"an elastic job needs 1 <= --min-workers <= --num-workers <= --max-workers, got {min_workers}, "
                f"{num_workers} and {max_workers}"
            )
        super().__init__(num_workers, max(1, num_servers), bind=bind, timeout_s=timeout_s, secret=secret)
        self.num_servers = num_servers  # dedicated servers the first generation waits for
        self.min_workers, self.max_workers = min_workers, max_workers
        self.generation = 0
        self.ready: list[ElasticMember] = []  # waiting for the next generation, in arrival order
        self.running: list[ElasticMember] = []
        self.finished = 0
        self.selector = selectors.DefaultSelector()
        self.short_since: float | None = None  # since when fewer than min_workers could be assembled
        self.started = 0.0  # when the first generation's clock started: run(), then the first member's arrival
        self.anyone_came = False
        self.addresses: list[str] = []  # the running generation's servers
        self.rates: dict | None = None  # the links' rates a generation measured (_keep_rates)
        self.sizing: str | None = None  # the sizing rank 0's programs were lowered with ("sizing")
        self.warming: list[ElasticMember] = []  # newcomers tracing their step before they wait to join

    def _opening(self, challenge: str) -> dict:
        return {"challenge": challenge, "elastic": True}

    def _check_hello(self, hello: dict) -> None:
        role = hello.get("role")
        if role not in ("worker", "server"):
            raise ValueError(f"role {role!r} is not one of ('worker', 'server')")
        if role == "worker" and not hello.get("elastic"):
            raise ValueError(
                "it called jbps.init(), and this job is elastic: its workers train inside jbps.elastic.run"
            )
        if role == "worker" and len(_workers(self.ready + self.running + self.warming)) >= self.max_workers:
            raise ValueError(f"the job has its {self.max_workers} workers (--max-workers)")

    def close(self) -> None:
        for m in self.ready + self.running + self.warming:
            m.conn.close()
        self.selector.close()
        self.sock.close()

    def _drop(self, m: ElasticMember, why: str) -> None:
        for group in (self.ready, self.running, self.warming):
            if m in group:
                group.remove(m)
        try:
            self.selector.unregister(m.conn)
        except (KeyError, ValueError):
            pass
        m.conn.close()
        log.warning("%s %s (%d running, %d waiting)", self._name(m), why, len(self.running), len(self.ready))

    @staticmethod
    def _name(m: ElasticMember) -> str:
        rank = f" {m.rank}" if m.role == "worker" else ""
        return f"{m.role}{rank} of generation {m.generation} ({m.host})" if m.generation else f"{m.role} from {m.host}"

    def _accept(self) -> None:
        conn, peer = self.sock.accept()
        member = self._greet(conn, peer, time.monotonic() + HELLO_TIMEOUT_S)
        if member is None:
            return
        m = ElasticMember(member.role, member.host, member.worker_id, member.conn, member.reader, member.challenge)
        m.waiting_since = time.monotonic()
        conn.settimeout(HELLO_TIMEOUT_S)  # a member's lines come whole: a partial one is a member gone wrong
        watch_liveness(conn, self.timeout_s)
        self.selector.register(conn, selectors.EVENT_READ, m)
        if member.warms_up and m.role == "worker":
            # Only while a generation runs: one assembling would wait for the newcomer's trace.
            sizing = self.sizing if _workers(self.running) else None
            # The size the job will have once it joins, as things stand (a guess: jbps.size() in its warm-up).
            size = min(self.max_workers, len(_workers(self.running + self.ready + self.warming)) + 1)
            self._answer(m, {"sizing": sizing, "size": size})
            if sizing is not None:
                self.warming.append(m)
                log.info("%s registered from %s to warm up first (%d running)", m.role, peer[0], len(self.running))
                return
        self.ready.append(m)
        if not self.anyone_came:  # the first generation's members come within the timeout from now
            self.started, self.anyone_came = m.waiting_since, True
        log.info("%s registered from %s (%d running, %d waiting)", m.role, peer[0], len(self.running), len(self.ready))

    def _hear(self, m: ElasticMember) -> None:
        try:
            message = _recv(m.reader, self._name(m))
        except (OSError, ValueError, ConnectionError) as exc:
            self._drop(m, f"is gone: {exc}")
            return
        if message.get("done") and m.role == "worker":
            self.finished += 1
            self._drop(m, "finished")
        elif message.get("rates") and m in self.running and m.rank == 0 and m.generation == self.generation:
            self._keep_rates(message["rates"])
        elif isinstance(message.get("sizing"), str) and m in self.running and m.rank == 0:
            self.sizing = message["sizing"]
        elif message.get("ready") and m in self.warming:
            self.warming.remove(m)
            self.ready.append(m)
            m.waiting_since = time.monotonic()
            log.info("%s warmed up and waits to join", self._name(m))
        elif message.get("regroup") and m in self.running:
            m.holds = message.get("holds") is True
            self.running.remove(m)
            self.ready.append(m)
            m.waiting_since = time.monotonic()
            log.info("%s waits for the next generation", self._name(m))

    def _keep_rates(self, rates: dict) -> None:
        """The running generation's links' rates (rank 0 says them; every worker agreed on
        them), by server host, added to those of hosts measured before: a later generation
        whose servers are all on known hosts reuses them instead of probing the links again.
        Without per-server rates (one server, or their probe failed) a host's rate is None."""
        try:
            link = float(rates["link"])
            per_server = rates.get("servers")
            by_host: dict[str, float | None] = {}
            for address, rate in zip(self.addresses, per_server or [None] * len(self.addresses)):
                held = by_host.get(_host(address))
                by_host[_host(address)] = None if rate is None else min(float(rate), held or float("inf"))
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("ignored a malformed rates message: %s", exc)
            return
        known = self.rates
        if known is not None and known["per_server"] == (per_server is not None):
            by_host = {**known["hosts"], **by_host}  # hosts measured before and not now keep their rates
        self.rates = {"link": link, "hosts": by_host, "per_server": per_server is not None}

    def _known_rates(self, addresses: list[str]) -> dict | None:
        """What the workers of a generation with these servers are told of the links' rates,
        or None (they probe)."""
        known = self.rates
        if known is None or not all(_host(a) in known["hosts"] for a in addresses):
            return None
        servers = [known["hosts"][_host(a)] for a in addresses] if known["per_server"] else None
        return {"link": known["link"], "servers": servers}

    def _order(self, members: list[ElasticMember]) -> list[ElasticMember]:
        """The last generation's survivors in their order, those holding its state first (rank 0
        holds the last commit), then newcomers."""
        survivors = sorted(self._of_last_generation(members), key=lambda m: (not m.holds, m.rank))
        newcomers = [m for m in members if m not in survivors]
        newcomers.sort(key=lambda m: (m.worker_id is None, m.worker_id if m.worker_id is not None else 0))
        return survivors + newcomers

    def _assemble(self) -> None:
        workers = self._order(_workers(self.ready))[: self.max_workers]
        servers = [m for m in self.ready if m.role == "server"]
        generation, token = self.generation + 1, secrets.randbits(63) or 1
        worker_hosts = [m.host for m in workers]
        for rank, m in enumerate(workers):
            same_host = [w for w in workers if w.host == m.host]
            self._answer(
                m,
                {
                    "generation": generation,
                    "token": token,
                    "num_workers": len(workers),
                    "rank": rank,
                    "local_rank": same_host.index(m),
                    "local_size": len(same_host),
                },
            )
        for i, m in enumerate(servers):
            role = "colocated" if m.host in worker_hosts else "dedicated"
            self._answer(
                m, {"generation": generation, "token": token, "num_workers": len(workers), "role": role, "index": i}
            )
        members = workers + servers
        addresses = []
        for m in members:
            m.conn.settimeout(self.timeout_s)
            try:
                reply = _recv(m.reader, self._name(m))
                addresses.append(reply["address"])
            except (OSError, ValueError, ConnectionError, KeyError) as exc:
                # The others stop the servers they started and wait for the next try.
                self._drop(m, f"did not start its server for generation {generation}: {exc}")
                for other in members:
                    if other is not m and other in self.ready:
                        self._answer(other, {"retry": True})
                return
            finally:
                m.conn.settimeout(HELLO_TIMEOUT_S)
        self.generation, self.addresses = generation, addresses
        rates = self._known_rates(addresses)
        for rank, m in enumerate(members):
            self._answer(m, {"servers": addresses, "rates": rates} if m.role == "worker" else {"assembled": True})
            m.rank, m.generation, m.told_to_regroup = rank, generation, False
            self.ready.remove(m)
            self.running.append(m)
        log.info(
            "generation %d assembled: %d workers, %d dedicated servers, servers %s",
            generation,
            len(workers),
            len(servers),
            ",".join(addresses),
        )

    def _ready_to_assemble(self, now: float) -> bool:
        waiting = _workers(self.ready)
        if self.running or not waiting:
            return False
        if self.generation == 0:
            # The first waits for the job's size, then for its minimum.
            if len(waiting) >= self.num_workers and len(self.ready) - len(waiting) >= self.num_servers:
                return True
            return now - self.started >= self.timeout_s and len(waiting) >= self.min_workers
        # Only with a member of the last generation: its rank 0 broadcasts the last commit.
        return len(waiting) >= self.min_workers and bool(self._holders())

    def _holders(self) -> list[ElasticMember]:
        """The waiting workers of the last generation that hold its last commit (not a newcomer
        to it whose state broadcast failed: its state is the fresh one it was made with)."""
        return [m for m in self._of_last_generation(_workers(self.ready)) if m.holds]

    def _of_last_generation(self, members: list[ElasticMember]) -> list[ElasticMember]:
        return [m for m in members if m.generation == self.generation > 0]

    def _step(self, now: float) -> None:
        """What the scheduler does between messages."""
        running_workers = _workers(self.running)
        # Only a newcomer asks the running workers to regroup: one that left the running
        # generation (its psums failed) has peers whose psums fail too, and a notice sent to
        # a host that is cut off would only hold its connection's loss back (unacknowledged
        # data waits out retransmissions; an idle connection's keepalive notices sooner).
        newcomers = [m for m in self.ready if m.generation < self.generation or self.generation == 0]
        room = len(running_workers) < self.max_workers or any(m.role == "server" for m in newcomers)
        if newcomers and running_workers and room:
            for m in running_workers:
                if not m.told_to_regroup:
                    try:
                        self._answer(m, {"regroup": True})
                        m.told_to_regroup = True
                    except OSError as exc:
                        self._drop(m, f"is gone: {exc}")
        # A newcomer waits for the running generation's next commit, however far off; a member
        # that left the running generation (its psums failed, or its workers left) waits for the
        # others only as long as a psum may take: one still running then is hung or cut off.
        regrouped = [m.waiting_since for m in self._of_last_generation(self.ready)]
        if self.running and regrouped and now - min(regrouped) > self.timeout_s:
            for m in list(self.running):
                self._drop(m, f"said nothing for {self.timeout_s:g} s after the others regrouped: dropped")
        for m in list(self.ready):  # they wait without a bound of their own while the scheduler lives
            if now - m.told_waiting > self.timeout_s / 4:
                try:
                    self._answer(m, {"waiting": True})
                    m.told_waiting = now
                except OSError as exc:
                    self._drop(m, f"is gone: {exc}")
        if self._ready_to_assemble(now):
            self._assemble()
        enough = len(_workers(self.ready + self.running)) >= self.min_workers
        if self.generation > 0 and not self.running and not enough and _workers(self.ready):
            if self.short_since is None:
                self.short_since = now
            elif now - self.short_since > self.timeout_s:
                self._fail(
                    f"jbps scheduler {self.address}: {len(_workers(self.ready))} workers left, fewer than the job's "
                    f"minimum of {self.min_workers} (--min-workers), for {self.timeout_s:g} s (JBPS_TIMEOUT_S)"
                )
        else:
            self.short_since = None

    def _fail(self, message: str) -> None:
        self.members = [*self.ready, *self.running, *self.warming]  # those Scheduler._fail tells
        super()._fail(message)

    def _end(self) -> None:
        """The job is over: its servers stop waiting for another generation."""
        for m in list(self.ready + self.running + self.warming):
            try:
                self._answer(m, {"end": True})
            except OSError:
                pass
            self._drop(m, "told the job is over")

    def run(self) -> None:
        """Runs the job's generations until every worker has finished or
        gone; raises JbpsError (after telling every waiting member) if the job
        cannot go on."""
        self.started = time.monotonic()
        self.sock.settimeout(HELLO_TIMEOUT_S)
        self.selector.register(self.sock, selectors.EVENT_READ, None)
        while True:
            for key, _ in self.selector.select(_POLL_S):
                if key.data is None:
                    try:
                        self._accept()
                    except (socket.timeout, OSError):
                        pass
                else:
                    self._hear(key.data)
            now = time.monotonic()
            waiting = _workers(self.ready)
            if (
                self.generation == 0
                and now - self.started > assembly_wait_s(self.timeout_s, self.anyone_came)
                and len(waiting) < self.min_workers
            ):
                missing = f"{len(waiting)} of at least {self.min_workers} workers registered"
                self._fail(assembly_timed_out(self.address, self.timeout_s, self.anyone_came, missing))
            self._step(now)
            if self.generation > 0 and not _workers(self.running) and not self._holders():
                # Nobody holds the last commit: the job is over, or its state is lost. A newcomer
                # would broadcast its own fresh state as rank 0 and train the job again from it.
                late = len(_workers(self.ready))
                if self.finished:
                    log.info("job done: %d workers finished, over %d generations", self.finished, self.generation)
                    if late:
                        log.warning("%d worker(s) that came to join are told the job is over", late)
                    self._end()
                    return
                self._fail(
                    f"jbps scheduler {self.address}: every worker of generation {self.generation} is gone and none "
                    "finished: the state they committed is lost"
                    + (f" ({late} newcomer(s) cannot start from it)" if late else "")
                )
