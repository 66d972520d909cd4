"""compression="topk": the 10 largest magnitudes of every 1024 values travel
with their indices, error feedback on the workers (in the optimizer state)
and on the servers. Here the format against numpy's selection and the
optimizer's state; the jobs across real processes (sums and residuals bit
for bit, the feedback's convergence) are test_onebit.py's, run for topk too."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jbps
from jbps.ops import topk


def test_encoding_keeps_the_largest_and_the_invariant():
    rng = np.random.default_rng(1)
    x = rng.normal(size=3 * topk.BLOCK).astype(np.float32)
    x[5:40] = 7.0  # ties: the lower indices win
    x[2 * topk.BLOCK + 100 :] = 0  # a partial last block's padding
    records, sent = jax.device_get(topk.encode(jnp.asarray(x)))
    assert records.shape == (3, 2 * topk.KEEP) and records.dtype == np.uint32
    blocks = x.reshape(3, topk.BLOCK)
    for b in range(3):
        want = np.sort(np.argsort(-np.abs(blocks[b]), kind="stable")[: topk.KEEP])
        index = records[b, 0::2]
        assert np.array_equal(index, want), (b, index, want)
        assert np.array_equal(records[b, 1::2].view(np.float32), blocks[b][want])
    assert np.array_equal(records[0, 0::2], np.arange(5, 15))  # ten of the tied 7.0s, the first ones
    assert np.array_equal(jax.device_get(topk.decode(jnp.asarray(records))), sent)
    kept = np.zeros(x.shape, bool)
    kept[(np.arange(3)[:, None] * topk.BLOCK + records[:, 0::2]).ravel()] = True
    assert np.array_equal(sent, np.where(kept, x, 0))  # what was sent plus the residual is the input


def test_optimizer_state_holds_a_residual_per_compressed_leaf(session):
    params = {"kernel": jnp.ones((64, 32)), "bias": jnp.ones(32)}
    tx = jbps.optax.distributed(optax.sgd(0.1), compression="topk", name="topk-state")
    state = tx.init(params)
    assert jax.tree_util.tree_map(lambda r: r.shape, state.residuals) == {"kernel": (64, 32), "bias": (0,)}
    grads = {"kernel": jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), "bias": jnp.full(32, 0.5)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    # One worker: the sum is the top-k of the gradient; the residual the rest.
    assert np.array_equal(np.asarray(updates["bias"]), np.full(32, -0.05, np.float32))
    sent = np.asarray(updates["kernel"]) / -0.1
    assert np.count_nonzero(sent) == 2 * topk.KEEP  # 2048 values: two blocks
    np.testing.assert_allclose(sent + np.asarray(state.residuals["kernel"]), np.asarray(grads["kernel"]), atol=1e-6)
