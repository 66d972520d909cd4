"""The servers' summation kernels (xla_ext/sum_kernels.cc) against numpy, called through
jbps_testing's bindings (benchmarks/cxx_hooks.py) of the very functions the server runs: every dtype's init, add and
finish, on sizes that exercise the vector bodies and the scalar tails, with the 16-bit
floats' special values (NaN, inf, subnormals, -0.0, overflow) and rounding ties."""

import ml_dtypes
import numpy as np
import pytest

from benchmarks.cxx_hooks import hooks

# Vector bodies are 8 or 16 elements wide: these sizes hit empty, tail-only, exact and ragged ends.
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 4099]
WIRE = {
    "float32": np.float32,
    "float64": np.float64,
    "int32": np.int32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
}
# The 16-bit floats accumulate in float32; the others as themselves.
ACC = {**WIRE, "float16": np.float32, "bfloat16": np.float32}
FLOATS = ["float32", "float64", "float16", "bfloat16"]


def raw(a):
    """What the bindings take: numpy has no bfloat16, so 16-bit words travel as uint16."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def values(dtype, n, seed):
    """Random values of `dtype` with every third element a special value."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        out = rng.integers(info.min, info.max, n, endpoint=True, dtype=np.int64).astype(dtype)
        special = np.array([info.max, info.min, -1, 0, 1], dtype)
    else:
        info = ml_dtypes.finfo(dtype)
        out = (rng.standard_normal(n) * 100).astype(dtype)
        special = np.array(
            [
                0.0,
                -0.0,
                np.inf,
                -np.inf,
                np.nan,
                info.smallest_subnormal,
                -info.smallest_subnormal,
                info.tiny,
                info.max,
                -info.max,
                1.0,
                -1.0,
            ],
            dtype,
        )
    out[::3] = np.resize(special, len(out[::3]))
    return out


