"""Process-wide state: init(), shutdown() and what they start."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
import threading
import time
import warnings

from .extension import load_core

_core = load_core()
# The rest after the extension, so that its absence is what an import error names.
from . import bootstrap, link_rate, replan, trace, unknown_settings  # noqa: E402
from .config import Config  # noqa: E402
from .errors import JbpsError, collapse_repeats, install_excepthook  # noqa: E402
from .partition import defaults  # noqa: E402
from .partition import server_fractions as _fractions_for_roles  # noqa: E402

FFI_TARGET = "jbps_psum"
JOIN_TARGET = "jbps_join"  # releases a bucketed psum's sums together (ops/ffi.py)
# The codecs' workers' half on XLA:CPU only (ops/onebit.py, ops/topk.py).
TOPK_ENCODE_TARGET, TOPK_DECODE_TARGET = "jbps_topk_encode", "jbps_topk_decode"
ONEBIT_ENCODE_TARGET, ONEBIT_DECODE_TARGET = "jbps_onebit_encode", "jbps_onebit_decode"
# What a psum with error feedback runs on XLA:CPU (ops/psum_primitive.py): the
# encoders that add the gradient to the residual, and the decoders into a buffer.
TOPK_ENCODE_ADDED_TARGET, TOPK_DECODE_INTO_TARGET = "jbps_topk_encode_added", "jbps_topk_decode_into"
ONEBIT_ENCODE_ADDED_TARGET, ONEBIT_DECODE_INTO_TARGET = "jbps_onebit_encode_added", "jbps_onebit_decode_into"
# The 16-bit compressions' casts on XLA:CPU (ops/compression.py).
NARROW_TARGET, WIDEN_TARGET = "jbps_narrow", "jbps_widen"
# The start of an uncaught exception's message that a goodbye carries to the servers.
_REASON_CHARS = 300
_EXIT_GRACE_S = 0.5  # at exit, for threads woken by the psums the stop failed
_lock = threading.Lock()
_ffi_lock = threading.Lock()  # apart from _lock: init() registers while holding it
_config: Config | None = None
_requested: Config | None = None  # what init() was asked, before a bootstrap filled it in
_hosted: list = []  # summation servers this process runs (mpirun's colocated servers)
_fractions: tuple[float, ...] = ()
_spans_hosts = False
_link_rate: float | None = None  # bytes/s of the busiest link, measured at init across hosts
_server_rates: tuple[float, ...] | None = None  # bytes/s of each server's link, measured with it
_nic_share = 1.0  # bytes the busiest NIC carries per byte of a psum (link_rate.busiest_nic_share)
_outlives_membership = False  # programs_outlive_membership()
_follower: replan.Follower | None = None  # re-plans the split as links change (replan.py)
_ffi_registered = False
_atexit_registered = False
# What this process's traced programs assume of the membership, so that an elastic job keeps
# them across a generation where it still holds (programs_token; forget_programs clears them).
_traced_reads: dict[str, int] = {}  # rank(), size(), ... as read while jax traced
_programs_epoch: int | None = None  # the generation that last forgot them; None: none did
_ahead: Config | None = None  # while a newcomer traces its step before it joins (tracing_ahead)


@dataclasses.dataclass(frozen=True)
class _Sizing:
    """What a psum's default chunk and bucket sizes follow (partition/defaults.py)."""

    fractions: tuple[float, ...] = ()
    across: bool = False
    link_rate: float | None = None
    nic_share: float = 1.0


_sizing = _Sizing()  # the sizes psums are lowered with now: this job's start's, or the kept programs'
# The sizing the held programs were lowered with (the generation that last forgot them):
# an elastic generation that keeps them (keep_programs) lowers with it too, so that a psum
# first traced then is sized as the others were and the chunks of the members' programs agree.
_programs_sizing: _Sizing | None = None


