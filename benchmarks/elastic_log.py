"""What jbps.elastic logs at each generation's start, read back (the elastic
tests and benchmarks read a worker's stderr with it):

    jbps.elastic: generation 3, 2 workers, rank 0: assembled in 0.00 s, engine started in 0.00 s
    (links measured before), state kept (every member holds ...) in 0.00 s, programs kept
"""

from __future__ import annotations

import re

_GENERATION = re.compile(
    r"generation (\d+), (\d+) workers, rank (\d+): .* state (kept|from rank 0).*? in ([0-9.]+) s, programs (.*)"
)


def generations(log: str) -> list[dict]:
    """Each generation's start a log names, in order: its number, workers and
    this worker's rank, where its state came from ("kept" or "from rank 0")
    and in how many seconds, and what became of the programs."""
    return [
        {"generation": int(g), "workers": int(n), "rank": int(r), "state": s, "state_s": float(t), "programs": p}
        for g, n, r, s, t, p in _GENERATION.findall(log)
    ]