def assert_same(got, want):
    """Bit for bit (so -0.0 differs from 0.0), except that any NaN matches any NaN."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if np.issubdtype(want.dtype, np.integer):
        np.testing.assert_array_equal(got, want)
        return
    nan = np.isnan(want.astype(np.float64))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float64)), nan, err_msg="NaN positions differ")
    bits = {2: np.uint16, 4: np.uint32, 8: np.uint64}[want.dtype.itemsize]
    bad = np.flatnonzero(got.view(bits)[~nan] != want.view(bits)[~nan])
    assert bad.size == 0, (
        f"{bad.size} elements differ, first at non-NaN index {bad[0]}: "
        f"got {got[~nan][bad[0]]!r}, want {want[~nan][bad[0]]!r}"
    )


def finish_inputs(dtype, n, seed):
    """float32 accumulators for the 16-bit floats' finish: random values (which round),
    exact ties between neighbours (which round to even), and specials (NaN, overflow)."""
    wire = WIRE[dtype]
    rng = np.random.default_rng(seed)
    acc = (rng.standard_normal(n) * 100).astype(np.float32)
    # Ties: halfway between a positive finite wire value and the next one up (bit pattern + 1),
    # subnormals included; both neighbours and their midpoint are exact in float64 and float32.
    below = rng.integers(0, 0x7BFF, n, dtype=np.uint16)
    ties = (below.view(wire).astype(np.float64) + (below + 1).view(wire).astype(np.float64)) / 2
    acc[1::4] = ties[1::4].astype(np.float32)
    tiny = float(ml_dtypes.finfo(wire).smallest_subnormal)
    special = np.array(
        [
            np.nan,
            -np.nan,
            np.inf,
            -np.inf,
            0.0,
            -0.0,
            1e-40,
            -1e-40,
            70000.0,
            -70000.0,
            3.4e38,
            -3.4e38,
            tiny / 2,
            -tiny * 1.5,
            1e30,
        ],
        np.float32,
    )
    acc[::4] = np.resize(special, len(acc[::4]))
    return acc


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(WIRE))
def test_init_widens(dtype, n):
    src = values(WIRE[dtype], n, seed=n)
    acc = np.full(n, 7, ACC[dtype])
    hooks().accumulator_init(dtype, acc, raw(src))
    assert_same(acc, src.astype(ACC[dtype]))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(WIRE))
def test_add_matches_numpy(dtype, n):
    acc = values(ACC[dtype], n, seed=n)
    src = values(WIRE[dtype], n, seed=n + 1)
    # numpy's int32 add wraps around, as the kernel's does.
    with np.errstate(over="ignore", invalid="ignore"):
        want = acc + src.astype(ACC[dtype])
    hooks().accumulate(dtype, acc, raw(src))
    assert_same(acc, want)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(WIRE))
def test_init_sum_matches_numpy(dtype, n):
    a = values(WIRE[dtype], n, seed=n + 2)
    b = values(WIRE[dtype], n, seed=n + 3)
    with np.errstate(over="ignore", invalid="ignore"):
        want = a.astype(ACC[dtype]) + b.astype(ACC[dtype])
    acc = np.full(n, 5, ACC[dtype])
    hooks().accumulator_init_sum(dtype, acc, raw(a), raw(b))
    assert_same(acc, want)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", list(WIRE))
def test_finish_narrows(dtype, n):
    acc = finish_inputs(dtype, n, seed=n) if dtype in ("float16", "bfloat16") else values(ACC[dtype], n, seed=n)
    dst = np.full(n, 3, WIRE[dtype])
    hooks().accumulator_finish(dtype, raw(dst), acc)
    with np.errstate(over="ignore"):
        assert_same(dst, acc.astype(WIRE[dtype]))


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32"])
def test_finish_in_place_for_wire_accumulators(dtype):
    acc = values(WIRE[dtype], 100, seed=5)
    want = acc.copy()
    hooks().accumulator_finish(dtype, acc, acc)
    assert_same(acc, want)


def test_16bit_rounding_ties_go_to_even():
    # Written out, so this does not rest on numpy and ml_dtypes rounding correctly.
    f16 = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65519.0, 65520.0, 2**-25, 3 * 2**-25, -(1 + 2**-11)], np.float32)
    dst = np.empty(len(f16), np.float16)
    hooks().accumulator_finish("float16", dst, f16)
    np.testing.assert_array_equal(dst, np.array([1, 1 + 2**-9, 65504, np.inf, 0, 2**-23, -1], np.float16))

    bf16 = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x00008000, 0x80018000], np.uint32).view(np.float32)
    dst = np.empty(len(bf16), np.uint16)
    hooks().accumulator_finish("bfloat16", dst, bf16)
    np.testing.assert_array_equal(dst, np.array([0x3F80, 0x3F82, 0x7F80, 0x0000, 0x8002], np.uint16))


@pytest.mark.parametrize("dtype,snan", [("float16", 0x7C01), ("bfloat16", 0x7F81)])
def test_nan_stays_nan(dtype, snan):
    # Signalling and quiet NaNs of both signs, in the vector body and the tail.
    words = np.resize(np.array([snan, snan | 0x8000, 0x7E00 if dtype == "float16" else 0x7FC0], np.uint16), 19)
    acc = np.zeros(19, np.float32)
    hooks().accumulator_init(dtype, acc, words)
    assert np.isnan(acc).all()
    acc = np.zeros(19, np.float32)
    hooks().accumulate(dtype, acc, words)
    assert np.isnan(acc).all()
    out = np.zeros(19, np.uint16)
    hooks().accumulator_finish(
        dtype, out, np.resize(np.array([0x7F800001, 0xFF800001, 0x7FC00000], np.uint32), 19).view(np.float32)
    )
    assert np.isnan(out.view(WIRE[dtype]).astype(np.float32)).all()


def test_bad_arguments_are_refused():
    acc = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        hooks().accumulate("float8", acc, acc.copy())
    with pytest.raises(ValueError, match="src must be float32"):
        hooks().accumulate("float32", acc, np.zeros(8, np.float64))
    with pytest.raises(ValueError, match="acc must be float32"):
        hooks().accumulate("float16", np.zeros(8, np.float64), np.zeros(8, np.float16))
    with pytest.raises(ValueError, match="acc has 8 elements, src 9"):
        hooks().accumulate("float32", acc, np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="overlap"):
        hooks().accumulate("float32", acc, acc)
    with pytest.raises(ValueError, match="overlap"):
        hooks().accumulator_finish("float16", acc.view(np.uint16)[:8], acc)


def test_bench_summation_reports_every_case_and_goal():
    from benchmarks.summation import bench_summation, format_summation

    result = bench_summation(1 << 20, reps=2)
    assert result["bytes"] == 1 << 20 and result["elements"] == 1 << 18
    assert set(result["cases"]) == {"f32_add", "numpy_add", "copy", "bf16_add", "f16_add"}
    for case in result["cases"].values():
        assert case["median_s"] > 0 and case["gbps"] > 0 and case["elements_per_s"] > 0
    assert set(result["goals"]) == {"f32_vs_numpy", "f32_vs_copy", "bf16_vs_f32", "f16_vs_f32"}
    for goal in result["goals"].values():
        assert goal["ratio"] > 0 and isinstance(goal["passed"], bool)
    assert len(format_summation(result)) > 5


@pytest.mark.parametrize("n", [0, 1, 31, 4096, 256 * 1024 - 1, 256 * 1024, 256 * 1024 + 77, 3 << 20])
@pytest.mark.parametrize("misalign", [0, 1, 17, 31])
def test_stream_copy_copies_every_byte(n, misalign):
    # The engine's copy of a sum into XLA's output: non-temporal stores from 256 KiB up,
    # with a head up to 32-byte alignment and a tail; every byte must arrive, none beyond.
    rng = np.random.default_rng(n + misalign)
    src = rng.integers(0, 256, n + misalign, dtype=np.uint8)[misalign:]
    room = np.full(n + misalign + 64, 0xAB, np.uint8)
    dst = room[misalign : misalign + n]
    hooks().stream_copy(dst, src)
    np.testing.assert_array_equal(dst, src)
    assert (room[:misalign] == 0xAB).all() and (room[misalign + n :] == 0xAB).all()