class Session:
    """What init() returns; usable as a context manager that shuts down on exit."""

    def __init__(self, config: Config):
        self.config = config

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        shutdown()

    def __repr__(self) -> str:
        return f"jbps.Session({self.config})"


def has_cuda_support() -> bool:
    """Whether this build of jbps has the CUDA handler (built when the CUDA
    toolkit was found at install time, or JBPS_CUDA=1). It says nothing about
    whether this machine has a GPU."""
    return bool(_core.has_cuda())


def register_ffi_targets() -> None:
    """Registers jbps's custom call targets with jax (once; init() does, and
    so do the ops that lower to them without a session, topk's codec)."""
    # ffi_call looks its target up per platform, so with both registered
    # jbps.psum runs on whichever backend the computation is placed on.
    # Registering for "CUDA" needs no GPU: jax keeps it for a CUDA backend.
    import jax  # here: `import jbps` loads no jax (servers, the scheduler and `jbps run` need none)

    global _ffi_registered
    with _ffi_lock:
        if not _ffi_registered:
            for name, capsule in _core.ffi_targets().items():
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
            for name, capsule in _core.ffi_targets_cuda().items():
                jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
            _ffi_registered = True


def init(**overrides) -> Session:
    """Starts this process's engine and connects to every summation server.

    Calling init again with no keywords, or with the same settings, while
    initialized is a no-op; different settings raise JbpsError (call
    shutdown() first).
    """
    return _start(Config.resolve(overrides))


def start_member(requested: Config, joined: tuple[Config, list], rates: dict | None = None) -> Session:
    """init() for a job whose membership was found outside the bootstraps
    (an elastic generation, jbps/elastic.py): `joined` is the config and the
    servers this process hosts. `rates`: the links'
    rates an earlier generation on the same hosts measured ({"link": bytes/s,
    "servers": bytes/s per server or None}), the same on every member, which
    then skip the link probe. The programs traced before stay (forget_programs
    clears jax's caches where they do not hold)."""
    return _start(requested, joined, rates)


def programs_outlive_membership() -> bool:
    """Whether this process's programs must not depend on the membership they
    were traced in (an elastic job's: jbps.elastic.run). Then a psum's program
    routes its chunks to no server (the engine deals them by the generation's
    split, engine_set_dealt_split) and a mean divides by the worker count read
    when it runs (jbps_workers), so that a later generation traces the same
    program text, which jax's compilation cache then gives instead of a compile."""
    config()
    return _outlives_membership


def measured_rates() -> dict | None:
    """The links' rates this job's start measured or was given (None when it
    measured none: on one host), in the form
    start_member takes."""
    if _link_rate is None:
        return None
    return {"link": _link_rate, "servers": list(_server_rates) if _server_rates is not None else None}


