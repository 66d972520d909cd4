"""Elastic training: a lost worker does not end the job, and a new one joins at a commit.

    state = jbps.elastic.State(params=params, opt_state=opt_state, step=0)

    @jbps.elastic.run
    def train(state):
        while state.step < steps:
            state.params, state.opt_state = update(state.params, state.opt_state, batch(state.step))
            state.step += 1
            state.commit()

    train(state)        # under `jbps run -n 3 --min-workers 2 --max-workers 4 python train.py`

As in Horovod's elastic mode: `run` calls the training function in the job's
current generation (jbps/scheduler/elastic.py). When a peer is lost, the
psums of the survivors fail; `run` rolls their state back to its last commit,
they regroup without the lost worker and the function is called again. A new
worker waits until the others' next commit, where they regroup with it (given
run(warm_up=...), it first traces its step, while the others train on). At the
start of a generation the state is broadcast from rank 0, which held the
last commit, so a newcomer starts from it; where every member holds the same
commit (the survivors of a loss, mostly) each goes on from its own, with no
broadcast. Each generation is a new job (new
token, plan and split for its size), so no sum mixes two memberships. After a
loss and at a join the survivors keep the programs they traced where none
depends on what changed (_keep_programs), and their chunk and bucket sizes with
them (a newcomer traces its own, its psums named as theirs whatever its order of
tracing, and sized as theirs); otherwise jax's caches are cleared and the step
is traced afresh.

Every worker commits at the same points of its loop (commit agrees, by a small
psum, on whether to regroup). What the state holds must be what the function
needs to go on from a commit: it is what survives a regroup.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from . import compile_cache, link_rate, runtime, sharding_words
from .host_broadcast import broadcast_arrays, broadcast_blob
from .partition.priority import INT64_MAX
from .config import Config
from .errors import JbpsError

log = logging.getLogger("jbps.elastic")

_PLAIN = (bool, int, float)  # kept as Python values, broadcast as arrays
_STARTS_TO_GIVE_UP = 3  # generations running that fail to start: then the cause is this worker's


class _Regroup(Exception):
    """Raised by State.commit when the generation regroups (a worker waits to join)."""


class State:
    """What training needs to go on after a membership change: named pytrees
    (params, optimizer state, the step, any extras), kept as attributes.
    commit() saves a host copy of them; a failed generation restores it."""

    _names: tuple[str, ...]
    _membership: Any  # the worker's Membership while a generation runs
    _committed: dict
    _placements: dict  # per value, each leaf's sharding at the last commit (None: on the host or one device)
    _rates_told: int  # the generation's rate-follower splits rank 0 has told the scheduler of
    _held: tuple[int, int]  # the generation this worker took the job's state in, and its commits since
    commits: int

    def __init__(self, **values: Any):
        if not values:
            raise JbpsError("jbps.elastic.State needs the values training goes on from, e.g. State(params=..., step=0)")
        object.__setattr__(self, "_names", tuple(values))
        object.__setattr__(self, "_membership", None)
        object.__setattr__(self, "_rates_told", 0)
        object.__setattr__(self, "commits", 0)
        object.__setattr__(self, "_held", (0, 0))
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._save()

    def _save(self) -> None:
        saved, placements = {}, {}
        for name in self._names:
            value = getattr(self, name)
            if isinstance(value, _PLAIN):
                saved[name] = value
                continue
            saved[name] = jax.tree_util.tree_map(np.array, jax.device_get(value))
            leaves = jax.tree_util.tree_leaves(value)
            # Across devices only: a single device's array comes back from the host as before (a jit
            # takes either without compiling again; one placed on a device would be committed to it).
            placements[name] = [
                leaf.sharding if isinstance(leaf, jax.Array) and len(leaf.sharding.device_set) > 1 else None
                for leaf in leaves
            ]
        object.__setattr__(self, "_committed", saved)
        object.__setattr__(self, "_placements", placements)

    def _placed(self, name: str, value: Any, roots: list | None = None) -> Any:
        """value (host arrays, the layout of name's) with each leaf placed as
        name's leaf was at the last commit, or where this worker has no such
        placement (a newcomer: its values came from the host), as the root's
        was (`roots`: sharding_words of each leaf). A step compiles for its
        inputs' placement: from host arrays, a pmap's or a sharded jit's first
        step of a generation would compile one program and the next another,
        for the step's own outputs, and the others would wait at that second step."""
        leaves, treedef = jax.tree_util.tree_flatten(value)
        own = self._placements.get(name) or [None] * len(leaves)
        roots = roots if roots is not None and len(roots) == len(leaves) else [None] * len(leaves)
        if len(own) != len(leaves):
            return value
        shardings = [s if s is not None else sharding_words.from_words(r) for s, r in zip(own, roots)]
        return jax.tree_util.tree_unflatten(
            treedef, [leaf if s is None else jax.device_put(leaf, s) for leaf, s in zip(leaves, shardings)]
        )

    def _placement_words(self) -> dict:
        """Each value's leaves' placements at the last commit, as sharding_words."""
        return {name: [sharding_words.to_words(s) for s in shardings] for name, shardings in self._placements.items()}

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._names:
            raise AttributeError(
                f"jbps.elastic.State has no value {name!r}: give it when the state is made "
                f"(it holds {', '.join(self._names)})"
            )
        object.__setattr__(self, name, value)

    def values(self) -> dict:
        return {name: getattr(self, name) for name in self._names}

    def commit(self) -> None:
        """Saves the state (waiting for the step's results); then, with every
        worker, regroups if a worker waits to join (the training function is
        called again, in the next generation, from this commit)."""
        self._save()
        object.__setattr__(self, "commits", self.commits + 1)
        object.__setattr__(self, "_held", (self._held[0], self._held[1] + 1))
        membership = self._membership
        if membership is not None:
            wanted = np.array([1.0 if membership.asked_to_regroup() else 0.0], np.float32)
            link_rate.psum_host(
                "jbps.elastic.commit",
                wanted,
                runtime.server_fractions(),
                link_rate.backstop_s(runtime.config().timeout_s),
                priority=INT64_MAX,  # ahead of the job's chunks: a few bytes
            )
            self._tell_learned_rates(membership)
            if wanted[0] > 0:
                raise _Regroup()

    def _tell_learned_rates(self, membership: Any) -> None:
        """On rank 0: the rates the generation's rate follower planned its latest
        split for, told to the scheduler, so that the next generation on these
        hosts starts from them rather than from the rates its hosts were first
        measured at (a link that slowed stays slow in the next generation's split)."""
        replans = runtime.replans()
        if runtime.config().worker_rank != 0 or len(replans) <= self._rates_told:
            return
        measured = runtime.measured_rates()
        if measured is not None and measured["servers"] is not None:
            # The rates its split was planned for, so the next generation's split is the same.
            membership.tell_rates({"link": measured["link"], "servers": list(replans[-1]["split_rates"])})
        object.__setattr__(self, "_rates_told", len(replans))

    def restore(self) -> None:
        """Sets every value back to the last commit."""
        for name, value in self._committed.items():
            object.__setattr__(
                self, name, value if isinstance(value, _PLAIN) else jax.tree_util.tree_map(np.array, value)
            )

    def layout(self) -> list[str]:
        """One line per leaf: its path, shape and dtype (what must agree across workers)."""
        lines = []
        for name, value in self.values().items():
            if isinstance(value, _PLAIN):
                lines.append(f"{name}: {type(value).__name__}")
                continue
            for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
                # As jax holds it: a fresh state's Python 0 and a trained one's int32 step agree.
                dtype = jax.dtypes.canonicalize_dtype(np.result_type(leaf))
                lines.append(f"{name}{jax.tree_util.keystr(path)}: {np.shape(leaf)} {dtype}")
        return lines

    def _check_like_root(self, root: int) -> dict:
        """JbpsError naming the first leaf where this worker's state differs
        from the root's (a worker joining with another model), before any of
        its values is broadcast. Returns the root's placements (each value's
        leaves' sharding_words), which come with its layout."""
        layout = "\n".join(self.layout())
        # Only the root's placements are read: the others send their layout alone.
        placements = json.dumps(self._placement_words()) if runtime.rank() == root else ""
        received = broadcast_blob((layout + "\0" + placements).encode(), root, "jbps.elastic.layout").decode(
            errors="replace"
        )
        theirs, _, placements = received.partition("\0")
        if theirs != layout:
            ours, root_lines = layout.split("\n"), theirs.split("\n")
            at = next((i for i, (a, b) in enumerate(zip(ours, root_lines)) if a != b), min(len(ours), len(root_lines)))
            here = ours[at] if at < len(ours) else "nothing"
            there = root_lines[at] if at < len(root_lines) else "nothing"
            raise JbpsError(
                f"jbps.elastic: this worker's state differs from the job's: it has {here} where rank {root} has "
                f"{there} (a worker joining with another model is refused; the job goes on without it)"
            )
        try:
            return json.loads(placements)
        except ValueError:  # a root of an older jbps sends its layout alone
            return {}

    def sync(self, root: int = 0) -> None:
        """Every worker takes the root's values (at the start of a generation),
        but for its own error-feedback residuals (_own_leaves), after checking
        that every worker's state has the root's layout. Host
        psums outside XLA (host_broadcast.py): nothing to compile while the
        others wait."""
        roots = self._check_like_root(root)
        values = self.values()
        plain = {n: type(v) for n, v in values.items() if isinstance(v, _PLAIN)}
        leaves, treedef = jax.tree_util.tree_flatten({n: np.asarray(v) if n in plain else v for n, v in values.items()})
        own = treedef.flatten_up_to({n: False if n in plain else _own_leaves(v) for n, v in values.items()})
        # In the dtypes jax holds them in (the layout the check compared): the same bytes on every worker.
        shared = [i for i, mine in enumerate(own) if not mine]
        arrays = [np.asarray(leaves[i], jax.dtypes.canonicalize_dtype(np.result_type(leaves[i]))) for i in shared]
        for i, taken in zip(shared, broadcast_arrays(arrays, root, "jbps.elastic.sync")):
            leaves[i] = taken
        tree = jax.tree_util.tree_unflatten(treedef, leaves)
        for name, value in tree.items():
            placed = plain[name](value.item()) if name in plain else self._placed(name, value, roots.get(name))
            object.__setattr__(self, name, placed)
        self._save()

    def _keep_own(self) -> None:
        """At a generation's start where every member holds the same commit
        (a loss: the survivors took the same state and applied the same sums
        since): each goes on from its own values, placed as at that commit, as
        sync would place the root's."""
        for name, value in self.values().items():
            if not isinstance(value, _PLAIN):
                object.__setattr__(self, name, self._placed(name, value))


def _own_leaves(value: Any) -> Any:
    """value's tree with True at the leaves each worker keeps its own of at a
    generation's start, False at those it takes from the root: the residuals
    of error feedback (jbps.optax's FeedbackState, onebit_adam's state) are
    what this worker's own encodings have not sent yet, so a survivor goes on
    with its own and a newcomer with those it brought (zeros, from init); the
    root's would count its unsent part once per worker and drop the others'."""
    kinds = tuple(
        getattr(sys.modules[module], kind)
        for module, kind in (("jbps.optax", "FeedbackState"), ("jbps.onebit_adam", "OneBitAdamState"))
        if module in sys.modules  # neither can be in a state before its module is imported
    )

    def mark(node: Any) -> Any:
        if not isinstance(node, kinds):
            return False
        fields = node._asdict()
        return type(node)(
            **{
                name: jax.tree_util.tree_map(lambda _: True, field) if name == "residuals" else _own_leaves(field)
                for name, field in fields.items()
            }
        )

    return jax.tree_util.tree_map(mark, value, is_leaf=lambda node: isinstance(node, kinds))


# Settings each generation's membership decides: not the worker's to give.
_DECIDED = ("servers", "num_workers", "num_servers", "local_rank", "local_size", "role", "colocated_servers")


def run(func: Callable | None = None, *, warm_up: Callable | None = None, **settings: Any) -> Callable:
    """Decorator: calls func(state, ...) in the elastic job until it returns,
    again after each membership change. Call the result on every worker.
    `@jbps.elastic.run(timeout_s=30, ...)` takes jbps.init's settings (over
    the environment's), but not the ones each generation decides (the servers,
    the number of workers): bad ones are named when the function is decorated.

    warm_up(state): runs the step ahead of a join and returns its outputs,
    e.g. `lambda state: step(state.params, state.opt_state, batch)` (or only
    compiles it: `step.lower(...).compile()`). A worker that joins a running
    job calls it with its own fresh state (the job's layout) before it asks to
    join, so the others do not wait for its first trace and run of the step
    (docs/guide/elastic.md). The step runs as a rehearsal: no engine runs yet,
    each psum sums this worker's devices only, the outputs are waited for and
    thrown away. jbps.size() in it is the size the job will have with this
    worker, as the scheduler sees it when the worker registers; rank() is not
    known yet (it raises JbpsError, and the step is traced at the join
    instead)."""
    if warm_up is not None and not callable(warm_up):
        raise JbpsError(f"jbps.elastic.run(warm_up=...) takes a function of the state, got {type(warm_up).__name__}")
    decided = sorted(set(settings) & set(_DECIDED))
    if decided:
        raise JbpsError(f"jbps.elastic.run() cannot take {', '.join(decided)}: each generation's membership decides")
    Config.resolve(settings, caller="jbps.elastic.run")  # names a bad setting here, not at the first generation
    if func is not None:
        return _elastic(func, settings, warm_up)
    return lambda f: _elastic(f, settings, warm_up)


def _runs_the_check() -> bool:
    return jax.local_device_count() >= 2 and jax.default_backend() == "cpu"


_CHECK: list = []  # [(the check's psum, compiled; its input)]
_CHECK_LOCK = threading.Lock()


def _the_check() -> tuple[Callable, np.ndarray]:
    """A psum over the local devices, compiled once (jax's caches, cleared at
    a generation's start, would not keep it), and its input: what
    _check_runtime_recovers runs."""
    with _CHECK_LOCK:
        if not _CHECK:
            zeros = np.zeros((jax.local_device_count(),), np.float32)
            _CHECK.append((jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i").lower(zeros).compile(), zeros))
        return _CHECK[0]


def _check_runtime_recovers(fault: str) -> None:
    """Raises, saying why, where this process's XLA runtime cannot run the
    next generation's steps. Some jax versions' CPU runtime (0.5.0: yes;
    0.10.2 and 0.12: no) chain a failed computation's error into every later
    computation with collectives across the local devices (as a psum over
    several local devices has): the worker's next step would fail with the
    lost generation's error. A psum of zeros over the local devices shows it."""
    if not _runs_the_check():
        return
    try:
        compiled, zeros = _the_check()
        jax.block_until_ready(compiled(zeros))
    except Exception as exc:  # XLA's runtime error, whatever its type in this jax
        raise JbpsError(
            f"jbps.elastic: after the fault ({fault}) jax {jax.__version__}'s CPU runtime fails every computation "
            f"across this worker's {jax.local_device_count()} local devices ({str(exc).splitlines()[0][:160]}), "
            "so this worker cannot go on: with several local CPU devices an elastic job needs jax 0.10.2 or newer "
            "(docs/limitations.md)"
        ) from None


_WARM_UP_BOUND_S = 30.0


def _warm_up(traced: threading.Event) -> None:
    """A fresh process's first trace pays once for jax's tracing and lowering
    machinery and for importing jbps's ops, and in a worker that joins a
    running job that first step holds every member's (about 20 ms of a 0.2 s
    join on 2 cores: docs/guide/elastic.md). Run in a thread while the process
    registers and waits for its first generation: traces and lowers (no
    compile) a psum over the local devices, as a step's pmap or shard_map does,
    and sets `traced`. Then compiles the check a loss runs (_the_check: about
    30 ms of each loss on 2 cores otherwise), which nothing waits for."""
    try:
        from .ops import psum  # noqa: F401  (imported on a step's first psum otherwise)

        n = jax.local_device_count()
        jax.pmap(lambda x: jax.lax.psum(x * 2.0 + 1.0, "i"), axis_name="i").lower(np.zeros((n, 8), np.float32))
    except Exception as exc:  # only time is at stake: the step traces as it would have
        log.debug("jbps.elastic: warming up the tracing failed: %s", exc)
    traced.set()
    try:
        if _runs_the_check():
            _the_check()
    except Exception as exc:  # only time is at stake: a loss compiles it then
        log.debug("jbps.elastic: compiling the runtime check failed: %s", exc)


def _what_members_hold(state: State) -> np.ndarray:
    """One row per member of this generation, by rank: the commit it holds
    (State._held: the generation it took the job's state in, its commits
    since), its programs' token (runtime.programs_token) and whether jax's
    persistent compilation cache is on in it. One host psum, each member
    adding its own row to zeros."""
    config = runtime.config()
    rows = np.zeros((config.num_workers, 7), np.int32)
    token = np.frombuffer(runtime.programs_token(), np.int32)
    rows[config.worker_rank] = [*state._held, *token, int(compile_cache.persistent_cache_on())]
    flat = rows.reshape(-1)
    link_rate.psum_host("jbps.elastic.held", flat, runtime.server_fractions(), link_rate.backstop_s(config.timeout_s))
    return flat.reshape(rows.shape)


def _hold_one_commit(held: np.ndarray) -> bool:
    """Whether every member took the job's state in the same generation and
    committed as often since (held: _what_members_hold's rows), as the
    survivors of a loss mostly do: they then hold the same values (each took
    the same state and applied the same sums), and none needs the root's. A
    newcomer, or a first generation, holds none taken (0)."""
    return bool(held[0, 0] > 0 and (held[:, :2] == held[0, :2]).all())


def _keep_programs(generation: int, tokens: np.ndarray, cached: np.ndarray) -> str:
    """What this member of the generation does with the programs it traced
    before (jax's caches), for the log. A psum's name does not depend on the
    order of tracing (runtime.auto_name), so a member may keep its programs
    while another traces afresh; what must agree is their chunk and bucket
    sizes. tokens: each member's runtime.programs_token, by rank. Where rank
    0's programs do not hold (a first generation, a trace read the size that
    changed), every member forgets its own and all lower with the generation's
    sizing. Else the members whose token is rank 0's keep theirs (after a loss
    all of them; at a join all but the newcomer), with their sizes
    (runtime.keep_programs), and the others forget theirs and lower with rank
    0's sizing, which it broadcasts where any member's token differs. That is
    where each of those has jax's persistent cache on (cached, by rank): its
    first step then loads the program; one without would compile it while the
    others wait in their first psum (up to the psum timeout), so then every
    member traces afresh and compiles beside it, as a first generation does."""
    if not tokens[0].any():
        runtime.forget_programs(generation)
        return "forgotten (traced again)"
    afresh = (tokens != tokens[0]).any(axis=1)  # the members whose programs are not rank 0's
    if afresh.any():
        if not cached[afresh].all():
            runtime.forget_programs(generation)
            return "forgotten (traced again: a member that traces afresh has no compilation cache)"
        sizing = broadcast_blob(runtime.programs_sizing().encode(), 0, "jbps.elastic.sizing").decode()
        if afresh[runtime.rank()]:
            runtime.forget_programs(generation, sizing)
            return "traced afresh (sized as rank 0's)"
    return "kept (sized for the links of the generation that traced them)" if runtime.keep_programs() else "kept"


def _trace_ahead(warm_up: Callable, state: State, requested: Config, sizing: str, size: int) -> None:
    """A newcomer's warm_up(state), run before it asks to join a running
    generation, its psums lowered with rank 0's `sizing` (the scheduler's):
    at the join its programs' token is then rank 0's, every member keeps its
    programs, and the newcomer's first step is the program it traced here.
    jbps.size() in it is `size`, the job's size with this worker as the
    scheduler saw it. A warm-up that reads the rest of the membership, or
    traces for a size the job does not have at the join, only costs the
    newcomer its time. One that runs the step runs it as a rehearsal (its
    psums sum this worker's devices only), and it is waited for, its
    outputs thrown away (_after_what_ran): what it assigns to the state is undone,
    and the state it was given, which the join replaces but for the
    residuals of error feedback (State.sync), must stay whole: a step that
    donates its arguments has to be given copies."""
    started = time.monotonic()
    given = state.values()
    try:
        with runtime.tracing_ahead(requested, sizing, size):
            jax.block_until_ready(warm_up(state))
            _after_what_ran()
    except JbpsError as exc:
        untraced = str(exc)
    else:
        untraced = ""
    finally:
        for name, value in given.items():
            object.__setattr__(state, name, value)
    _refuse_deleted_leaves(state)
    if untraced:
        log.warning(
            "jbps.elastic: warm_up could not trace the step before the join (%s): it is traced at the join", untraced
        )
        return
    log.info(
        "jbps.elastic: warmed up in %.2f s, for %d workers, before asking to join", time.monotonic() - started, size
    )


def _after_what_ran() -> None:
    """Returns once every program the warm-up ran is done, whether or not it
    kept their outputs: a psum call of one that came after this worker's
    engine started would be taken for the generation's. XLA runs a device's
    single-device programs in the order they were dispatched, and programs
    over several devices one at a time, in order (its PJRT clients), so a
    program of each kind run now and waited for comes after them all."""
    for device in jax.local_devices():
        jax.block_until_ready(_FENCE(jax.device_put(np.int32(0), device)))
    if jax.local_device_count() > 1:
        jax.block_until_ready(_FENCES(np.zeros((jax.local_device_count(),), np.int32)))


_FENCE = jax.jit(lambda x: x + 1)
_FENCES = jax.pmap(lambda x: x + 1)


def _refuse_deleted_leaves(state: State) -> None:
    """Raises, naming the first, where the warm-up left a leaf of the state
    deleted (a step that donates its arguments, run on the state itself): the
    join reads every leaf, and this worker could not join with it."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.values())[0]:
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise JbpsError(
                f"jbps.elastic.run's warm_up deleted the state's {jax.tree_util.keystr(path)} (a step that donates "
                "its arguments ran on the state itself): give it copies, e.g. jax.tree.map(jnp.copy, ...)"
            )


def _elastic(func: Callable, settings: dict, warm_up: Callable | None = None) -> Callable:
    """run's wrapper of func, its settings checked."""

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise JbpsError(
                f"{func.__name__}'s first argument must be a jbps.elastic.State, got {type(state).__name__}"
            )
        from .bootstrap.elastic import Membership

        if runtime.is_initialized():
            raise JbpsError("jbps.elastic.run starts the job itself: do not call jbps.init() before it")
        requested = Config.resolve(settings, caller="jbps.elastic.run")
        object.__setattr__(state, "_held", (0, 0))  # a state of an earlier job holds none of this one's commits
        # Before any compile of ours: a newcomer's first trace then loads the step's program.
        cache = compile_cache.use(requested.scheduler, requested.job_secret) if requested.scheduler else None
        traced = threading.Event()  # while this process registers and waits for its first generation
        warming = threading.Thread(target=_warm_up, args=(traced,), name="jbps-warm-up", daemon=True)
        warming.start()
        membership = None
        failed_starts = 0
        try:
            membership = Membership(requested, warms_up=warm_up is not None)
            if membership.job_sizing is not None:  # a running job: its members go on meanwhile
                _trace_ahead(warm_up, state, requested, membership.job_sizing, membership.job_size)
                membership.ready()
            while True:
                left = time.monotonic()
                config, hosted, job = membership.join()
                traced.wait(_WARM_UP_BOUND_S)  # at once after the first generation
                joined = time.monotonic()
                try:
                    runtime.start_member(requested, (config, hosted), job["rates"])
                except JbpsError as exc:
                    # A member left while the others connected or probed the links (a
                    # newcomer refused, a second loss): this generation ends before it began.
                    failed_starts += 1
                    if failed_starts > _STARTS_TO_GIVE_UP:
                        raise
                    log.warning("jbps.elastic: generation %d did not start (%s): regrouping", job["generation"], exc)
                    membership.leave_generation()
                    continue
                failed_starts = 0
                measured = runtime.measured_rates()
                if job["rank"] == 0 and job["rates"] is None and measured is not None:
                    membership.tell_rates(measured)
                object.__setattr__(state, "_membership", membership)
                object.__setattr__(state, "_rates_told", 0)
                started = time.monotonic()
                try:
                    held = _what_members_hold(state)
                    if _hold_one_commit(held):
                        state._keep_own()  # no broadcast: the survivors of a loss hold the same state
                        taken = f"kept (every member holds commit {held[0, 1]} of generation {held[0, 0]})"
                    else:
                        state.sync(root=0)
                        taken = "from rank 0"
                    membership.holds_state = True  # the root's last commit, whatever this worker had
                    object.__setattr__(state, "_held", (job["generation"], 0))
                    synced = time.monotonic()
                    programs = _keep_programs(job["generation"], held[:, 2:6], held[:, 6])
                    if job["rank"] == 0:  # what a newcomer that warms up traces its step with
                        membership.tell_sizing(runtime.programs_sizing())
                    log.info(
                        "jbps.elastic: generation %d, %d workers, rank %d: assembled in %.2f s, engine started "
                        "in %.2f s (links %s), state %s in %.2f s, programs %s",
                        job["generation"],
                        job["num_workers"],
                        job["rank"],
                        joined - left,
                        started - joined,
                        "measured before" if job["rates"] is not None else "probed" if measured else "not probed",
                        taken,
                        synced - started,
                        programs,
                    )
                    result = func(state, *args, **kwargs)
                except _Regroup:
                    log.info("jbps.elastic: regrouping at commit %d: a worker joins", state.commits)
                except Exception:
                    fault = runtime.engine_fault()
                    if not fault:
                        raise  # the training's own error, not the job's: it ends this worker
                    log.warning("jbps.elastic: %s: rolling back to the last commit and regrouping", fault)
                    state.restore()
                    _check_runtime_recovers(fault)
                else:
                    runtime.shutdown()  # waits for the others' last psums, as a job's end does
                    object.__setattr__(state, "_membership", None)
                    membership.finish()
                    return result
                object.__setattr__(state, "_membership", None)
                runtime.leave()
                membership.leave_generation()
        finally:
            object.__setattr__(state, "_membership", None)
            runtime.end_rehearsal()
            if runtime.is_initialized():
                runtime.leave()
            if membership is not None:
                membership.close()
            # A worker that ends early (its warm-up or training raised) must not exit while this
            # thread compiles: XLA crashes in a compile the interpreter's exit cuts short (jax 0.12).
            warming.join(_WARM_UP_BOUND_S)
            if cache is not None:
                cache.leave()

    return wrapper
