"""The Python API in one process: a single worker against a real server on
loopback, with 4 host devices. With one worker the sum over the job is the
sum over local devices, so numpy gives the reference."""

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jbps
from benchmarks.emulated_job import JOB_VARIABLE_PREFIXES
from conftest import job_free_env
from jbps import _core

L = 4


def device_sum(x):
    return np.asarray(x).sum(axis=0)


def shard_map_fn():
    fn = getattr(jax, "shard_map", None)
    if fn is None:
        from jax.experimental.shard_map import shard_map as fn
    return fn


def test_local_device_count():
    assert jax.local_device_count() == L


def test_rank_size_local_size(session):
    assert (jbps.rank(), jbps.size(), jbps.local_rank(), jbps.local_size()) == (0, 1, 0, 1)


@pytest.mark.parametrize("shape", [(), (1,), (3,), (5, 3), (2, 3, 7), (4097,)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32])
def test_pmap_shapes_and_dtypes(session, shape, dtype):
    rng = np.random.default_rng(sum(shape) + 7)
    x = rng.integers(-50, 50, size=(L,) + shape).astype(dtype)  # exact in every dtype
    out = jax.pmap(lambda t: jbps.psum(t, "i"), axis_name="i")(x)
    assert out.dtype == x.dtype and out.shape == x.shape
    for d in range(L):
        np.testing.assert_array_equal(np.asarray(out[d], np.float64), device_sum(np.asarray(x, np.float64)))


def test_float64_under_x64(session):
    jax.config.update("jax_enable_x64", True)
    try:
        x = np.random.default_rng(1).standard_normal((L, 33))
        out = jax.pmap(lambda t: jbps.psum(t, "i"), axis_name="i")(x)
        assert out.dtype == np.float64
        np.testing.assert_allclose(np.asarray(out[2]), device_sum(x), rtol=1e-12)
    finally:
        jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128])
def test_complex_leaves_sum_real_and_imaginary_parts_as_numpy(session, dtype):
    x64 = dtype == np.complex128
    jax.config.update("jax_enable_x64", x64)
    try:
        rng = np.random.default_rng(5)
        x = (rng.standard_normal((L, 3, 5)) + 1j * rng.standard_normal((L, 3, 5))).astype(dtype)
        out = jax.pmap(lambda t: jbps.psum(t, "i"), axis_name="i")(x)
        assert out.dtype == dtype and out.shape == x.shape
        np.testing.assert_allclose(np.asarray(out[1]), device_sum(x), rtol=1e-12 if x64 else 1e-5)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_bools_are_counted_as_lax_psum_counts_them(session):
    x = np.random.default_rng(6).integers(0, 2, size=(L, 7)).astype(bool)
    total, mean = jax.pmap(lambda t: (jbps.psum(t, "i"), jbps.pmean(t, "i")), axis_name="i")(x)
    assert total.dtype == np.int32 and mean.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(total[0]), x.sum(axis=0))
    np.testing.assert_allclose(np.asarray(mean[0]), x.mean(axis=0), rtol=1e-6)


def test_empty_leaves_and_empty_tree(session):
    tree = {"e": jnp.zeros((L, 0, 3)), "x": jnp.ones((L, 2))}
    out = jax.pmap(lambda t: jbps.psum(t, "i"), axis_name="i")(tree)
    assert out["e"].shape == (L, 0, 3)
    np.testing.assert_array_equal(np.asarray(out["x"]), np.full((L, 2), L))
    assert jbps.psum({}) == {}