def _start(requested: Config, joined: tuple[Config, list] | None = None, rates: dict | None = None) -> Session:
    global _config, _requested, _hosted, _fractions, _spans_hosts, _link_rate, _server_rates, _nic_share
    global _atexit_registered, _follower, _outlives_membership, _sizing
    with _lock:
        if _config is not None:
            if requested != _requested:
                raise JbpsError("jbps is already initialized with different settings; call jbps.shutdown() first")
            _raise_fault()
            return Session(_config)
        register_ffi_targets()
        # Misspelled settings are named before the bootstrap, which may wait for a scheduler.
        unknown_settings.warn(
            lambda line: warnings.warn(line, RuntimeWarning, stacklevel=5), local_rank=requested.local_rank or 0
        )
        config, hosted = joined if joined is not None else bootstrap.complete(requested)
        across = defaults.spans_hosts(config.servers)
        replannable = across and len(config.servers) > 1  # the split may move as links change (replan.py)
        # Until the servers' roles are known, the window as if every server got bytes (the most).
        credit = config.scheduling_credit or defaults.credit([1.0] * len(config.servers), across)
        try:
            _core.engine_start(
                list(config.servers),
                config.worker_rank,
                config.num_workers,
                config.job_token,
                credit,
                config.timeout_s,
                trace=config.trace_dir is not None,
                shm=config.shm,
                shm_slot_bytes=config.partition_bytes or defaults.largest_partition_bytes(across),
                huge_pages=config.huge_pages,
                routes_can_change=replannable,
            )
        except RuntimeError as exc:
            for server in hosted:
                server.stop()
            raise JbpsError(f"jbps.init() failed: {exc}") from None
        _core.cuda_set_timeout(config.timeout_s)
        roles = _core.engine_server_roles()
        _fractions = tuple(_fractions_for_roles(roles, config.num_workers))
        _spans_hosts = across
        credit_given = config.scheduling_credit is not None
        credit = config.scheduling_credit if credit_given else _set_default_credit(_fractions, across)
        config = dataclasses.replace(config, scheduling_credit=credit)
        _link_rate, _server_rates = None, None
        if across:
            # Each server's own link: servers on slower links get less (rated_split.py);
            # and the busiest one, which the default chunks fit (partition/defaults.py).
            # Measured whatever the chunk size: a user's JBPS_PARTITION_BYTES (BytePS's
            # users set it) must not hand a slow spare host an equal share.
            try:
                if rates is not None:
                    _link_rate = float(rates["link"])
                    given = rates.get("servers")
                    _server_rates = tuple(map(float, given)) if given and len(given) == len(roles) else None
                else:
                    _link_rate = link_rate.measure(roles, _fractions, config.num_workers, config.timeout_s)
                    if _link_rate is not None and len(roles) > 1:
                        _server_rates = tuple(
                            link_rate.server_rates(roles, config.num_workers, _link_rate, config.timeout_s)
                        )
                if _server_rates is not None:
                    rated = link_rate.fractions_for_rates(roles, _server_rates, config.num_workers)
                    if rated is not None:
                        _fractions = tuple(rated)
                        # The chunks fit the slowest link that carries any: the busiest-link
                        # probe ran on the equal split, where a server now left out set the pace.
                        _link_rate = min(r for r, f in zip(_server_rates, _fractions) if f > 0)
                        if not credit_given:
                            config = dataclasses.replace(
                                config, scheduling_credit=_set_default_credit(_fractions, across)
                            )
            except BaseException as exc:  # a failed probe, or Ctrl-C: nothing left running
                # The servers hear why, unless the job's fault (another's) is the cause.
                _core.engine_stop("" if _core.engine_fault() else f"its link probe at jbps.init failed: {exc}")
                for server in hosted:
                    server.stop()
                if isinstance(exc, RuntimeError):
                    raise JbpsError(f"jbps.init() failed measuring the network: {exc}") from None
                raise
        _nic_share = link_rate.busiest_nic_share(roles, _fractions, config.num_workers)
        _sizing = _Sizing(_fractions, across, _link_rate, _nic_share) if across else _Sizing()  # one host: fixed sizes
        if replannable and config.follow_rates:
            # bytes/s: they size the follower's probes (only their ratios move the split)
            planned = _server_rates if _server_rates is not None else (_link_rate or 1.0,) * len(roles)
            _follower = replan.Follower(
                replan.RateFollower(roles, config.num_workers, planned, _fractions, config.timeout_s),
                config.worker_rank,
                config.num_workers,
                config.timeout_s,
            )
        _outlives_membership = joined is not None  # start_member's: an elastic generation
        if _outlives_membership:
            try:
                _core.engine_set_dealt_split(list(_fractions))
            except ValueError as exc:  # not for a split jbps computed: nothing left running
                _core.engine_stop(f"its split was refused: {exc}")
                for server in hosted:
                    server.stop()
                raise JbpsError(f"jbps.init() failed: {exc}") from None
        _config, _requested, _hosted = config, requested, hosted
        from . import cpu_loop_deadlock  # it imports jax

        cpu_loop_deadlock.warn_if_affected(config.local_rank)
        install_excepthook()
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
        return Session(config)


