"""The memory case, run inside a jbps benchmark worker: resident memory for a psum of M bytes.

Peak: with jax's own buffers in place (the input and one output of M bytes) and the psum
compiled but never run, the baseline RSS is read (after malloc_trim) and the kernel's
high-water mark (VmHWM) reset; then a few psums of M; the peak is VmHWM minus the baseline. Growth: many psums of a
smaller buffer, RSS read about 50 times from round rounds/10 on (past any warm-up), each time
after malloc_trim; the growth is the last reading minus the first. The servers cannot be
trimmed from here: their growth is given on the floor of the readings too (floor_growth).
Linux /proc only; shared-memory mappings count in RSS (RssShmem), so anonymous and
shared memory are reported apart as well. Worker 0 also reads the summation servers'
/proc/PID/status when their PIDs are given.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import jbps

FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def read_status(pid="self") -> dict[str, int]:
    """The memory fields of /proc/PID/status, in bytes (absent ones left out)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in FIELDS:
                out[key] = int(value.split()[0]) * 1024  # "1234 kB"
    return out


def _load_malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc; musl has none
    except (OSError, AttributeError):
        return None


_malloc_trim = _load_malloc_trim()


def trim() -> bool:
    """Hands the memory glibc holds free back to the kernel (malloc_trim(0)), so RSS counts what
    is in use: after a free glibc keeps up to twice its (adaptive) mmap threshold, up to 64 MiB,
    at the top of its heap. False where there is no malloc_trim."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


def reset_peak(pid="self") -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0: '5' into clear_refs); False where refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _diff(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after if k in before}


class PeakSampler:
    """Samples this process's RSS fields in a thread: the peaks of RssAnon and RssShmem
    apart, which VmHWM (exact, but only the total) does not give."""

    def __init__(self, interval_s=0.002):
        self.interval_s = interval_s
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            for k, v in read_status().items():
                self.peak[k] = max(v, self.peak.get(k, 0))
            self._stop.wait(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _servers_status(pids) -> dict:
    return {pid: read_status(pid) for pid in pids}


def measure_peak(nbytes, rounds, barrier, check, server_pids=()):
    rank = jbps.rank()
    x = jnp.full((nbytes // 4,), rank + 1, jnp.float32)
    psum = jax.jit(lambda x: jbps.psum(x, name="bench.memory.peak")).lower(x).compile()
    out = jnp.copy(x).block_until_ready()  # stands in for the psum's output while the baseline is read
    gc.collect()
    trim()
    baseline = read_status()
    del out  # the psum's output takes its place
    hwm_reset = reset_peak()
    servers_before = _servers_status(server_pids)
    servers_reset = all(reset_peak(pid) for pid in server_pids)
    barrier()  # no worker pushes M before worker 0 read the servers' baseline
    times = []
    with PeakSampler() as sampler:
        for i in range(rounds):
            t0 = time.perf_counter()
            y = psum(x).block_until_ready()
            times.append(time.perf_counter() - t0)
            if i < rounds - 1:
                del y  # never two outputs alive at once
    peak = read_status()
    servers_after = _servers_status(server_pids)
    extra = peak["VmHWM"] - baseline["VmRSS"]
    check(y, "the memory peak case")  # after reading the peak: np.asarray may copy
    del y, x, psum
    held = peak["VmRSS"] - baseline["VmRSS"]  # the last output alive, like the stand-in
    out = {
        "bytes": nbytes,
        "rounds": rounds,
        "median_s": statistics.median(times),
        "baseline": baseline,
        "peak": peak,
        "extra_bytes": extra,
        "extra_over_m": extra / nbytes,
        "held_bytes": held,
        "sampled_extra": _diff(sampler.peak, baseline),
        "hwm_reset": hwm_reset,
    }
    if server_pids:
        extras = [servers_after[p]["VmHWM"] - servers_before[p]["VmRSS"] for p in server_pids]
        out["servers"] = {
            "pids": list(server_pids),
            "before": servers_before,
            "after": servers_after,
            "peak_extra_bytes": sum(extras),
            "hwm_reset": servers_reset,
        }
    return out


def floor_growth(readings: list[int]) -> int:
    """The lowest of the last quarter of the readings minus the lowest of the first quarter.

    Freed buffers that glibc keeps for a while (after a free, its mmap threshold rises to the
    buffer's size and its trim threshold to twice that) come and go as steps of megabytes above
    a floor; a leak raises the floor itself."""
    q = max(1, len(readings) // 4)
    return min(readings[-q:]) - min(readings[:q])


def measure_growth(nbytes, rounds, check, server_pids=()):
    rank = jbps.rank()
    x = jnp.full((nbytes // 4,), rank + 1, jnp.float32)
    psum = jax.jit(lambda x: jbps.psum(x, name="bench.memory.rounds"))
    # Readings from the tenth of the rounds on (past any warm-up), about 50 in all, kept in
    # arrays made up front: dicts piling up would be growth of the benchmark's own.
    first, every = max(1, rounds // 10), max(1, rounds // 50)
    at = sorted({*range(first, rounds + 1, every), rounds})
    readings = np.zeros((len(at), len(FIELDS)), np.int64)
    servers = np.zeros((len(at), len(server_pids)), np.int64)
    times = np.zeros(rounds)
    k = 0
    for i in range(1, rounds + 1):
        t0 = time.perf_counter()
        y = psum(x).block_until_ready()
        times[i - 1] = time.perf_counter() - t0
        if i == 1:
            check(y, "the memory rounds")
        del y
        if i == at[k]:
            time.sleep(0.05)  # let frees that jax's threads finish after the call land
            trimmed = trim()
            status = read_status()
            readings[k] = [status.get(f, 0) for f in FIELDS]
            servers[k] = [read_status(p)["VmRSS"] for p in server_pids]
            k = min(k + 1, len(at) - 1)
    rss = readings[:, FIELDS.index("VmRSS")].tolist()
    growth = dict(zip(FIELDS, (readings[-1] - readings[0]).tolist()))
    out = {
        "bytes": nbytes,
        "rounds": rounds,
        "from_round": first,
        "median_s": float(np.median(times)),
        "rss": {str(i): v for i, v in zip(at, rss)},
        "rss_from": rss[0],
        "rss_to": rss[-1],
        "growth": growth,
        "growth_bytes": growth["VmRSS"],
        "growth_over_m": growth["VmRSS"] / nbytes,
        "floor_growth_bytes": floor_growth(rss),
        "floor_growth_over_m": floor_growth(rss) / nbytes,
        "malloc_trim": trimmed,
    }
    if server_pids:
        total = servers.sum(axis=1).tolist()
        out["servers_growth_bytes"] = total[-1] - total[0]
        out["servers_floor_growth_bytes"] = floor_growth(total)
    return out


def run(peak_bytes, peak_rounds, round_bytes, rounds, barrier, check, server_pids=()) -> dict:
    """Both memory measurements. barrier(): all workers meet; check(y, what): raises if y is not the
    known sum (each worker contributes rank+1); server_pids only on worker 0 (the others pass none)."""
    peak = measure_peak(peak_bytes, peak_rounds, barrier, check, server_pids)
    growth = measure_growth(round_bytes, rounds, check, server_pids)
    out = {"peak": {k: v for k, v in peak.items() if k != "servers"}, "rounds": growth}
    if server_pids:
        out["servers"] = {
            **peak["servers"],
            "growth_bytes": growth["servers_growth_bytes"],
            "floor_growth_bytes": growth["servers_floor_growth_bytes"],
        }
    return out
