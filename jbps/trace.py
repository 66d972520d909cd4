"""The timeline: a Chrome/Perfetto trace of every chunk a worker reduced.

With JBPS_TRACE_DIR set (or BytePS's BYTEPS_TRACE_ON=1 with
BYTEPS_TRACE_DIR), the engine stamps each chunk as it moves, and
jbps.shutdown() writes DIR/<rank>/comm.json (BytePS's layout). Open it in
https://ui.perfetto.dev or chrome://tracing. Every chunk is one async track
with four consecutive slices:

    queue        submitted by the FFI call, waiting for its priority and a credit
    push         taken by its connection's sender until the server acknowledges
                 having all of it
    server wait  waiting for the other workers' pushes and the sum
    pull         the sum arriving into the output buffer

each carrying the tensor name, key, round, device shard, server, priority
and bytes. Times are microseconds since the Unix epoch, so traces of several
workers on one machine line up when loaded together.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterable

PHASES = ("queue", "push", "server wait", "pull")


@dataclasses.dataclass(frozen=True)
class ChunkTrace:
    tensor: str
    key: int
    round: int
    shard: int
    server: int
    priority: int
    nbytes: int
    queued: float
    sent_start: float
    acked: float
    sum_arrived: float
    pulled: float

    def phases(self) -> list[tuple[str, float, float]]:
        marks = (self.queued, self.sent_start, self.acked, self.sum_arrived, self.pulled)
        return [(name, marks[i], marks[i + 1]) for i, name in enumerate(PHASES)]


def chrome_trace(chunks: Iterable[ChunkTrace], rank: int) -> dict:
    events = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"jbps worker {rank}"}}]
    for seq, ch in enumerate(chunks):
        args = {
            "tensor": ch.tensor,
            "key": f"{ch.key:#018x}",
            "round": ch.round,
            "shard": ch.shard,
            "server": ch.server,
            "priority": ch.priority,
            "bytes": ch.nbytes,
        }
        for name, start, end in ch.phases():
            common = {"name": name, "cat": "jbps", "id": seq, "pid": rank, "tid": ch.shard}
            events.append({**common, "ph": "b", "ts": start, "args": args})
            events.append({**common, "ph": "e", "ts": max(start, end)})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def trace_path(trace_dir: str, rank: int) -> str:
    return os.path.join(trace_dir, str(rank), "comm.json")


def write_trace(records: Iterable[tuple], trace_dir: str, rank: int) -> str:
    """Writes the engine's records (jbps._core.engine_take_trace()); returns the path."""
    path = trace_path(trace_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(chrome_trace((ChunkTrace(*r) for r in records), rank), f)
    return path


def read_trace(path: str) -> list[ChunkTrace]:
    """Chunks of a trace written by write_trace, in the order they completed."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    begins: dict[int, dict[str, dict]] = {}
    ends: dict[int, dict[str, float]] = {}
    for ev in events:
        if ev.get("cat") != "jbps":
            continue
        if ev["ph"] == "b":
            begins.setdefault(ev["id"], {})[ev["name"]] = ev
        elif ev["ph"] == "e":
            ends.setdefault(ev["id"], {})[ev["name"]] = ev["ts"]
    chunks = []
    for seq in sorted(begins):
        phase = begins[seq]
        args = phase["queue"]["args"]
        chunks.append(
            ChunkTrace(
                tensor=args["tensor"],
                key=int(args["key"], 16),
                round=args["round"],
                shard=args["shard"],
                server=args["server"],
                priority=args["priority"],
                nbytes=args["bytes"],
                queued=phase["queue"]["ts"],
                sent_start=phase["push"]["ts"],
                acked=phase["server wait"]["ts"],
                sum_arrived=phase["pull"]["ts"],
                pulled=ends[seq]["pull"],
            )
        )
    return chunks