def _set_default_credit(fractions, across: bool) -> int:
    """The engine's window for this split (partition/defaults.py), set; returned."""
    credit = defaults.credit(fractions, across)
    _core.engine_set_credit(credit)
    return credit


def shutdown() -> None:
    """Stops the engine; pending psums fail with an error. Writes the trace
    when tracing (JBPS_TRACE_DIR). Safe to call twice."""
    _shutdown("")


def _uncaught_exception() -> str:
    """Why the interpreter is exiting, if an uncaught exception ends it:
    Python keeps it in sys.last_exc (sys.last_value before 3.12) after
    printing its traceback, before the exit handlers run."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None or _core.engine_fault():
        # After a job fault the exception is most likely its consequence: the
        # servers heard the cause from whoever caused it, and a plain goodbye
        # keeps them from blaming this worker instead.
        return ""
    text = collapse_repeats(str(exc)).strip().splitlines()
    first = text[0] if text else ""
    if len(first) > _REASON_CHARS:
        first = first[:_REASON_CHARS] + "..."
    return f"it exited with an uncaught exception: {type(exc).__name__}" + (f": {first}" if first else "")


def _shutdown_at_exit() -> None:
    # The servers hear why this worker leaves, and tell the other workers at
    # once, naming it, instead of leaving them to time out in their next psum.
    others = [t for t in threading.enumerate() if t is not threading.current_thread()]
    _shutdown(_uncaught_exception())
    # A thread that waited on a psum the stop failed wakes up inside jaxlib and
    # returns to Python: let it end now. Once the interpreter finalizes, such a
    # thread is ended by a forced unwind through jaxlib's C++ frames, which
    # aborts the process ("FATAL: exception not rethrown"). Bounded, for
    # threads that never end.
    deadline = time.monotonic() + _EXIT_GRACE_S
    while time.monotonic() < deadline and any(t.is_alive() for t in others):
        time.sleep(0.005)


def leave() -> None:
    """Stops the engine and this process's servers at once, without waiting
    for the other workers' goodbyes: an elastic worker leaving its generation
    (jbps/elastic.py), whose peers leave it too or have already failed."""
    _shutdown("", wait_for_peers=False)


def engine_fault() -> str:
    """Why the job failed (a lost worker or server, a timeout), or ""."""
    return _core.engine_fault() if _config is not None else ""


def _shutdown(reason: str, wait_for_peers: bool = True) -> None:
    global _config, _requested, _hosted, _follower
    with _lock:
        if _config is None:
            return
        follower, _follower = _follower, None
        if follower is not None:
            follower.stop()
        _core.engine_stop(reason)
        if follower is not None:
            follower.join(_config.timeout_s)  # its psum failed with the stop, or returned
        if _config.trace_dir is not None:
            trace.write_trace(_core.engine_take_trace(), _config.trace_dir, _config.worker_rank)
        # Servers this process hosts serve the other workers until they are
        # done too (each says goodbye), or the timeout passes.
        for server in _hosted:
            if wait_for_peers:
                server.wait(_config.timeout_s)
            server.stop()
        _config, _requested, _hosted = None, None, []


def _raise_fault() -> None:
    fault = _core.engine_fault()
    if fault:
        raise JbpsError(f"{fault} (the job has failed: call jbps.shutdown(), then jbps.init() for a new job)")


def check() -> None:
    """Raises JbpsError if the job has failed: a summation server was lost, or
    a server reported a lost worker (the message names it). Every pending and
    later psum fails with the same message, as XLA's runtime error; check()
    gives it as JbpsError. Does nothing before init()."""
    if _config is not None:
        _raise_fault()


def is_initialized() -> bool:
    return _config is not None


def config() -> Config:
    """The active configuration; raises JbpsError before init() (but for what
    a newcomer asked for while it traces ahead of its join: tracing_ahead)."""
    if _config is None:
        if _ahead is not None:
            return _ahead
        raise JbpsError("jbps is not initialized: call jbps.init() first")
    return _config


def config_for_psum() -> Config:
    """config(), and JbpsError if the job has failed: tracing a new psum then
    names the lost peer at once."""
    active = config()
    if _config is not None:  # tracing ahead of a join (tracing_ahead) no engine runs: nothing failed
        _raise_fault()
    return active


def rank() -> int:
    """This worker process's rank, 0 .. size()-1."""
    return _membership("rank")