def test_nested_tree_structure_is_kept(session):
    tree = {
        "a": [jnp.ones((L, 2)), (jnp.arange(L * 3.0).reshape(L, 3), None)],
        "b": {"c": jnp.full((L,), 2, jnp.int32)},
    }
    out = jax.pmap(lambda t: jbps.psum(t, "i"), axis_name="i")(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    np.testing.assert_array_equal(np.asarray(out["a"][1][0][0]), device_sum(np.arange(L * 3.0).reshape(L, 3)))
    np.testing.assert_array_equal(np.asarray(out["b"]["c"]), np.full((L,), 2 * L))


def test_plain_jit_without_axis(session):
    tree = {"s": jnp.float32(3.5), "v": jnp.arange(10, dtype=jnp.int32)}
    out = jax.jit(lambda t: jbps.psum(t))(tree)
    assert float(out["s"]) == 3.5
    np.testing.assert_array_equal(np.asarray(out["v"]), np.arange(10))


def test_shard_map(session):
    mesh = Mesh(np.array(jax.devices()), ("i",))
    x = np.random.default_rng(2).standard_normal((L, 37)).astype(np.float32)
    f = jax.jit(shard_map_fn()(lambda t: jbps.psum(t, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    out = np.asarray(f(x)).reshape(L, 37)
    for d in range(L):
        np.testing.assert_allclose(out[d], device_sum(x), rtol=1e-5)


@pytest.mark.parametrize("names", [("a",), ("b",), ("b", "a"), ("a", "b"), ()])
def test_every_device_of_a_mesh_keys_its_chunks_apart(names):
    # Devices that differ only along an axis not summed over once shared keys, and sums mixed
    # at random (whichever push came first). The slot must be unique among a worker's devices
    # and be g * L + s: g the device's row-major position along the axes kept apart, s along
    # the summed ones in the order named (partition/plan.py).
    from jbps.ops.mapped_axes import split
    from jbps.ops.psum_primitive import device_slot

    sizes = {"a": 2, "b": 2}
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    reduced, grouped = split(names, tuple(sizes.items()), "test")
    f = shard_map_fn()(
        lambda _: device_slot(reduced, grouped).reshape(1, 1),
        mesh=mesh,
        in_specs=P("a", "b"),
        out_specs=P("a", "b"),
    )
    got = np.asarray(jax.jit(f)(np.zeros((2, 2), np.float32)))
    want = np.zeros((2, 2), np.int32)
    for a in range(2):
        for b in range(2):
            pos = {"a": a, "b": b}
            s = g = 0
            for n in names:
                s = s * sizes[n] + pos[n]
            for n in ("a", "b"):
                if n not in names:
                    g = g * sizes[n] + pos[n]
            want[a, b] = g * math.prod(sizes[n] for n in names) + s
    np.testing.assert_array_equal(got, want)
    assert sorted(got.ravel()) == [0, 1, 2, 3]


@pytest.mark.parametrize("in_spec", [P("a", "b"), P("a"), P(None, "b")])
@pytest.mark.parametrize("names", [("a",), ("b",), ("a", "b")])
def test_a_psum_result_is_typed_replicated_as_lax_psums(session, in_spec, names):
    # Where jax types replication in avals (shard_map's check on), jbps.psum's result varies
    # along exactly the axes lax.psum's does; jax 0.5 checks replication by rules instead
    # (the conformance cases with out_specs that leave the summed axes out cover both).
    from jbps.ops import replication

    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    seen = {}

    def body(x):
        if not replication.typed():
            return x
        v = x
        seen["jbps"] = replication.varying(replication.aval_of(jbps.psum(v, names)))
        for n in names:  # one at a time: lax refuses a psum over axes the value is partly invariant along
            v = jax.lax.psum(v, n)
        seen["lax"] = replication.varying(replication.aval_of(v))
        return x

    f = shard_map_fn()(body, mesh=mesh, in_specs=in_spec, out_specs=in_spec)
    jax.jit(f).lower(np.zeros((2, 2), np.float32))
    if not seen:
        pytest.skip(f"jax {jax.__version__} does not type replication in avals")
    assert seen["jbps"] == seen["lax"], seen


def test_two_mapped_axes(session):
    x = np.random.default_rng(3).standard_normal((2, 2, 9)).astype(np.float32)
    inner = jax.pmap(lambda t: jbps.psum(t, ("a", "b")), axis_name="b")
    out = jax.pmap(lambda t: inner(t), axis_name="a")  # nested pmap needs 4 devices
    try:
        got = np.asarray(out(x))
    except Exception as exc:  # nested pmap is not supported by every jax version
        pytest.skip(f"nested pmap unavailable: {exc}")
    np.testing.assert_allclose(got[1, 0], x.sum(axis=(0, 1)), rtol=1e-5)


def test_pmean_and_average(session):
    x = np.arange(L * 5, dtype=np.float32).reshape(L, 5)
    out = jax.pmap(lambda t: jbps.pmean(t, "i"), axis_name="i")(x)
    np.testing.assert_allclose(np.asarray(out[0]), x.mean(axis=0), rtol=1e-6)
    ints = jax.pmap(lambda t: jbps.psum(t, "i", average=True), axis_name="i")(np.ones((L, 3), np.int32) * 3)
    assert jnp.issubdtype(ints.dtype, jnp.floating)  # as with lax.pmean
    np.testing.assert_allclose(np.asarray(ints[0]), 3.0)


def test_gradient_of_psum_is_psum(session):
    x = np.random.default_rng(4).standard_normal((L, 6)).astype(np.float32)

    def loss(w):
        return jnp.sum(jbps.psum(w, "i") ** 2)

    def ref_loss(w):
        return jnp.sum(jax.lax.psum(w, "i") ** 2)

    g = jax.pmap(jax.grad(loss), axis_name="i")(x)
    want = jax.pmap(jax.grad(ref_loss), axis_name="i")(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5)


def test_gradient_through_mixed_int_and_float_tree(session):
    def loss(t):
        s = jbps.psum(t, "i")
        return jnp.sum(s["w"] * 2.0) + jnp.sum(s["n"]).astype(jnp.float32) * 0

    tree = {"w": jnp.ones((L, 3)), "n": jnp.ones((L, 2), jnp.int32)}
    g = jax.pmap(jax.grad(loss, allow_int=True), axis_name="i")(tree)
    np.testing.assert_allclose(np.asarray(g["w"]), np.full((L, 3), 2.0 * L))


def test_vmap_inside_pmap(session):
    x = np.random.default_rng(5).standard_normal((L, 3, 4)).astype(np.float32)
    out = jax.pmap(jax.vmap(lambda t: jbps.psum(t, "i")), axis_name="i")(x)
    np.testing.assert_allclose(np.asarray(out[0]), x.sum(axis=0), rtol=1e-5)


def test_network_traffic_is_the_tree_size_not_L_times(session):
    # Hierarchical reduce: psum_scatter over the 4 local devices first, so the
    # worker pushes each element once (plus padding to a multiple of L).
    sizes = [1000, 4097, 3]
    tree = [jnp.ones((L, n), jnp.float32) for n in sizes]
    before = jbps.engine_stats()
    jax.block_until_ready(jax.pmap(lambda t: jbps.psum(t, "i"), axis_name="i")(tree))
    after = jbps.engine_stats()
    padded_bytes = sum(-(-n // L) * L * 4 for n in sizes)
    assert after["bytes_pushed"] - before["bytes_pushed"] == padded_bytes
    assert after["bytes_pulled"] - before["bytes_pulled"] == padded_bytes


def test_large_leaf_spans_many_partitions(server):
    with jbps.init(servers=[server], num_workers=1, worker_rank=0, partition_bytes=4096, scheduling_credit=2):
        x = np.random.default_rng(6).standard_normal((L, 100_003)).astype(np.float32)
        before = jbps.engine_stats()["chunks_pushed"]
        out = jax.pmap(lambda t: jbps.psum(t, "i"), axis_name="i")(x)
        np.testing.assert_allclose(np.asarray(out[3]), device_sum(x), rtol=1e-5, atol=1e-5)
        assert jbps.engine_stats()["chunks_pushed"] - before >= 100_003 * 4 // 4096


def test_init_is_idempotent_and_shutdown_is_safe(server):
    kwargs = dict(servers=[server], num_workers=1, worker_rank=0)
    jbps.init(**kwargs)
    try:
        jbps.init(**kwargs)  # same settings: a no-op
        with pytest.raises(jbps.JbpsError, match="already initialized"):
            jbps.init(servers=[server], num_workers=1, worker_rank=0, timeout_s=5)
    finally:
        jbps.shutdown()
    jbps.shutdown()  # twice: fine
    assert not jbps.is_initialized()
    with jbps.init(**kwargs):  # init again after shutdown
        assert float(jax.jit(lambda x: jbps.psum(x))(jnp.float32(1))) == 1.0
    assert not jbps.is_initialized()
    with pytest.raises(jbps.JbpsError):
        jbps.rank()


def test_env_aliases(server, monkeypatch):
    monkeypatch.setenv("JBPS_SERVERS", server)
    monkeypatch.setenv("DMLC_NUM_WORKER", "1")
    monkeypatch.setenv("DMLC_WORKER_ID", "0")
    monkeypatch.setenv("BYTEPS_PARTITION_BYTES", "8192")
    monkeypatch.setenv("BYTEPS_SCHEDULING_CREDIT", "3")
    with jbps.init() as s:
        assert (s.config.partition_bytes, s.config.scheduling_credit) == (8192, 3)
        monkeypatch.setenv("JBPS_PARTITION_BYTES", "16384")  # the JBPS_* name wins
        assert jbps.config().partition_bytes == 8192  # already running: unchanged
    with jbps.init() as s:
        assert s.config.partition_bytes == 16384


def test_defaults_follow_where_the_job_runs(server):
    from jbps.partition import defaults

    # One host: 1 MiB chunks, two chunks per server in flight (at least 4).
    assert not defaults.spans_hosts(["127.0.0.1:1", "localhost:2"])
    assert [defaults.credit([1 / s] * s, False) for s in (1, 5)] == [4, 10]
    assert defaults.partition_bytes(1 << 30, [0.5, 0.5], False) == 1 << 20
    assert defaults.largest_partition_bytes(False) == 1 << 20 and defaults.largest_partition_bytes(True) == 4 << 20
    # Across hosts: the servers that get bytes, plus two; chunks of about M / (64 x those servers).
    assert defaults.spans_hosts(["127.0.0.1:1", "10.1.2.3:2"])
    cpu_only = [0.0] * 4 + [0.25] * 4  # k = n: the colocated servers get nothing
    assert defaults.credit(cpu_only, True) == 6
    assert defaults.partition_bytes(32 << 20, cpu_only, True) == 128 << 10
    assert defaults.partition_bytes(1 << 20, cpu_only, True) == 32 << 10  # the floor
    assert defaults.partition_bytes(16 << 20, cpu_only, True) == 48 << 10  # not 64 KiB, which stalls
    assert defaults.partition_bytes(8 << 30, cpu_only, True) == 4 << 20  # the ceiling
    # With the link's rate known, a chunk takes at most CHUNK_LINK_S of it: the
    # largest size that does (64 KiB counting as 48 KiB), the floor below that.
    ladder = [32 << 10, 48 << 10] + [128 << 10 << i for i in range(6)]
    for bits_per_s in (10e6, 100e6, 200e6, 300e6, 500e6, 1e9, 2.5e9, 10e9, 100e9):
        rate = bits_per_s / 8
        for call in (1 << 20, 32 << 20, 1 << 30, 8 << 30):
            free = defaults.partition_bytes(call, cpu_only, True)
            fits = [c for c in ladder if c <= rate * defaults.CHUNK_LINK_S] or [32 << 10]
            want = min(free, max(fits))
            assert defaults.partition_bytes(call, cpu_only, True, rate) == want, (bits_per_s, call)
    assert defaults.partition_bytes(32 << 20, cpu_only, True, 200e6 / 8) == 48 << 10  # 200 Mbit/s
    assert defaults.partition_bytes(32 << 20, cpu_only, True, 1e9 / 8) == 128 << 10  # 1 Gbit/s: as without
    with jbps.init(servers=[server], num_workers=1, worker_rank=0) as s:
        assert (s.config.scheduling_credit, s.config.partition_bytes) == (4, None)
        assert jbps.runtime.partition_bytes(1 << 30) == 1 << 20
        assert jbps.runtime.link_bytes_per_s() is None  # one host: nothing to measure
    with jbps.init(servers=[server], num_workers=1, worker_rank=0, scheduling_credit=1, partition_bytes=8192) as s:
        assert s.config.scheduling_credit == 1 and jbps.runtime.partition_bytes(1 << 30) == 8192


def test_trace_dir_and_its_byteps_alias(tmp_path):
    env = {"JBPS_SERVERS": "h:1"}
    assert jbps.Config.resolve({}, env).trace_dir is None
    assert jbps.Config.resolve({}, {**env, "BYTEPS_TRACE_DIR": "/x"}).trace_dir is None  # needs TRACE_ON
    assert jbps.Config.resolve({}, {**env, "BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_DIR": "/x"}).trace_dir == "/x"
    assert (
        jbps.Config.resolve(
            {}, {**env, "BYTEPS_TRACE_ON": "1", "BYTEPS_TRACE_DIR": "/x", "JBPS_TRACE_DIR": "/y"}
        ).trace_dir
        == "/y"
    )


def test_server_fractions_follow_declared_roles(server):
    dedicated = _core.Server("127.0.0.1:0", 1, role="dedicated", keep_alive=True)
    try:
        with jbps.init(servers=[server, f"127.0.0.1:{dedicated.port}"], num_workers=1, worker_rank=0):
            assert _core.engine_server_roles() == ["colocated", "dedicated"]
            # One worker machine: its colocated server takes everything (nothing need leave it).
            assert jbps.runtime.server_fractions() == (1.0, 0.0)
            x = jnp.arange(10_000, dtype=jnp.float32)
            np.testing.assert_array_equal(jax.jit(lambda v: jbps.psum(v))(x), x)
        assert dedicated.stats()["bytes_received"] == 0
    finally:
        dedicated.stop()
    with pytest.raises(ValueError, match="role"):
        _core.Server("127.0.0.1:0", 1, role="cpu")


def _no_job(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(JOB_VARIABLE_PREFIXES):
            monkeypatch.delenv(name)


def test_init_with_no_job_runs_alone_on_an_in_process_server(monkeypatch):
    import socket

    _no_job(monkeypatch)
    with jbps.init(timeout_s=10) as s:
        assert (jbps.rank(), jbps.size(), len(s.config.servers)) == (0, 1, 1)
        host, port = s.config.servers[0].rsplit(":", 1)
        assert host == "127.0.0.1"
        x = np.arange(6, dtype=np.float32)
        np.testing.assert_array_equal(jax.jit(jbps.psum)(x), x)
    with pytest.raises(OSError):  # the hosted server ended with the session
        socket.create_connection((host, int(port)), timeout=2).close()


def test_a_job_size_without_servers_is_still_an_error(monkeypatch):
    _no_job(monkeypatch)
    monkeypatch.setenv("JBPS_NUM_WORKERS", "2")
    with pytest.raises(jbps.JbpsError, match="no summation servers: set JBPS_SERVERS"):
        jbps.init()


def test_the_link_probes_host_psum_sums_and_names_bad_input(server):
    # jbps.init's link probe (jbps/link_rate.py) sums host arrays outside XLA.
    from jbps.link_rate import NAME, psum_host

    values = np.random.default_rng(3).standard_normal(70_000).astype(np.float32)  # several chunks
    with jbps.init(servers=[server], num_workers=1, worker_rank=0, timeout_s=20):
        got = values.copy()
        seconds = psum_host(f"{NAME}.test", got, [1.0], wait_s=30)
        assert 0 < seconds < 30
        # One worker: its own values come back. A real sum is checked across hosts
        # (test_multihost.py): every worker must read the same agreed rate.
        np.testing.assert_array_equal(got, values)
        stats = jbps.engine_stats()
        assert stats["bytes_pushed"] >= values.nbytes, stats
        # The engine cuts by the plan's chunk table alone, and refuses one that does not add up.
        bad_tables = [
            ([4 * 70_000], [0], [], "routes 0 chunks, its table cuts 1"),
            ([4 * 69_999], [0], [0], "add up to 279996 bytes, its shard has 280000"),
            (
                [6, 4 * 70_000 - 6],
                [0, 0],
                [0, 0],
                "chunk 0 of tensor 0 has 6 bytes, not a positive multiple of its 4-byte",
            ),
            ([4 * 70_000], [0, 0], [0], "marks 2 chunks, it cuts 1"),
        ]
        for sizes, alone, servers, why in bad_tables:
            with pytest.raises(RuntimeError, match=why):
                _core.engine_psum_host(
                    got,
                    key=1,
                    name="x",
                    partition_bytes=1 << 20,
                    chunk_bytes=sizes,
                    chunk_alone=alone,
                    servers=servers,
                    tree="",
                    tree_key=0,
                    wait_s=5,
                )
    with pytest.raises(RuntimeError, match="not running"):
        psum_host(f"{NAME}.test", got, [1.0], wait_s=30)


@pytest.mark.parametrize(
    "version,platform,devices,stalls",
    [
        ("0.5.0", "cpu", 2, True),
        ("0.10.2", "cpu", 4, True),
        ("0.11.2", "cpu", 2, True),
        ("0.12.0", "cpu", 2, False),
        ("0.12.0.1", "cpu", 8, False),
        ("0.13.0.dev20270101", "cpu", 2, False),
        ("0.10.2", "cpu", 1, False),
        ("0.10.2", "gpu", 2, False),
    ],
)
def test_which_jax_deadlocks_multi_device_cpu_loops(version, platform, devices, stalls):
    # Measured (docs/guide/loops.md): jax 0.5.0, 0.10.2 and 0.11.2 stall such loops, 0.12.0 does not.
    from jbps import cpu_loop_deadlock

    assert cpu_loop_deadlock.affected(version, platform, devices) is stalls


def test_init_warns_once_where_multi_device_cpu_loops_can_deadlock(server):
    # This process has 4 CPU devices (conftest): jbps.init warns on the jax versions that stall such loops.
    import warnings

    from jbps import cpu_loop_deadlock

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jbps.init(servers=[server], num_workers=1, worker_rank=0, timeout_s=20):
            pass
    said = [w for w in caught if "deadlock a loop" in str(w.message)]
    if cpu_loop_deadlock.loops_need_waits():
        assert len(said) == 1 and jax.__version__ in str(said[0].message), [str(w.message) for w in caught]
        assert "jax 0.12 fixes it" in str(said[0].message) and "block_until_ready" in str(said[0].message)
    else:
        assert said == []


def test_repeated_prefixes_are_said_once_with_their_count():
    from jbps.errors import collapse_repeats

    wrapped = "INTERNAL: " + "Error dispatching computation: " * 287 + "jbps: psum timed out after 20 s: a: b"
    assert (
        collapse_repeats(wrapped)
        == "INTERNAL: Error dispatching computation (x287): jbps: psum timed out after 20 s: a: b"
    )
    assert (
        collapse_repeats("jbps: worker 1 (127.0.0.1:5) left the job: x")
        == "jbps: worker 1 (127.0.0.1:5) left the job: x"
    )


def test_an_uncaught_errors_traceback_prints_its_repeats_collapsed():
    # The hook jbps.init installs, in a process of its own as a worker's uncaught error meets it.
    import subprocess
    import sys

    code = (
        "from jbps.errors import install_excepthook; install_excepthook(); "
        "raise ValueError('INTERNAL: ' + 'Error dispatching computation: ' * 40 + 'jbps: psum timed out')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "ValueError: INTERNAL: Error dispatching computation (x40): jbps: psum timed out"
    ), proc.stderr


def test_unknown_settings_are_named_with_the_nearest_known_one():
    from jbps import unknown_settings

    environ = {
        "JBPS_TIMOUT_S": "5",
        "BYTEPS_PARTITION_BYTE": "4M",
        "DMLC_NUM_WORKERS": "2",
        "JBPS_TIMEOUT_S": "5",  # known
        "JBPS_CI_MARKERS": "x",  # CI's own
        "HOME": "/root",  # not ours
    }
    assert unknown_settings.unknown(environ) == [
        ("BYTEPS_PARTITION_BYTE", "BYTEPS_PARTITION_BYTES"),
        ("DMLC_NUM_WORKERS", "DMLC_NUM_WORKER"),
        ("JBPS_TIMOUT_S", "JBPS_TIMEOUT_S"),
    ]
    said = []
    assert unknown_settings.warn(said.append, {**environ, unknown_settings.CHECKED: "1"}) == []  # jbps run said it
    assert unknown_settings.warn(said.append, environ, local_rank=1) == []  # the host's first worker says it


def test_every_public_name_is_listed_and_found_before_first_use():
    # What imports jax loads on first use (jbps/__init__.py); a fresh process sees all of
    # __all__ in dir(jbps) (completion) and gets each one, with no jax imported by jbps itself.
    code = (
        "import sys, jbps; assert 'jax' not in sys.modules; names = dir(jbps); "
        "print(sorted(set(jbps.__all__) - set(names)), [n for n in jbps.__all__ if getattr(jbps, n) is None])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=job_free_env())
    assert out.returncode == 0 and out.stdout.strip() == "[] []", out.stdout + out.stderr[-2000:]
