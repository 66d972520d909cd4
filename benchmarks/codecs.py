"""The compression codecs on XLA:CPU, one process: the workers' encoders and decoders.

    python -m benchmarks.codecs [--size 32M] [--reps 9] [--json]

For onebit, topk and topk:0.05, on three kinds of gradient (gaussian: normal values; constant:
every value the same, as the network benchmark's; sparse: zeros but one value in 97), it times

    encode        records and the residual they leave, from float32 values, in place (the input
                  donated and already touched, as a step's gradient plus residual)
    decode        records back to float32, into a fresh output
    encode added  as a training step runs it (jbps.optax's error feedback): the records of
                  residual + gradient and what they leave, written into the residual's buffer
                  (both donated); the XLA ops add, then encode
    decode into   the sums decoded into the gradient's buffer (donated), as a step's

with jbps's C++ codecs (what workers run on XLA:CPU, with the settings of a worker: it runs as a job
of one worker unless one is running; the servers run the same functions) and with the XLA ops GPUs
run, calls alternating, and reports each median and the XLA ops' time over the
C++'s. Every C++ result is checked against the XLA ops': records and residuals bit for bit (onebit's
scale, which the C++ sums in double and XLA in float32, against numpy's float64 mean within one
ulp, and its residual against its own records), decodes bit for bit; a difference raises
RuntimeError.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

CODECS = ("onebit", "topk", "topk:0.05")
DATA = ("gaussian", "constant", "sparse")
TIMED = (
    "encode_cpp",
    "encode_xla",
    "decode_cpp",
    "decode_xla",
    "encode_added_cpp",
    "encode_added_xla",
    "decode_into_cpp",
    "decode_into_xla",
)
# Each case's arguments, as a step passes them ("encode_added" times encode_added_cpp and _xla).
_ARGS = {
    "encode": ("values",),
    "decode": ("records",),
    "encode_added": ("residual", "values"),
    "decode_into": ("values", "records"),
}


def _case(name: str) -> str:
    """The case a TIMED name times: "encode_added_cpp" -> "encode_added"."""
    return name.rpartition("_")[0]


def _values(kind: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    if kind == "gaussian":
        return rng.normal(size=n).astype(np.float32)
    if kind == "constant":
        return np.full(n, 3.0, np.float32)
    x = np.zeros(n, np.float32)
    x[::97] = rng.normal(size=x[::97].size)
    return x


def _functions(codec: str, n: int) -> dict:
    """Each TIMED case's function of the arguments _ARGS names -> arrays."""
    import jax.numpy as jnp

    from jbps.ops import onebit, topk

    if codec == "onebit":
        counts = jnp.full((n // onebit.BLOCK,), onebit.BLOCK, jnp.int32)
        c = onebit
        enc_c, enc_x = (lambda v: onebit._extract_cpu(v, counts)), (lambda v: onebit._extract_xla(v, counts))
    else:
        c = topk.codec(topk.keep_of(codec.partition(":")[2]) if ":" in codec else topk.DEFAULT_KEEP)
        enc_c, enc_x = c._extract_cpu, c._extract_xla
    rows = n // c.BLOCK
    return {
        "encode_cpp": enc_c,
        "encode_xla": enc_x,
        "decode_cpp": c._decode_cpu,
        "decode_xla": c._decode_xla,
        # the whole leaf as one piece (the network's psums send pieces of about 4 MiB)
        # (records, residual, values): dropping the values passed through would cost XLA a copy of them
        "encode_added_cpp": lambda r, v: c.encode_piece(r, v, n, jnp.int32(0), 0, rows),
        "encode_added_xla": lambda r, v: enc_x(r + v),
        "decode_into_cpp": lambda v, rec: c.decode_piece(v, rec, 0),
        "decode_into_xla": lambda v, rec: c._decode_xla(rec),
    }


def _check_step(codec: str, kind: str, added: tuple, encoded_sum: tuple, into: np.ndarray, decoded: np.ndarray):
    """Raises RuntimeError unless the step's C++ forms agree with the plain C++ encoder and decoder:
    encode added's records and residual with encode's of residual + values (numpy's float32 sum),
    decode into's values with decode's."""
    where = f"codec benchmark, {codec} on {kind} values"
    if not np.array_equal(added[0], encoded_sum[0]):
        raise RuntimeError(f"{where}: encode added's records differ from encode's of the sum")
    if not np.array_equal(added[1], encoded_sum[1]):
        raise RuntimeError(f"{where}: encode added's residual differs from encode's of the sum")
    if not np.array_equal(into, decoded):
        raise RuntimeError(f"{where}: decode into's values differ from decode's")


def _check(codec: str, kind: str, values: np.ndarray, cpp: tuple, xla: tuple, decoded: tuple) -> None:
    """Raises RuntimeError unless the C++ encoder and decoder agree with the XLA ops."""
    where = f"codec benchmark, {codec} on {kind} values"
    (rec_c, left_c), (rec_x, left_x) = cpp, xla
    if codec == "onebit":
        # The scale against numpy's mean in float64 (XLA sums in float32: several ulps off).
        blocks = values.reshape(rec_c.shape[0], -1)
        scale = (np.abs(blocks.astype(np.float64)).sum(axis=1) / blocks.shape[1]).astype(np.float32)
        words = rec_c[:, :8].copy().view(np.uint32)
        ulps = np.abs(words[:, 0].astype(np.int64) - scale.view(np.uint32).astype(np.int64))
        if ulps.max() > 1 or not np.all(words[:, 1] == blocks.shape[1]):
            raise RuntimeError(f"{where}: the C++ records' scales or counts differ from numpy's")
        if not np.array_equal(rec_c[:, 8:], rec_x[:, 8:]):
            raise RuntimeError(f"{where}: the C++ records' signs differ from the XLA ops'")
        left_x = values - decoded[1]  # what the C++ records leave, from their own scales
    elif not np.array_equal(rec_c, rec_x):
        raise RuntimeError(f"{where}: the C++ records differ from the XLA ops'")
    if not np.array_equal(left_c, left_x):
        raise RuntimeError(f"{where}: the C++ encoder's residual differs from the XLA ops'")
    if not np.array_equal(decoded[0], decoded[1]):
        raise RuntimeError(f"{where}: the C++ decode differs from the XLA ops'")


def bench_codecs(nbytes: int = 32 << 20, reps: int = 9) -> dict:
    """Times every codec and kind of the module docstring on `nbytes` of float32 values; returns a
    JSON-serialisable dict: bytes, reps, rows (codec, data, median seconds per TIMED case, and
    xla_over_cpp for encode and decode)."""
    if nbytes <= 0 or nbytes % 4096:
        raise ValueError(f"bench_codecs: nbytes must be a positive multiple of 4096 (1024 float32), got {nbytes}")
    if reps < 1:
        raise ValueError(f"bench_codecs: reps must be at least 1, got {reps}")
    import jbps

    # A job of this process alone, unless one runs: the engine's settings (huge pages for a
    # decode's fresh output) are then a worker's.
    started = not jbps.is_initialized()
    if started:
        jbps.init()
    try:
        return _bench(nbytes, reps)
    finally:
        if started:
            jbps.shutdown()


def _bench(nbytes: int, reps: int) -> dict:
    import jax

    cpu = jax.devices("cpu")[0]
    n = nbytes // 4
    touched = jax.jit(lambda s: s)  # a new buffer each call, written (its pages in) before the timed call
    rows = []
    for codec in CODECS:
        functions = _functions(codec, n)
        timed = {
            # keep_unused: XLA's decode into reads no value, yet may write its output over them
            name: jax.jit(
                f, donate_argnums=tuple(i for i, a in enumerate(_ARGS[_case(name)]) if a != "records"), keep_unused=True
            )
            for name, f in functions.items()
        }
        for kind in DATA:
            source = jax.device_put(_values(kind, n), cpu)
            # a residual that is not zero (zeros would leave encode added's sum the values themselves)
            residual = jax.device_put(np.ascontiguousarray(_values(kind, n)[::-1] * np.float32(0.25)), cpu)
            encoded = jax.block_until_ready(timed["encode_cpp"](touched(source)))
            records = encoded[0]
            given = {"values": source, "residual": residual}

            def args(name):
                # fresh, touched copies of what a call donates; the records are only read
                return [records if a == "records" else touched(given[a]) for a in _ARGS[_case(name)]]

            times = {name: [] for name in TIMED}
            for round_ in range(reps + 1):
                for name in TIMED if round_ % 2 else reversed(TIMED):
                    arg = jax.block_until_ready(args(name))
                    t0 = time.perf_counter()
                    jax.block_until_ready(timed[name](*arg))
                    if round_:  # round 0 compiles
                        times[name].append(time.perf_counter() - t0)
            values = np.asarray(source)
            cpp = [np.asarray(a) for a in encoded]
            xla = [np.asarray(a) for a in timed["encode_xla"](touched(source))]
            decoded = (np.asarray(timed["decode_cpp"](cpp[0])), np.asarray(timed["decode_xla"](cpp[0])))
            _check(codec, kind, values, cpp, xla, decoded)
            summed = jax.device_put(np.asarray(residual) + values, cpu)
            _check_step(
                codec,
                kind,
                [np.asarray(a) for a in timed["encode_added_cpp"](touched(residual), touched(source))[:2]],
                [np.asarray(a) for a in timed["encode_cpp"](touched(summed))],
                np.asarray(timed["decode_into_cpp"](touched(source), cpp[0])),
                decoded[0],
            )
            med = {name: statistics.median(times[name]) for name in TIMED}
            rows.append(
                {
                    "codec": codec,
                    "data": kind,
                    **{f"{name}_s": med[name] for name in TIMED},
                    **{f"{case}_xla_over_cpp": med[f"{case}_xla"] / med[f"{case}_cpp"] for case in _ARGS},
                }
            )
    return {"bytes": nbytes, "reps": reps, "rows": rows}


def format_codecs(result: dict) -> list[str]:
    """The result of bench_codecs as table lines: the codecs alone, then as a training step runs them."""
    lines = [
        f"codecs on XLA:CPU, {result['bytes'] / 2**20:g} MiB of float32 values, median of {result['reps']} "
        "alternating calls (ms); XLA/C++: the XLA ops' time over jbps's C++ (every C++ result checked "
        "against the XLA ops', the step's forms against the plain C++)",
    ]
    for title, (a, b) in (
        ("alone: encode in place, decode into a fresh output", ("encode", "decode")),
        (
            "as a step runs them: encode added (residual += gradient), decode into the gradient",
            ("encode_added", "decode_into"),
        ),
    ):
        lines.append(f"  {title}")
        lines.append(
            "  {:<10} {:<9} {:>10} {:>10} {:>8} {:>10} {:>10} {:>8}".format(
                "codec", "values", "encode C++", "encode XLA", "XLA/C++", "decode C++", "decode XLA", "XLA/C++"
            )
        )
        for r in result["rows"]:
            lines.append(
                "  {:<10} {:<9} {:>10.2f} {:>10.2f} {:>8.2f} {:>10.2f} {:>10.2f} {:>8.2f}".format(
                    r["codec"],
                    r["data"],
                    r[f"{a}_cpp_s"] * 1e3,
                    r[f"{a}_xla_s"] * 1e3,
                    r[f"{a}_xla_over_cpp"],
                    r[f"{b}_cpp_s"] * 1e3,
                    r[f"{b}_xla_s"] * 1e3,
                    r[f"{b}_xla_over_cpp"],
                )
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    from jbps.sizes import parse_bytes

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.codecs",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--size", type=parse_bytes, default=32 << 20, help="float32 bytes, K/M/G = KiB/MiB/GiB (default 32M)"
    )
    p.add_argument("--reps", type=int, default=9, help="timed calls per case (default 9)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = p.parse_args(argv)
    try:
        result = bench_codecs(args.size, args.reps)
    except ValueError as e:
        p.error(str(e))
    print(json.dumps(result, indent=2) if args.json else "\n".join(format_codecs(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