def size() -> int:
    """Number of worker processes in the job."""
    return _membership("size")


def local_rank() -> int:
    """This worker's rank among the worker processes on its host."""
    return _membership("local_rank")


def local_size() -> int:
    """Number of worker processes on this host (as in Horovod; the local
    devices a worker reduces over are jax.local_device_count())."""
    return _membership("local_size")


# The membership's values a program may read, and their fields in Config.
_MEMBERSHIP = {"rank": "worker_rank", "size": "num_workers", "local_rank": "local_rank", "local_size": "local_size"}


def _membership(what: str) -> int:
    # While a newcomer traces ahead of its join (tracing_ahead), size() is the size the job will
    # have with it, as the scheduler saw it (a guess programs_token checks at the join, as it checks
    # any value a trace read); its rank and host's numbers are not known until the generation assembles.
    if _config is None and _ahead is not None and what != "size":
        raise JbpsError(
            f"jbps.{what}() is not known while jbps.elastic.run's warm_up runs: the generation this worker "
            "joins is not assembled yet (jbps.size() is: the size the job will have with it)"
        )
    return note_traced_read(what, getattr(config(), _MEMBERSHIP[what]))


def _tracing() -> bool:
    """Whether jax is tracing a function in this thread (True where this jax
    cannot tell: a read then counts as baked in)."""
    core = sys.modules.get("jax._src.core")
    if core is None:  # jax not imported: nothing traces
        return False
    clean = getattr(core, "trace_state_clean", None)
    return True if clean is None else not clean()


def note_traced_read(what: str, value: int) -> int:
    """value, remembered as what `what` was when a program read it while
    jax traced it: a program that baked it in holds only while it stays."""
    if what not in _traced_reads and _tracing():
        _traced_reads[what] = value
    return value


def programs_token() -> bytes:
    """16 bytes, the digest of the chunk and bucket sizing this process's
    programs were lowered with (programs_sizing), where they all still hold for
    this elastic generation; zeros where they do not: none were traced since a
    generation forgot them, a value a trace read (rank, size, ...) changed, or
    the job crossed hosts where its programs did not, or the other way round.
    A psum's name does not depend on the order its process traced it
    (auto_name), so members that traced in other orders (a newcomer) still
    agree; their psums' chunks agree where they were lowered with the same
    sizing. elastic.py keeps the programs of the members whose token is the
    root's, and the others forget theirs and lower with the root's sizing."""
    now = config()
    if (
        _programs_epoch is None
        or any(getattr(now, _MEMBERSHIP[what]) != value for what, value in _traced_reads.items())
        or (_programs_sizing is not None and _programs_sizing.across != _spans_hosts)
    ):
        return bytes(16)
    return hashlib.blake2b(programs_sizing().encode(), digest_size=16).digest()


def programs_sizing() -> str:
    """The sizing this process's programs were lowered with, as words
    (forget_programs takes them): the generation's own where none were."""
    config()
    return json.dumps(dataclasses.asdict(_programs_sizing or _sizing), sort_keys=True)


def keep_programs() -> bool:
    """This elastic generation goes on with the programs its members hold
    (every member's programs_token was the same): psums lowered from now on
    are sized as those were, whatever this generation's links and split would
    give (any chunk size sums right: the engine deals the chunks by the
    generation's split). Whether that sizing differs from the generation's own."""
    global _sizing
    config()
    own, _sizing = _sizing, _programs_sizing or _sizing
    return _sizing != own


