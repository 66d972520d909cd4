"""compression="bf16"/"fp16": float leaves travel as 16-bit floats, summed in
float32 by the servers, checked bitwise against numpy with real processes."""

import numpy as np
import pytest

import jbps
from conftest import last_json, run_job, worker_script


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_sums_equal_numpys_sum_of_the_rounded_inputs(compression):
    results = run_job(
        [worker_script("compressed_psum.py"), "--compression", compression],
        workers=2,
        servers=2,
        env={"JBPS_TIMEOUT_S": "60"},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        rep = last_json(r.stdout)
        assert rep["error"] is None and rep["rounds"] == 3, rep


def test_workers_that_disagree_fail_naming_the_leaf():
    results = run_job(
        [
            worker_script("compressed_psum.py"),
            "--compression",
            "bf16",
            "--rounds",
            "1",
            "--compression-rank",
            "1",
            "--compression-there",
            "none",
        ],
        workers=2,
        servers=1,
        env={"JBPS_TIMEOUT_S": "30"},
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
        err = last_json(r.stdout)["error"]
        assert err is not None and "jbps:" in err and "['b']" in err, err


def test_a_bad_compression_is_refused_naming_it(session):
    with pytest.raises(ValueError, match="compression must be None, 'bf16' or 'fp16', got 'int8'"):
        jbps.psum(np.ones(3, np.float32), compression="int8")


def test_one_worker_sum_is_the_rounded_input(session):
    x = np.linspace(-3, 3, 1001, dtype=np.float32) * 1.2345
    got = np.asarray(jbps.psum(x, compression="bf16"))
    import jax.numpy as jnp

    assert got.dtype == np.float32
    assert np.array_equal(got, np.asarray(x, jnp.bfloat16).astype(np.float32))


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_the_casts_round_as_xla_and_numpy_do(compression):
    # On XLA:CPU the casts around a compressed psum are jbps's own (jbps_narrow,
    # jbps_widen): every float32 class (normal, subnormal, ties, overflow, zeros,
    # infinities) must round to the bits XLA's convert and numpy give, and back.
    import jax
    import jax.numpy as jnp

    from jbps.ops import compression as wire

    dtype = np.dtype(wire.WIRE_TYPES[compression])
    rng = np.random.default_rng(3)
    magnitudes = 10.0 ** rng.integers(-45, 39, 20000)
    special = [0.0, -0.0, np.inf, -np.inf, 65504, 65520, 65519.99, 6e-8, 3e-8, 1.4e-45, 1e-39, -1e-39, 3.4e38]
    with np.errstate(over="ignore"):
        values = np.concatenate([rng.normal(size=20000) * magnitudes, special]).astype(np.float32)
        expected = values.astype(dtype)
    x = jnp.asarray(values)
    narrow = jax.jit(lambda v: wire.compress([v], compression)[0])
    ours = narrow(x)
    assert "jbps_narrow" in narrow.lower(x).as_text()
    assert np.array_equal(np.asarray(ours).view(np.uint16), expected.view(np.uint16))
    assert np.array_equal(np.asarray(jax.jit(lambda v: v.astype(dtype))(x)).view(np.uint16), expected.view(np.uint16))
    back = jax.jit(lambda s: wire.decompress([s], [x])[0])(ours)
    assert back.dtype == np.float32
    assert np.array_equal(np.asarray(back).view(np.uint32), expected.astype(np.float32).view(np.uint32))
    # A NaN stays a NaN; batched and differentiated, the casts act as astype.
    nan = np.asarray(narrow(jnp.asarray([np.nan], jnp.float32)), np.float32)
    assert np.isnan(nan).all()
    batched = jax.vmap(lambda v: wire.compress([v], compression)[0])(x[:20000].reshape(4, -1))
    assert np.array_equal(np.asarray(batched).reshape(-1).view(np.uint16), expected[:20000].view(np.uint16))
    grad = jax.grad(lambda v: (wire.decompress(wire.compress([v], compression), [v])[0] * 3).sum())(x[:8])
    assert np.array_equal(np.asarray(grad), np.full(8, 3, np.float32))
