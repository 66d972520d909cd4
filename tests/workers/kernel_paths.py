"""Every hand-written vector kernel's results, on the workers' side and the
servers', saved to an npz (argv: PATH) by rank 0, with whether the kernels
ran (JSON line: "avx2"). The test runs it with JBPS_CPU_BASELINE=1 (the
portable loops) and without, and compares the files bit for bit: the casts
(F16C), onebit's encoder and decoder, topk's scans, and the servers'
decode-add and encode with feedback over rounds of compressed psums."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jbps
from jbps import _core
from jbps.ops import compression as wire
from jbps.ops import onebit, topk
from jbps.ops.psum import psum_with_feedback
from reporting import reported

BLOCKS = 16  # of 1024 values


def awkward_values(rng):
    """Values of every class the kernels treat apart: many magnitudes, ties,
    blocks of zeros but a few, of one value, infinities, NaNs, negative zeros."""
    x = (rng.normal(size=BLOCKS * 1024) * 10.0 ** rng.integers(-3, 4, BLOCKS * 1024)).astype(np.float32)
    x[1024:2048] = np.round(x[1024:2048])
    x[2048:3072] = 0.0
    x[2048:3072:300] = 5.0
    x[3072:4096] = 7.0
    x[4096:5120:97] = np.inf
    x[4100:5120:301] = np.nan
    x[5120:6144] = -0.0
    x[6144:7168] = rng.normal(size=1024).astype(np.float32) * np.float32(1e-39)  # subnormal
    return x


jbps.init()
report = {}
with reported(report):
    report["avx2"] = _core.hand_written_avx2()
    rng = np.random.default_rng(7)
    x = awkward_values(rng)
    arrays = {}
    for name in ("fp16", "bf16"):
        narrow = jax.jit(lambda v, c=name: wire.compress([v], c)[0])(jnp.asarray(x))
        arrays[f"narrow_{name}"] = np.asarray(narrow)
        arrays[f"widen_{name}"] = np.asarray(jax.jit(lambda s: wire.decompress([s], [jnp.asarray(x)])[0])(narrow))
    counts = np.full(x.size // onebit.BLOCK, onebit.BLOCK, np.int32)
    counts[3], counts[-1] = 100, 0
    held = np.arange(onebit.BLOCK)[None, :] < counts[:, None]
    padded = np.where(held.reshape(-1), x, np.float32(0))
    records, left = jax.jit(onebit._extract_cpu)(jnp.asarray(padded), jnp.asarray(counts))
    arrays["onebit_records"], arrays["onebit_left"] = np.asarray(records), np.asarray(left)
    arrays["onebit_decoded"] = np.asarray(jax.jit(onebit._decode_cpu)(records))
    for keep in (10, 51, 512):
        codec = topk.codec(keep)
        records, left = jax.jit(codec._extract_cpu)(jnp.asarray(x))
        arrays[f"topk{keep}_records"], arrays[f"topk{keep}_left"] = np.asarray(records), np.asarray(left)
        arrays[f"topk{keep}_decoded"] = np.asarray(jax.jit(codec._decode_cpu)(records))
    # The servers: rounds of compressed psums, each worker's own values, residuals carried.
    mine = np.random.default_rng([jbps.rank(), 1]).normal(size=BLOCKS * 1024).astype(np.float32)
    for codec in ("onebit", "topk", "topk:0.05"):
        step = jax.jit(lambda t, r, c=codec: psum_with_feedback(t, r, name=f"paths.{c}", compression=c))
        tree = {"w": jnp.asarray(mine)}
        residual = jax.tree_util.tree_map(lambda a: jnp.zeros_like(a), tree)
        for rnd in range(3):
            sums, residual = step(tree, residual)
            arrays[f"psum_{codec}_{rnd}"] = np.asarray(sums["w"])
    for name in ("fp16", "bf16"):
        sums = jax.jit(lambda t, c=name: jbps.psum(t, name=f"paths.{c}", compression=c))(jnp.asarray(mine))
        arrays[f"psum_{name}"] = np.asarray(sums)
    if jbps.rank() == 0:
        np.savez(sys.argv[1], **arrays)