def forget_programs(generation: int, sizing: str | None = None) -> None:
    """Clears jax's caches, so that this member traces its programs afresh
    for this elastic generation, lowered with `sizing` (programs_sizing's
    words of the members that keep theirs), else with the generation's own."""
    import jax

    global _programs_epoch, _programs_sizing, _sizing
    config()
    if _programs_epoch is not None:
        # What a process traced before its first generation holds no psum and no value of the
        # membership (both need the job): jax's caches keep it, and a newcomer's first trace of the
        # step reuses what its model's init traced (jnp's inner jits).
        jax.clear_caches()
    _traced_reads.clear()
    if sizing is not None:
        _sizing = _sizing_of(sizing)
    _programs_sizing = _sizing  # this generation's own (start_member's), or the keepers'
    _programs_epoch = generation


def _sizing_of(words: str) -> _Sizing:
    """programs_sizing's words, as the sizing they were made of."""
    fields = json.loads(words)
    return _Sizing(**{**fields, "fractions": tuple(fields["fractions"])})


@contextlib.contextmanager
def tracing_ahead(requested: Config, sizing: str, size: int):
    """A newcomer to a running elastic job traces its step here before it
    asks to join (jbps.elastic.run's warm_up), so that the others do not wait
    for that trace: psums traced inside are lowered as the members' programs
    were (`sizing`: rank 0's programs_sizing, from the scheduler) and for no
    membership in particular (programs_outlive_membership), so at the join
    this process's programs_token is rank 0's and it keeps them. `requested`
    gives the user's settings (chunk and bucket sizes given). size() is
    `size`, the job's size once this worker joins as the scheduler saw it (a
    trace that read it holds only if the generation has that size:
    programs_token); rank() and the host's numbers raise JbpsError, as the
    generation is not assembled yet. A step run inside is a rehearsal (the
    engine's): its psums sum this worker's devices only, sending nothing, so
    the first execution of its programs, slower than the next, is paid here
    too. The rehearsal lasts until the engine starts (a late call of it is
    then still one) or the body raises; where it raises, what it traced is
    forgotten."""
    import jax

    global _ahead, _outlives_membership, _sizing, _spans_hosts, _programs_sizing, _programs_epoch
    sized = _sizing_of(sizing)
    with _lock:
        if _config is not None or _ahead is not None:
            raise JbpsError("jbps.elastic.run's warm_up runs before the job starts, and jbps is running")
        register_ffi_targets()
        # Not the launcher's numbers: the generation decides them (elastic._DECIDED); its size as foreseen.
        ahead = dataclasses.replace(requested, num_workers=size, worker_rank=None, local_rank=None, local_size=None)
        _ahead, _outlives_membership = ahead, True
        _sizing, _spans_hosts = sized, sized.across
        _traced_reads.clear()
        _core.engine_set_rehearsal(size)
    try:
        yield
        _programs_sizing, _programs_epoch = sized, 0  # what the join compares (programs_token)
    except BaseException:
        end_rehearsal()
        jax.clear_caches()  # nothing lowered for the job before it is known whose sizing holds
        raise
    finally:
        with _lock:
            _ahead, _outlives_membership, _sizing, _spans_hosts = None, False, _Sizing(), False


def end_rehearsal() -> None:
    """Ends the rehearsal a tracing_ahead left on, where this worker's engine
    never started (it ends it when it starts): a psum this process runs later
    without an engine must fail, not sum its own devices alone."""
    _core.engine_set_rehearsal(0)


def engine_stats() -> dict:
    """Counters of this process's engine (bytes pushed/pulled, calls, chunks; per
    server, in JBPS_SERVERS order: bytes pushed, pulled and acknowledged, and the
    seconds some push to it waited for its acknowledgement)."""
    return dict(_core.engine_stats())


