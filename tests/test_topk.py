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


@pytest.mark.parametrize("keep", [10, 51, 1, 16, 17, 512])
def test_the_cpu_encoder_writes_the_records_of_the_xla_one(keep):
    # On XLA:CPU the codec runs the servers' C++ (a custom call); on other
    # platforms XLA ops. Both must send the same records: the same values
    # kept, ties to the lower index, NaN above infinity (as lax.top_k ranks
    # it), -0.0 and 0.0 as equals; batched too (vmap).
    codec = topk.codec(keep)
    rng = np.random.default_rng(keep)
    x = (rng.normal(size=(4, 8 * topk.BLOCK)) * 10.0 ** rng.uniform(-3, 3, size=(4, 1))).astype(np.float32)
    x[0, : 3 * topk.BLOCK] = np.round(x[0, : 3 * topk.BLOCK])  # many ties
    x[1, 5 : 3 * topk.BLOCK : 97] = np.inf
    x[1, 7 : 2 * topk.BLOCK : 301] = np.nan
    x[2, topk.BLOCK : 3 * topk.BLOCK] = np.where(rng.random(2 * topk.BLOCK) < 0.5, -0.0, 0.0)  # all zeros
    x[3, 4 * topk.BLOCK :] = 1e-39 * rng.normal(size=4 * topk.BLOCK)  # subnormals
    xs = jnp.asarray(x)

    def encoder(extract, decode):
        def encode(v):  # (records, what they decode to)
            records, _ = extract(v)
            return records, decode(records)

        return encode

    cpu = jax.jit(jax.vmap(encoder(codec._extract_cpu, codec._decode_cpu)))(xs)
    xla = jax.jit(jax.vmap(encoder(codec._extract_xla, codec._decode_xla)))(xs)
    assert cpu[0].shape == xla[0].shape == (4, 8, 2 * keep)
    assert np.array_equal(np.asarray(cpu[0]), np.asarray(xla[0]))
    assert np.array_equal(np.asarray(cpu[1]).view(np.uint32), np.asarray(xla[1]).view(np.uint32))
    # What the encoding leaves (the new residual): the values, the kept ones zeroed.
    left_cpu = jax.jit(jax.vmap(codec._extract_cpu))(xs)
    left_xla = jax.jit(jax.vmap(codec._extract_xla))(xs)
    assert np.array_equal(np.asarray(left_cpu[0]), np.asarray(xla[0]))
    assert np.array_equal(np.asarray(left_cpu[1]).view(np.uint32), np.asarray(left_xla[1]).view(np.uint32))
    index = np.asarray(xla[0])[:, :, 0::2]  # each block's kept indices
    kept = np.zeros(x.shape, bool)
    kept[np.arange(4)[:, None, None], np.arange(8)[None, :, None] * topk.BLOCK + index] = True
    assert np.array_equal(np.asarray(left_cpu[1])[~kept].view(np.uint32), x[~kept].view(np.uint32))
    assert not np.asarray(left_cpu[1])[kept].any()
    for row in range(4):  # one at a time, and the decoders
        records, sent = jax.jit(codec.encode)(xs[row])
        assert np.array_equal(np.asarray(records), np.asarray(xla[0][row]))
        for decode in (codec._decode_cpu, codec._decode_xla):
            assert np.array_equal(
                np.asarray(jax.jit(decode)(records)).view(np.uint32), np.asarray(sent).view(np.uint32)
            )


def test_the_cpu_encoder_refuses_records_that_do_not_fit():
    codec = topk.codec(10)
    call = jax.ffi.ffi_call(
        "jbps_topk_encode",
        (jax.ShapeDtypeStruct((2, 21), jnp.uint32), jax.ShapeDtypeStruct((2 * topk.BLOCK,), jnp.float32)),
    )
    with pytest.raises(
        Exception,
        match="jbps_topk_encode: 2048 values and 168 bytes of records are not whole blocks of 1024 in records of 80",
    ):
        jax.block_until_ready(call(jnp.zeros(2 * topk.BLOCK, jnp.float32), keep=np.int64(codec.keep)))
    decode = jax.ffi.ffi_call("jbps_topk_decode", jax.ShapeDtypeStruct((topk.BLOCK,), jnp.float32))
    with pytest.raises(Exception, match="jbps_topk_decode: keep must be 1 to 512, got 513"):
        jax.block_until_ready(decode(jnp.zeros((1, 1026), jnp.uint32), keep=np.int64(513)))


def test_optimizer_state_holds_a_residual_per_compressed_leaf(session):
    params = {"kernel": jnp.ones((64, 32)), "bias": jnp.ones(32)}
    grads = {"kernel": jnp.linspace(-1, 1, 64 * 32).reshape(64, 32), "bias": jnp.full(32, 0.5)}
    for compression, keep in [("topk", 10), ("topk:0.05", 51)]:
        tx = jbps.optax.distributed(optax.sgd(0.1), compression=compression, name=f"topk-state-{keep}")
        state = tx.init(params)
        assert jax.tree_util.tree_map(lambda r: r.shape, state.residuals) == {"kernel": (64, 32), "bias": None}
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
        nbytes = fields[11]
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
