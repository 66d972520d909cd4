"""Onebit or topk psum (--codec) with error feedback on every worker of the
job, checked against numpy. Prints one JSON line.

--check exact: each round every worker sends its own tree with zero
residuals, values on a 2**-10 grid, so its encoding is exact in any order of
addition; the sums must equal, bit for bit, numpy's decode of every worker's
records, added, plus the server's residual carried over the rounds, encoded
and decoded; the returned residuals must equal what the encoding lost.
--residuals: with --check exact, the residuals going in are grid values too
(of each worker and round), which the workers add to their trees before encoding.
--large: the tree has a leaf of LARGE values too, which XLA:CPU sends in pieces
(several psum calls: reported as psum_calls).
--check feedback: the same tree every round, residuals carried: the mean of
the sums must approach the true sum (error feedback: nothing is lost for
good), reported for the test to compare with the first round's error.
--mode pmap: two local devices, each with its own tree (summed on the device
first, then each device sends its shard).
--disagree R: worker R sends uncompressed (a plain jbps.psum of the same name),
or with --disagree-codec C through the other codec C (or topk keeping another amount).
--codec topk: the 10 largest magnitudes of each 1024 values travel (ties: the
lower index); grid values keep every sum exact there too. --codec topk:FRACTION:
the round(FRACTION * 1024) largest.
"""

import argparse
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jbps
from reporting import reported
from jbps.ops.psum import psum_with_feedback

# The formats', restated: the reference must not borrow the code under test.
MIN_ELEMENTS = 1024
BLOCKS = {"onebit": 256, "topk": 1024}
TOPK_KEEP = 10  # --codec topk; topk:FRACTION keeps round(FRACTION * 1024)
CODEC = "onebit"  # --codec, without a topk fraction
LARGE = 4_500_001  # --large: 18 MB of float32, 9 MB a device under --mode pmap


def codec_arg(text):
    """--codec: onebit, topk or topk:FRACTION (the fraction as given, for jbps to read)."""
    if text in BLOCKS or text.startswith("topk:"):
        return text
    raise argparse.ArgumentTypeError(f"unknown codec {text!r}")


def tree(rank: int, rnd: int, device: int = 0, large: bool = False):
    rng = np.random.default_rng([rank, rnd, device])

    def grid(shape, scale_exp):  # multiples of 2**-10 below 2**-1, times a power of two
        return (rng.integers(-511, 512, size=shape) / 1024 * 2.0**scale_exp).astype(np.float32)

    out = {
        "w": grid((300, 7), int(rng.integers(-3, 4))),  # 2100 values: 9 blocks, the last partial
        "big": grid((5000,), 0),
        "bias": grid((64,), 0),  # too small: travels as float32
        "half": grid((2048,), 2).astype(ml_dtypes.bfloat16),
        "count": rng.integers(-1000, 1000, size=(17,)).astype(np.int32),
    }
    if large:
        out["large"] = grid((LARGE,), -1)  # the last block partial
    return out


def residual_of(rank: int, rnd: int, like):
    """--residuals: a worker's residuals going into round rnd, grid values, float32."""
    rng = np.random.default_rng([rank, rnd, 99])
    return {
        k: (rng.integers(-511, 512, size=v.shape) / 1024).astype(np.float32) if v.size else v for k, v in like.items()
    }


