"""The summation servers' kernels on one thread, against numpy and a plain copy.

`bench_summation(nbytes)` times, in one run and on the calling thread, over a float32
accumulator of `nbytes` (nbytes / 4 elements):

    f32_add    jbps accumulate("float32", acc, src)        acc += src, the server's kernel
    numpy_add  numpy.add(acc, src, out=acc)
    copy       numpy.copyto(dst, src)                      the machine's copy bandwidth
    bf16_add   jbps accumulate("bfloat16", acc, src16)     float32 acc += widen(bfloat16 src)
    f16_add    jbps accumulate("float16", acc, src16)      float32 acc += widen(float16 src)

The cases run interleaved, one call of each per round in alternating order, so load from other
processes on a shared machine falls on all of them alike; each reports its median (and best) over
the rounds, after one untimed round that touches every page.

How bandwidth is counted: GB/s = bytes of every array the operation reads or writes, each counted
once, per second (1e9 bytes). An f32 add reads acc and src and writes acc: 3 x 4 bytes per element;
a copy reads src and writes dst: 2 x 4; a 16-bit add reads acc (4), src (2) and writes acc (4).
That is the memory traffic each loop must move, and on large buffers what it does move: the
in-place add stores to lines it has just read, and numpy's copyto calls glibc's memmove, which
uses non-temporal stores there (no read of dst; seen with perf at 256 MiB). So "f32_add GB/s /
copy GB/s" is the share of a copy's memory bandwidth the add reaches. Counting only the bytes of
src summed per second instead would charge the add for its third array: an add moving memory
exactly as fast as the copy would score 2/3.

The ratios, each beside the value the design aims at, taken in every round and reported as the
median over rounds (load that slows one round slows its cases together and cancels):
    f32_vs_numpy  numpy_add time / f32_add time (same work)       >= 1.0
    f32_vs_copy   f32_add GB/s / copy GB/s (as counted above)       >= 0.8
    bf16_vs_f32   bf16_add / f32_add elements summed per second    >= 0.5
    f16_vs_f32    f16_add / f32_add elements summed per second     >= 0.5

Every result is checked against numpy afterwards: a wrong kernel raises RuntimeError.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

# name: (label, bytes touched per element)
CASES = {
    "f32_add": ("jbps f32 add (acc += src)", 12),
    "numpy_add": ("numpy add(acc, src, out=acc)", 12),
    "copy": ("numpy copyto(dst, src)", 8),
    "bf16_add": ("jbps bf16 add (f32 acc += bf16)", 10),
    "f16_add": ("jbps f16 add (f32 acc += f16)", 10),
}
# name: (what, target)
GOALS = {
    "f32_vs_numpy": ("numpy add time / jbps f32 add time", 1.0),
    "f32_vs_copy": ("jbps f32 add GB/s / copy GB/s", 0.8),
    "bf16_vs_f32": ("jbps bf16 add / f32 add, elements/s", 0.5),
    "f16_vs_f32": ("jbps f16 add / f32 add, elements/s", 0.5),
}
# Source values are small integers, exact in bfloat16 and float16 and in float32 sums of any
# plausible number of rounds, so every result has one exact expected value.
_PATTERN = 251


def bench_summation(nbytes: int, reps: int = 10) -> dict:
    """Times every case of the module docstring on `nbytes` of float32 accumulator; see there for
    how GB/s is counted. Returns a JSON-serialisable dict: bytes, elements, reps, cases (name ->
    median_s, min_s, gbps, elements_per_s) and goals (name -> what, ratio, target, passed)."""
    import ml_dtypes

    from .cxx_hooks import hooks

    _core = hooks()  # the servers' kernels, through the lab's hooks

    if nbytes <= 0 or nbytes % 4:
        raise ValueError(f"bench_summation: nbytes must be a positive multiple of 4 (float32), got {nbytes}")
    if reps < 1:
        raise ValueError(f"bench_summation: reps must be at least 1, got {reps}")
    n = nbytes // 4
    src = (np.arange(n) % _PATTERN).astype(np.float32)
    # numpy has no bfloat16: the kernels take its 16-bit words as uint16.
    src_bf16 = src.astype(ml_dtypes.bfloat16).view(np.uint16)
    src_f16 = src.astype(np.float16)
    out = {name: np.zeros(n, np.float32) for name in CASES}
    calls = {
        "f32_add": lambda: _core.accumulate("float32", out["f32_add"], src),
        "numpy_add": lambda: np.add(out["numpy_add"], src, out=out["numpy_add"]),
        "copy": lambda: np.copyto(out["copy"], src),
        "bf16_add": lambda: _core.accumulate("bfloat16", out["bf16_add"], src_bf16),
        "f16_add": lambda: _core.accumulate("float16", out["f16_add"], src_f16),
    }
    times = {name: [] for name in CASES}
    for round_ in range(reps + 1):
        # Alternate the order, so no case always runs after the same neighbour.
        for name in list(calls) if round_ % 2 else reversed(calls):
            t0 = time.perf_counter()
            calls[name]()
            if round_:  # round 0 touches the pages and warms the caches
                times[name].append(time.perf_counter() - t0)

    calls_made = reps + 1
    for name in CASES:
        want = src if name == "copy" else src * calls_made
        if not np.array_equal(out[name], want):
            bad = int(np.flatnonzero(out[name] != want)[0])
            raise RuntimeError(
                f"summation benchmark: {CASES[name][0]} computed a wrong result: element {bad} "
                f"is {out[name][bad]}, expected {want[bad]} after {calls_made} calls"
            )

    cases = {}
    for name, (_, touched) in CASES.items():
        med = statistics.median(times[name])
        cases[name] = {
            "median_s": med,
            "min_s": min(times[name]),
            "gbps": touched * n / med / 1e9,
            "elements_per_s": n / med,
        }
    # Each goal from the rounds' own ratios (median over rounds): a burst of load from other
    # processes slows the cases of its round together, and cancels in the ratio.
    per_round = {
        "f32_vs_numpy": lambda r: times["numpy_add"][r] / times["f32_add"][r],
        "f32_vs_copy": lambda r: (CASES["f32_add"][1] / times["f32_add"][r]) / (CASES["copy"][1] / times["copy"][r]),
        "bf16_vs_f32": lambda r: times["f32_add"][r] / times["bf16_add"][r],
        "f16_vs_f32": lambda r: times["f32_add"][r] / times["f16_add"][r],
    }
    ratios = {name: statistics.median(ratio(r) for r in range(reps)) for name, ratio in per_round.items()}
    goals = {
        name: {"what": what, "ratio": ratios[name], "target": target, "passed": bool(ratios[name] >= target)}
        for name, (what, target) in GOALS.items()
    }
    return {"bytes": nbytes, "elements": n, "reps": reps, "cases": cases, "goals": goals}


def format_summation(result: dict) -> list[str]:
    """The result of bench_summation as table lines."""
    lines = [
        f"summation kernels on one thread: {result['bytes'] / 2**20:g} MiB float32 accumulator "
        f"({result['elements']} elements), median of {result['reps']} interleaved rounds; GB/s counts every "
        "array read or written once (f32 add 12 B/element, copy 8, 16-bit add 10); ratios: median of the "
        "rounds' own, higher is better",
        "  {:<34} {:>9} {:>8} {:>9}".format("case", "ms", "GB/s", "Gelem/s"),
    ]
    for name, (label, _) in CASES.items():
        c = result["cases"][name]
        lines.append(
            "  {:<34} {:>9.3f} {:>8.2f} {:>9.3f}".format(
                label, c["median_s"] * 1e3, c["gbps"], c["elements_per_s"] / 1e9
            )
        )
    lines.append("  {:<36} {:>9} {:>16}".format("ratio", "measured", "design aims at"))
    for goal in result["goals"].values():
        lines.append("  {:<36} {:>9.2f} {:>16}".format(goal["what"], goal["ratio"], f">= {goal['target']:.1f}"))
    return lines
