"""Buckets on XLA:GPU side streams (jbps/ops/side_stream.py): lowered for
CUDA without a GPU, each bucket's custom call is a function called on a
stream of its own and every one comes before the join; the same lowering,
run on XLA:CPU, gives numpy's sums in pmap, shard_map and a training loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jbps
from jbps.data_parallel import shard_map  # jax.shard_map, or jax.experimental's before jax 0.7
from jbps.ops import buckets, psum_primitive, side_stream

BUCKET = 100_000  # bytes: each leaf of 120,000 bytes goes as a bucket of its own


def _tree(rng, lead=()):
    tree = {f"w{i}": rng.standard_normal((*lead, 300, 100)).astype(np.float32) for i in range(5)}
    tree["counts"] = rng.integers(-100, 100, (*lead, 7)).astype(np.int32)
    return tree


def buckets_of(tree):
    """How many buckets buckets.split makes of the tree (default priorities)."""
    nbytes = [x.nbytes for x in jax.tree_util.tree_leaves(tree)]
    return len(buckets.split(nbytes, [-i for i in range(len(nbytes))], BUCKET))


def _main_ops(text):
    """The op lines of the module's public main function, in program order."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "func.func public @main" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "}")
    return [line.strip() for line in lines[start + 1 : end]]


def test_buckets_lowered_for_cuda_each_run_on_a_side_stream_before_the_join(session):
    tree = _tree(np.random.default_rng(0))
    step = jax.jit(lambda t: jbps.psum(t, bucket_bytes=BUCKET))
    cuda = step.trace(tree).lower(lowering_platforms=("cuda",)).as_text()
    ops = _main_ops(cuda)
    calls = [i for i, op in enumerate(ops) if "call @jbps_on_stream" in op]
    joins = [i for i, op in enumerate(ops) if "@jbps_join" in op]
    buckets = buckets_of(tree)
    # Every bucket is a call on a side stream (streams 1-4 in turn); none waits on the compute stream.
    assert len(calls) == buckets >= 5 and not any("@jbps_psum" in op for op in ops), ops
    streams = [ops[i].split(f'{side_stream.STREAM_ANNOTATION} = "')[1].split('"')[0] for i in calls]
    assert streams == [str(1 + b % psum_primitive.SIDE_STREAMS) for b in range(buckets)], streams
    # Each called function holds one bucket's jbps_psum, and every bucket is
    # staged before the first sum is used: the join, after the last call.
    assert cuda.count("func.func private @jbps_on_stream") == buckets
    assert cuda.count("stablehlo.custom_call @jbps_psum") == buckets
    assert len(joins) == 1 and max(calls) < joins[0], ops
    # XLA's HLO keeps the annotation that XLA:GPU turns into an async start/done pair.
    hlo = step.trace(tree).lower(lowering_platforms=("cuda",)).compiler_ir("hlo").as_hlo_text()
    assert hlo.count(f'{side_stream.STREAM_ANNOTATION}="') == buckets, hlo[:3000]
    # XLA:CPU (whose calls return futures) and a psum of one call are lowered as before.
    cpu = step.trace(tree).lower(lowering_platforms=("cpu",)).as_text()
    assert "jbps_on_stream" not in cpu and cpu.count("stablehlo.custom_call @jbps_psum") == buckets
    whole = jax.jit(lambda t: jbps.psum(t, bucket_bytes=0)).trace(tree).lower(lowering_platforms=("cuda",))
    assert "jbps_on_stream" not in whole.as_text()


@pytest.fixture
def side_streams_on_cpu(monkeypatch):
    """The CUDA lowering's side-stream calls, run on XLA:CPU."""
    monkeypatch.setattr(psum_primitive, "SIDE_STREAM_PLATFORMS", ("cpu",))


def _check(out, reference):
    for key, ref in reference.items():
        np.testing.assert_allclose(np.asarray(out[key]), ref, rtol=1e-5, atol=1e-4, err_msg=key)


def test_side_stream_buckets_sum_as_numpy_in_pmap_and_shard_map(session, side_streams_on_cpu):
    rng = np.random.default_rng(1)
    tree = _tree(rng, (4,))
    ref = {k: np.broadcast_to(v.sum(0), v.shape) for k, v in tree.items()}
    step = jax.pmap(lambda t: jbps.psum(t, "d", bucket_bytes=BUCKET), axis_name="d")
    assert "jbps_on_stream" in step.lower(tree).as_text()
    _check(step(tree), ref)
    mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
    halves = {k: v[:2] for k, v in tree.items()}
    sharded = jax.jit(
        shard_map(
            lambda t: jbps.psum({k: v[0] for k, v in t.items()}, "d", bucket_bytes=BUCKET),
            mesh=mesh,
            in_specs=P("d"),
            out_specs=P(),
        )
    )
    _check(sharded(halves), {k: v.sum(0) for k, v in halves.items()})


def test_a_training_loop_with_side_stream_buckets_matches_a_local_one(session, side_streams_on_cpu):
    """Steps dispatched back to back, 4 devices, adam: the same parameters as
    the same loop with lax.pmean over the devices alone (one worker)."""
    import optax

    rng = np.random.default_rng(2)
    params = {f"layer{i}": {"w": rng.standard_normal((200, 200)).astype(np.float32) * 0.05} for i in range(4)}
    x = rng.standard_normal((4, 8, 200)).astype(np.float32)
    opt = optax.adam(1e-2)

    def loss(p, xb):
        h = xb
        for i in range(4):
            h = jnp.tanh(h @ p[f"layer{i}"]["w"])
        return jnp.mean(h**2)

    def make_step(reduce):
        def step(p, s, xb):
            g = reduce(jax.grad(loss)(p, xb))
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s

        return jax.pmap(step, axis_name="d")

    def train(reduce, side_streams):
        step = make_step(reduce)
        p, s = (jax.tree_util.tree_map(lambda a: np.stack([a] * 4), t) for t in (params, opt.init(params)))
        assert ("jbps_on_stream" in step.lower(p, s, x).as_text()) == side_streams
        for i in range(6):
            p, s = step(p, s, x)
            if i % 4 == 3:  # jax 0.10's CPU runtime: see docs/guide/loops.md
                jax.block_until_ready(p)
        return jax.tree_util.tree_map(lambda a: np.asarray(a[0]), p)

    ours = train(lambda g: jbps.pmean(g, "d", bucket_bytes=BUCKET), True)
    ref = train(lambda g: jax.lax.pmean(g, "d"), False)
    for key in params:
        np.testing.assert_allclose(ours[key]["w"], ref[key]["w"], rtol=1e-5, atol=1e-6, err_msg=key)
    assert not np.allclose(ours["layer0"]["w"], params["layer0"]["w"])  # it trained