def travels_onebit(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and x.size >= MIN_ELEMENTS


def blocks_of(flat):
    block = BLOCKS[CODEC]
    n = -(-flat.size // block) * block
    padded = np.zeros(n, np.float32)
    padded[: flat.size] = flat
    counts = np.clip(flat.size - np.arange(n // block) * block, 0, block)
    return padded.reshape(-1, block), counts


def encode_decode(values, counts):
    """numpy's codec: (what the records decode to) for blocks of float32 values."""
    if CODEC == "topk":  # the KEEP largest |values| of each block, ties to the lower index
        order = np.argsort(-np.abs(values), axis=1, kind="stable")[:, :TOPK_KEEP]
        kept = np.zeros(values.shape, bool)
        np.put_along_axis(kept, order, True, axis=1)
        return np.where(kept, values, np.float32(0))
    BLOCK = BLOCKS["onebit"]
    held = np.arange(BLOCK)[None, :] < counts[:, None]
    l1 = np.where(held, np.abs(values.astype(np.float64)), 0).sum(axis=1)
    scale = (l1 / np.maximum(counts, 1)).astype(np.float32)
    return np.where(held, np.where(values < 0, -scale[:, None], scale[:, None]), np.float32(0))


class Reference:
    """The job's sums as numpy computes them, with the servers' residuals."""

    def __init__(self):
        self.server_residual = {}

    def round(self, trees, dtypes):
        out = {}
        for name in trees[0]:
            xs = [t[name] for t in trees]
            if not travels_onebit(xs[0]):
                out[name] = np.sum(xs, axis=0, dtype=xs[0].dtype)
                continue
            pushed = []
            for x in xs:
                values, counts = blocks_of(np.asarray(x, np.float32).ravel())
                pushed.append(encode_decode(values, counts))
            acc = pushed[0]
            for p in pushed[1:]:
                acc = acc + p
            acc = acc + self.server_residual.get(name, np.zeros_like(acc))
            summed = encode_decode(acc, counts)
            self.server_residual[name] = acc - summed
            out[name] = summed.ravel()[: xs[0].size].reshape(xs[0].shape).astype(dtypes[name])
        return out

    @staticmethod
    def worker_residual(x):
        values, counts = blocks_of(np.asarray(x, np.float32).ravel())
        return (values - encode_decode(values, counts)).ravel()[: x.size].reshape(x.shape)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", choices=["exact", "feedback"], required=True)
    p.add_argument("--mode", choices=["jit", "pmap"], default="jit")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--disagree", type=int, default=-1)
    p.add_argument("--disagree-codec", type=codec_arg, default=None)
    p.add_argument("--codec", type=codec_arg, default="onebit")
    p.add_argument("--residuals", action="store_true")
    p.add_argument("--large", action="store_true")
    args = p.parse_args()
    global CODEC, TOPK_KEEP
    CODEC, _, fraction = args.codec.partition(":")
    if fraction:
        TOPK_KEEP = round(float(fraction) * 1024)
    jbps.init()
    rank, size = jbps.rank(), jbps.size()
    devices = jax.local_device_count() if args.mode == "pmap" else 1
    zero = {
        k: (np.zeros(v.shape, np.float32) if travels_onebit(v) else np.zeros((0,), np.float32))
        for k, v in tree(0, 0, large=args.large).items()
    }

    if rank == args.disagree and args.disagree_codec:
        step = jax.jit(lambda t, r: psum_with_feedback(t, r, name="onebit", compression=args.disagree_codec))
    elif rank == args.disagree:
        step = jax.jit(lambda t, r: (jbps.psum(t, name="onebit"), r))
    elif args.mode == "jit":
        step = jax.jit(lambda t, r: psum_with_feedback(t, r, name="onebit", compression=args.codec))
    else:
        pmapped = jax.pmap(
            lambda t, r: psum_with_feedback(t, r, "d", name="onebit", compression=args.codec), axis_name="d"
        )
        step = lambda t, r: jax.tree_util.tree_map(lambda a: a[0], pmapped(t, r))  # noqa: E731

    def mine(rnd):
        if args.mode == "jit":
            return tree(rank, rnd, large=args.large)
        trees = [tree(rank, rnd, d, args.large) for d in range(devices)]
        return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *trees)

    def residuals_in(w, rnd):
        return residual_of(w, rnd, zero) if args.residuals else zero

    def stacked(r):
        return r if args.mode == "jit" else jax.tree_util.tree_map(lambda a: np.stack([a] * devices), r)

    def local_sum(w, rnd):  # what worker w sends: its devices' trees, summed (onebit leaves in float32)
        ts = [tree(w, rnd, d, args.large) for d in range(devices)]
        return {
            k: np.sum(
                [np.asarray(t[k], np.float32) if travels_onebit(t[k]) else t[k] for t in ts],
                axis=0,
                dtype=np.float32 if travels_onebit(ts[0][k]) else ts[0][k].dtype,
            )
            for k in ts[0]
        }

    def sent_by(w, rnd):  # what worker w encodes: its local sum plus its residual
        out, res = local_sum(w, rnd), residuals_in(w, rnd)
        return {k: out[k] + res[k] if travels_onebit(out[k]) else out[k] for k in out}

    report_calls = None  # --large: the custom calls one device's program makes
    if args.large:
        lowered = (step if args.mode == "jit" else pmapped).lower(mine(0), stacked(zero))
        report_calls = lowered.compile().as_text().count('custom_call_target="jbps_psum"')

    with reported(
        {"rank": rank, "rounds": 0, "topk_keep": TOPK_KEEP if CODEC == "topk" else None, "psum_calls": report_calls}
    ) as report:
        if args.check == "exact":
            ref = Reference()
            for rnd in range(args.rounds):
                got, residuals = jax.device_get(step(mine(rnd), stacked(residuals_in(rank, rnd))))
                sent = [sent_by(w, rnd) for w in range(size)]
                want = ref.round(sent, {k: v.dtype for k, v in tree(0, 0, large=args.large).items()})
                for name in want:
                    assert got[name].dtype == want[name].dtype, (name, got[name].dtype)
                    assert np.array_equal(got[name].view(np.uint8), want[name].view(np.uint8)), (
                        f"round {rnd} leaf {name}: {got[name].ravel()[:4]} != {want[name].ravel()[:4]}"
                    )
                    if travels_onebit(sent[rank][name]):
                        lost = Reference.worker_residual(sent[rank][name])
                        assert np.array_equal(residuals[name], lost), f"round {rnd}: the residual of {name}"
                    else:
                        assert residuals[name] is None, (name, residuals[name])
                report["rounds"] += 1
        else:
            truth = {
                k: np.sum([np.asarray(local_sum(w, 0)[k], np.float32) for w in range(size)], axis=0)
                for k in ("w", "big")
            }
            residuals, total, errors = stacked(zero), None, []
            for rnd in range(args.rounds):
                got, residuals = step(mine(0), residuals)
                got = jax.device_get(got)
                total = got if total is None else jax.tree_util.tree_map(np.add, total, got)
                errors.append(
                    max(
                        float(np.linalg.norm(total[k] / (rnd + 1) - truth[k]) / np.linalg.norm(truth[k])) for k in truth
                    )
                )
                report["rounds"] += 1
            report["relative_errors"] = errors


if __name__ == "__main__":
    main()
