"""Plain TCP's time for what a worker host's link must carry in a psum: its
gradient out and the sum back in, at once. Where that host's link sets the
pace (a worker host slower than the others: `benchmarks.network --rates
w0=400M`), the optimum counts the link's raw bits; TCP/IP headers, the
acknowledgements of the other direction and the emulated cap take more, and
no tool that moves the bytes over TCP goes faster than this.

Host 0 (at --host-rate) connects to --peers hosts (at --rate) and, per call,
sends SIZE/peers to each while each sends it as much back, all at once.
Prints the calls' median beside the raw-rate time SIZE·8/host-rate.

    python -m benchmarks.tcp_floor [--host-rate 400M] [--rate 1G] [--peers 2] [--size 32M] [--iters 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from jbps.sizes import format_rate, parse_bytes

from .emulated_network import EmulatedNetwork
from .network import parse_rate_arg

PORT = 5398
# Both sides: one call's exchange on one connection, sending and receiving `nbytes` at once.
_EXCHANGE = """
import socket, sys, threading, time
nbytes, calls, port = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def send(conn):
    conn.sendall(bytes(nbytes))
def recv(conn):
    got = 0
    while got < nbytes:  # this call's bytes only: the next call's may follow at once
        data = conn.recv(min(1 << 20, nbytes - got))
        if not data:
            raise SystemExit("the other side went away")
        got += len(data)
def exchange(conns):
    threads = [threading.Thread(target=f, args=(c,)) for c in conns for f in (send, recv)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
"""
# Each peer: accepts host 0's connection, then per call waits for its start (one byte:
# no call's bytes leave before host 0 times it) and exchanges; ends when host 0 closes.
_PEER = (
    _EXCHANGE
    + """
conn, _ = socket.create_server((sys.argv[1], port)).accept()
for _ in range(calls):
    if conn.recv(1) != b"g":
        raise SystemExit("host 0 went away")
    exchange([conn])
conn.recv(1)
"""
)
# Host 0: per call, exchanges with every peer at once; prints each call's seconds.
_HOST = (
    _EXCHANGE
    + """
conns = [socket.create_connection((p, port), timeout=60) for p in sys.argv[1].split(",")]
for _ in range(calls):
    start = time.monotonic()
    for conn in conns:
        conn.sendall(b"g")
    exchange(conns)
    print(time.monotonic() - start, flush=True)
"""
)


def measure(host_rate: float, rate: float, peers: int, size: int, iters: int) -> dict:
    """Seconds per call of host 0 moving `size` bytes out and in at once through `peers` peers."""
    nbytes = size // peers
    with EmulatedNetwork(1 + peers, rate, host_rates={0: host_rate}) as net:
        argv = [str(nbytes), str(iters), str(PORT)]
        procs = [net.run(i, [sys.executable, "-c", _PEER, net.hosts[i].address, *argv]) for i in range(1, 1 + peers)]
        time.sleep(0.5)
        addresses = ",".join(net.hosts[i].address for i in range(1, 1 + peers))
        host = net.run(0, [sys.executable, "-c", _HOST, addresses, *argv], stdout=subprocess.PIPE)
        out, _ = host.communicate(timeout=60 + iters * size * 8 / host_rate * 4)
        if host.returncode != 0:
            raise SystemExit(f"benchmarks.tcp_floor: host 0's process exited with {host.returncode}")
        for p in procs:
            p.wait(timeout=30)
    calls = [float(line) for line in out.split()]
    raw = size * 8 / host_rate
    return {
        "host_rate_bits_per_s": host_rate,
        "rate_bits_per_s": rate,
        "peers": peers,
        "bytes": size,
        "per_call_s": calls,
        "median_s": float(np.median(calls)),
        "raw_rate_s": raw,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tcp_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--host-rate", type=parse_rate_arg, default="400M", help="host 0's link, bits/s each way")
    p.add_argument("--rate", type=parse_rate_arg, default="1G", help="the peers' links, bits/s each way")
    p.add_argument("--peers", type=int, default=2, help="hosts host 0 exchanges with (a psum's servers that get bytes)")
    p.add_argument("--size", type=parse_bytes, default="32M", help="bytes each way per call (the gradient)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    if args.peers < 1 or args.iters < 1:
        p.error("--peers and --iters must be at least 1")
    doc = measure(args.host_rate, args.rate, args.peers, args.size, args.iters)
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(
        f"plain TCP, host 0 at {format_rate(args.host_rate)} moving {args.size / 2**20:g} MiB out and as much in at "
        f"once through {args.peers} peers at {format_rate(args.rate)}: median {doc['median_s']:.3f} s "
        f"({doc['median_s'] / doc['raw_rate_s']:.2f}x the raw-rate time {doc['raw_rate_s']:.3f} s); "
        f"calls {', '.join(f'{s:.3f}' for s in doc['per_call_s'])}"
    )


if __name__ == "__main__":
    main()