def server_fractions() -> tuple[float, ...]:
    """Share of the bytes each server owns (in JBPS_SERVERS order), from the
    roles the servers declared, the worker count and, across hosts, the links'
    rates jbps.init measured: the optimal split."""
    config()
    return _fractions


def partition_bytes(call_bytes: int) -> int:
    """The largest chunk of a psum of `call_bytes`: the user's JBPS_PARTITION_BYTES,
    else the default for where the job runs (jbps/partition/defaults.py)."""
    given = config().partition_bytes
    if given is not None:
        return given
    return defaults.partition_bytes(call_bytes, _sizing.fractions, _sizing.across, _sizing.link_rate)


def bucket_bytes(tree_bytes: int) -> int:
    """The size of the buckets a psum of `tree_bytes` goes in: the user's
    JBPS_BUCKET_BYTES, else the default for where the job runs and its
    link's measured rate (jbps/partition/defaults.py)."""
    given = config().bucket_bytes
    if given is not None:
        return given
    return defaults.bucket_bytes(tree_bytes, _sizing.across, _sizing.link_rate, _sizing.nic_share)


def nic_share() -> float:
    """Bytes the busiest NIC carries (one direction) per byte of a worker's psum,
    for the split in use (link_rate.busiest_nic_share)."""
    config()
    return _nic_share


def link_bytes_per_s() -> float | None:
    """The link rate the default chunks are sized for, the same on every
    worker: the busiest link's as jbps.init measured it (link_rate.py), or,
    where servers on slower links get less, the slowest rate among the servers
    that get bytes; None on one host or with JBPS_PARTITION_BYTES set."""
    config()
    return _link_rate


def replans() -> list[dict]:
    """The splits the rate follower (replan.py) announced in this job so far:
    epoch, fractions (in JBPS_SERVERS order), the rates (bytes/s) the follower
    took the servers to run at, and the rates the split was planned for
    (split_rates: a slowed server's at a shade of its rate)."""
    return list(_follower.epochs) if _follower is not None else []


def server_rates() -> tuple[float, ...] | None:
    """Each server's link rate (bytes/s each way, in JBPS_SERVERS order) as
    jbps.init measured it, the same on every worker; None on one host or with
    JBPS_PARTITION_BYTES set (no measurement). server_fractions() follows
    them when they differ by more than the probe's error."""
    config()
    return _server_rates


def spans_hosts() -> bool:
    """Whether the job's bytes cross a network (defaults.spans_hosts of its servers): then a
    psum is a pipeline across hosts, and large shards' ends go in pieces (plan.chunk_sizes)."""
    config()
    return _spans_hosts


def auto_name(prefix: str, *signature: object) -> str:
    """A name for an unnamed psum (broadcast, optimizer): `prefix.` and a
    digest of what it is, the same on every worker whatever the order its
    process traced its programs in (an elastic job's newcomer traces in its
    own, and the others keep theirs): where it is called from (the first frame
    outside jbps and jax: file name, line, function) and its signature (the
    tree's paths, shapes and dtypes, how it travels). Two places of one name in
    a program get names of their own where it is lowered (ops/places.py); two
    programs with a psum of one name share its keys, as one program run twice
    does: a worker's calls pair with the others' in the order it dispatches
    them, the same on every worker of one training loop."""
    site = _call_site()
    text = repr((prefix, site, signature))
    return f"{prefix}.{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}"


@functools.cache
def _own_dirs() -> tuple[str, ...]:
    """The directories of jbps, jax and jaxlib (imported by the first psum traced), once."""
    import jax
    import jaxlib

    return tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (sys.modules[__package__], jax, jaxlib))


def _call_site() -> str:
    """The first frame of the caller's stack outside jbps, jax and jaxlib, as
    file name (no directory: hosts install alike in other places), line and
    function; "" where there is none."""
    own_dirs = _own_dirs()
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(own_dirs):
            return f"{os.path.basename(path)}:{frame.f_lineno}:{frame.f_code.co_name}"
        frame = frame.f_back
    return ""
