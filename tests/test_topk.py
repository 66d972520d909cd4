"""compression="topk": the 10 largest magnitudes of every 1024 values travel
with their indices ("topk:FRACTION": round(FRACTION * 1024) of them), error
feedback on the workers (in the optimizer state) and on the servers. Here
the format against numpy's selection, the optimizer's state, the fractions
refused, and a server's refusal of pushes that keep different amounts; the
jobs across real processes (sums and residuals bit for bit, the feedback's
convergence, workers that disagree) are test_onebit.py's, run for topk too."""

import socket

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jbps
from jbps import _core
from jbps.ops import topk
from wire import BYE, ERROR, HEADER, HELLO, HELLO_OK, PUSH, TOPK
from wire import frame as _frame

TOKEN = 0x70B4


@pytest.mark.parametrize("keep", [10, 51, 1, 512])
def test_encoding_keeps_the_largest_and_the_invariant(keep):
    codec = topk.codec(keep)
    rng = np.random.default_rng(1)
    x = rng.normal(size=3 * topk.BLOCK).astype(np.float32)
    x[5:600] = 7.0  # ties: the lower indices win
    x[2 * topk.BLOCK + 100 :] = 0  # a partial last block's padding
    records, sent = jax.device_get(codec.encode(jnp.asarray(x)))
    assert records.shape == (3, 2 * keep) and records.dtype == np.uint32 and codec.RECORD_BYTES == 8 * keep
    blocks = x.reshape(3, topk.BLOCK)
    for b in range(3):
        want = np.sort(np.argsort(-np.abs(blocks[b]), kind="stable")[:keep])
        index = records[b, 0::2]
        assert np.array_equal(index, want), (b, index, want)
        assert np.array_equal(records[b, 1::2].view(np.float32), blocks[b][want])
    assert np.array_equal(records[0, 0::2], np.arange(5, 5 + keep))  # the first of the tied 7.0s
    assert np.array_equal(jax.device_get(codec.decode(jnp.asarray(records))), sent)
    kept = np.zeros(x.shape, bool)
    kept[(np.arange(3)[:, None] * topk.BLOCK + records[:, 0::2]).ravel()] = True
    assert np.array_equal(sent, np.where(kept, x, 0))  # what was sent plus the residual is the input


def test_optimizer_state_holds_a_residual_per_compressed_leaf(session):
    params = {"kernel": jnp.ones((64, 32)), "bias": jnp.ones(32)}
    grads = {"kernel": jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), "bias": jnp.full(32, 0.5)}
    for compression, keep in [("topk", 10), ("topk:0.05", 51)]:
        tx = jbps.optax.distributed(optax.sgd(0.1), compression=compression, name=f"topk-state-{keep}")
        state = tx.init(params)
        assert jax.tree_util.tree_map(lambda r: r.shape, state.residuals) == {"kernel": (64, 32), "bias": (0,)}
        updates, state = jax.jit(tx.update)(grads, state, params)
        # One worker: the sum is the top-k of the gradient; the residual the rest.
        assert np.array_equal(np.asarray(updates["bias"]), np.full(32, -0.05, np.float32))
        sent = np.asarray(updates["kernel"]) / -0.1
        assert np.count_nonzero(sent) == 2 * keep  # 2048 values: two blocks
        np.testing.assert_allclose(sent + np.asarray(state.residuals["kernel"]), np.asarray(grads["kernel"]), atol=1e-6)


@pytest.mark.parametrize("fraction", ["0", "-0.05", "0.51", "1", "0.0001", "x", "", "nan", "inf", "1/20"])
def test_fractions_topk_cannot_keep_are_refused_when_the_optimizer_is_built(fraction):
    compression = f"topk:{fraction}"
    shown = f"compression={compression!r}: topk's fraction must be a number in \\(0, 0.5\\]"
    with pytest.raises(ValueError, match=f"^jbps.optax.distributed: {shown}.*1 to 512.*got {fraction!r}$"):
        jbps.optax.distributed(optax.sgd(0.1), compression=compression)
    with pytest.raises(ValueError, match=f"^jbps.optax.MultiSteps: {shown}"):
        jbps.optax.MultiSteps(optax.sgd(0.1), 2, compression=compression)
    with pytest.raises(ValueError, match=f"^jbps.psum: {shown}"):
        jbps.psum(np.ones(3, np.float32), compression=compression)


def test_fractions_map_to_the_values_kept():
    assert [topk.keep_of(f) for f in ["0.05", "0.5", "0.01", "1e-3", "0.0005"]] == [51, 512, 10, 1, 1]
    # Accepted as the optimizer is built; psum alone needs the optimizer's state.
    jbps.optax.distributed(optax.sgd(0.1), compression="topk:0.5")
    with pytest.raises(
        ValueError, match=r"needs optimizer state: use jbps.optax.distributed\(tx, compression='topk:0.05'\)"
    ):
        jbps.psum(np.ones(3, np.float32), compression="topk:0.05")


def _frames(sock):
    """The server's frames on a raw connection: (header fields, payload)."""
    while True:
        fields = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
        nbytes = fields[-1]
        yield fields, sock.recv(nbytes, socket.MSG_WAITALL) if nbytes else b""


def test_a_server_refuses_a_round_whose_pushes_keep_different_amounts():
    # Two workers that agree on the call's tree (the same digest) but push
    # topk records keeping 10 and 51 of 1024: the server sums nothing and
    # tells both what each pushed. (Through jbps the tree check fails first,
    # naming the leaf: test_onebit.py.) A keep out of range ends the connection.
    srv = _core.Server("127.0.0.1:0", 2, token=TOKEN, keep_alive=True, timeout_s=10)
    try:
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(2)]
        for rank, s in enumerate(socks):
            s.sendall(_frame(HELLO, TOKEN, key=2, sender=rank))
            assert HEADER.unpack(s.recv(HEADER.size, socket.MSG_WAITALL))[2] == HELLO_OK
        for rank, (s, keep) in enumerate(zip(socks, [10, 51])):
            records = 3 * 8 * keep
            s.sendall(
                _frame(PUSH, TOKEN, key=77, dtype=TOPK, param=keep, sender=rank, aux=5, nbytes=records)
                + b"\0" * records
            )
        for s in socks:  # each worker is told, before either leaves
            fields, text = next((f, p) for f, p in _frames(s) if f[2] == ERROR)
            text = text.decode()
            assert fields[4] == 77 and "workers disagree on this tensor" in text, text
            assert "3 elements of topk keeping 10 of 1024" in text and "3 elements of topk keeping 51 of 1024" in text
        for s in socks:
            s.sendall(_frame(BYE, TOKEN))
            s.close()
        rejected = srv.stats()["rejected"]
        for keep in [0, 513]:
            with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
                s.sendall(_frame(HELLO, TOKEN, key=2, sender=0))
                s.recv(HEADER.size, socket.MSG_WAITALL)
                s.sendall(_frame(PUSH, TOKEN, key=78, dtype=TOPK, param=keep, nbytes=8) + b"\0" * 8)
                while s.recv(1 << 16):  # the server closes it
                    pass
        assert srv.stats()["rejected"] == rejected + 2
    finally:
        srv.stop()
