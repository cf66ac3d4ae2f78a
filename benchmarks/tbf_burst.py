"""How the emulated link's tbf bucket (``burst``) distorts transfer times: a measurement, not a test.

A token bucket fills while the link is idle, and the next ``burst`` bytes then leave at veth speed, not at
the shaped rate. A real NIC banks nothing. In an MoE layer the link is idle while the experts compute, so a
large bucket hands the next all-to-all a free head start; that made r = 1 look better than a real link
would (docs/benchmarks.md, "The emulated cluster").

For each bucket this brings up 2 emulated nodes (moe_plugins.tools.bench.cluster) at RATE and sends messages of
128 KiB, 512 KiB and 2 MiB from node 1 to node 0 over one TCP connection, after 0, 5, 20 and 60 ms of idle
link (median of 5), then sends 2 x 8 x 2 MiB over two concurrent connections and reads the sender's
retransmitted segments and the qdisc's drops. Needs root and iproute2, like ``moe-plugins bench``.

    sudo python benchmarks/tbf_burst.py --bursts 512kb 128kb 64kb --rate 200mbit
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import time
from typing import List

from moe_plugins.tools.bench.cluster import ClusterSpec, emulated_cluster, set_rate
from moe_plugins.tools.bench.matrix import parse_rate

SIZES = (128 << 10, 512 << 10, 2 << 20)
IDLES_MS = (0, 5, 20, 60)
PORT = 5555


def _receive(host: str, port: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(1)
    conn, _ = srv.accept()
    while True:
        header = conn.recv(8, socket.MSG_WAITALL)
        if len(header) < 8:
            return
        left = int.from_bytes(header, "little")
        while left:
            left -= len(conn.recv(min(1 << 20, left)))
        conn.sendall(b"k")


def _send(host: str, port: int, mode: str) -> None:
    conn = socket.create_connection((host, port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def transfer(n: int) -> float:
        t0 = time.perf_counter()
        conn.sendall(n.to_bytes(8, "little") + bytes(n))
        conn.recv(1)
        return time.perf_counter() - t0

    transfer(1 << 20)
    if mode == "bulk":
        for _ in range(8):
            transfer(2 << 20)
    else:
        for idle_ms in IDLES_MS:
            for n in SIZES:
                times = []
                for _ in range(5):
                    time.sleep(idle_ms / 1e3)
                    times.append(transfer(n))
                print(f"{idle_ms} {n} {sorted(times)[2]}", flush=True)
    conn.close()


def _in(ns: str, *args: str) -> List[str]:
    return ["ip", "netns", "exec", ns, sys.executable, __file__, *args]


def _pair(cluster, mode: str, ports) -> List[str]:
    """Receivers on node 0, senders on node 1 (one connection per port); the senders' stdout lines."""
    host = cluster.addresses[0]
    receivers = [subprocess.Popen(_in(cluster.nodes[0], "--peer", "recv", host, str(p))) for p in ports]
    try:
        time.sleep(1.0)
        senders = [subprocess.Popen(_in(cluster.nodes[1], "--peer", mode, host, str(p)), stdout=subprocess.PIPE,
                                    text=True) for p in ports]
        out = [s.communicate(timeout=300)[0] for s in senders]
        for r in receivers:
            r.wait(timeout=30)
    finally:
        for r in receivers:
            if r.poll() is None:
                r.kill()
    return [line for text in out for line in text.splitlines()]


def _counter(ns: str, name: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "nstat", "-az", name], capture_output=True, text=True).stdout
    match = re.search(rf"^{name}\s+(\d+)", out, re.M)
    return int(match.group(1)) if match else -1


def _drops(ns: str, dev: str) -> int:
    out = subprocess.run(["tc", "-s", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
    match = re.search(r"dropped (\d+)", out)
    return int(match.group(1)) if match else -1


def measure(burst: str, rate: str) -> None:
    bits_per_s = parse_rate(rate)
    with emulated_cluster(ClusterSpec(nodes=2, burst=burst)) as cluster:
        set_rate(cluster, rate)
        print(f"\n### burst {burst}, rate {rate}\n\n| idle ms | message KiB | median ms | at the rate ms | ratio |\n"
              f"|---|---|---|---|---|")
        for line in _pair(cluster, "probe", [PORT]):
            idle, n, t = line.split()
            ideal = int(n) * 8 / bits_per_s
            print(f"| {idle} | {int(n) >> 10} | {float(t) * 1e3:.2f} | {ideal * 1e3:.2f} | {float(t) / ideal:.2f} |")
        before = _counter(cluster.nodes[1], "TcpRetransSegs")
        t0 = time.monotonic()
        _pair(cluster, "bulk", [PORT + 1, PORT + 2])
        wall = time.monotonic() - t0
        print(f"\ntwo concurrent connections, 2 x 8 x 2 MiB: {wall:.2f} s wall; retransmitted segments "
              f"{_counter(cluster.nodes[1], 'TcpRetransSegs') - before}; qdisc drops on node 1's NIC "
              f"{_drops(cluster.nodes[1], cluster.ifname)}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        mode, host, port = sys.argv[2], sys.argv[3], int(sys.argv[4])
        _receive(host, port) if mode == "recv" else _send(host, port, mode)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bursts", nargs="+", default=["512kb", "128kb", "64kb"], metavar="SIZE")
    parser.add_argument("--rate", default="200mbit")
    args = parser.parse_args()
    for burst in args.bursts:
        measure(burst, args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
