"""The emulated link in both directions at once, raw TCP against gloo: a measurement, not a test.

A 2-rank all-to-all sends N bytes each way at the same time. For each N this brings up 2 emulated nodes
(moe_plugins.tools.bench.cluster) at RATE and times, after 20 ms of idle link (median of 5):

- raw: one TCP connection, both ends sending N bytes and receiving N bytes at once;
- gloo: ``all_to_all_single`` of 2 N bytes per rank over gloo on the nodes' NICs (N of them cross the link);
- gloo x2: two such all-to-alls of N / 2 each way at once, on two process groups (two connections), as
  PipeMoE's lane runs a dispatch and a combine.

Needs root and iproute2, like ``moe-plugins bench``.

    sudo python benchmarks/duplex_link.py --rate 200mbit
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, List

from moe_plugins.tools.bench.cluster import ClusterSpec, emulated_cluster, set_rate
from moe_plugins.tools.bench.matrix import parse_rate

SIZES = (512 << 10, 1 << 20, 2 << 20, 4 << 20)
IDLE_S = 0.02
PORT = 5600


def _median_of_5(sync: Callable[[], None], once: Callable[[], float]) -> float:
    times = []
    for _ in range(5):
        sync()
        time.sleep(IDLE_S)
        times.append(once())
    return sorted(times)[2]


def _connect(host: str, tries: int = 50) -> socket.socket:
    for _ in range(tries - 1):
        try:
            return socket.create_connection((host, PORT))
        except ConnectionRefusedError:
            time.sleep(0.1)
    return socket.create_connection((host, PORT))


def _raw(role: str, host: str) -> List[float]:
    if role == "0":
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((host, PORT))
        srv.listen(1)
        conn, _ = srv.accept()
        srv.close()
    else:
        conn = _connect(host)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(n: int) -> float:
        def rx() -> None:
            left = n
            while left:
                left -= len(conn.recv(min(1 << 20, left)))
        t0 = time.perf_counter()
        reader = threading.Thread(target=rx)
        reader.start()
        conn.sendall(bytes(n))
        reader.join()
        return time.perf_counter() - t0

    def sync() -> None:
        conn.sendall(b"s")
        conn.recv(1, socket.MSG_WAITALL)

    exchange(1 << 20)
    return [_median_of_5(sync, lambda: exchange(n)) for n in SIZES]


def _gloo(role: str, host: str) -> List[List[float]]:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{PORT + 1}", rank=int(role), world_size=2)
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(2)]

    def a2a(n: int, parts: int) -> float:
        bufs = [torch.zeros(2 * n // parts, dtype=torch.uint8) for _ in range(parts)]
        outs = [torch.empty_like(b) for b in bufs]
        t0 = time.perf_counter()
        works = [dist.all_to_all_single(o, b, group=g, async_op=True) for o, b, g in zip(outs, bufs, groups)]
        for w in works:
            w.wait()
        return time.perf_counter() - t0

    a2a(1 << 20, 1)
    out = [[_median_of_5(dist.barrier, lambda: a2a(n, parts)) for n in SIZES] for parts in (1, 2)]
    dist.destroy_process_group()
    return out


def _peer(role: str, host: str) -> None:
    raw = _raw(role, host)
    gloo, gloo2 = _gloo(role, host)
    if role == "1":
        for n, t_raw, t_g, t_g2 in zip(SIZES, raw, gloo, gloo2):
            print(n, t_raw, t_g, t_g2, flush=True)


def measure(rate: str, latency: str) -> None:
    bits_per_s = parse_rate(rate)
    with emulated_cluster(ClusterSpec(nodes=2, latency=latency)) as cluster:
        set_rate(cluster, rate)
        host = cluster.addresses[0]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=cluster.ifname, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen(["ip", "netns", "exec", node, sys.executable, __file__, "--peer", str(i), host],
                                  stdout=subprocess.PIPE, text=True, env=env) for i, node in enumerate(cluster.nodes)]
        out = [p.communicate(timeout=600)[0] for p in procs]
        print(f"\n### rate {rate}, burst {cluster.burst}, latency {cluster.latency}\n\n"
              "| MiB each way | at the rate ms | raw TCP ms | gloo all-to-all ms | gloo, two at once ms |\n"
              "|---|---|---|---|---|")
        for line in out[1].splitlines():
            n, *ts = line.split()
            ideal = int(n) * 8 / bits_per_s
            cells = " | ".join(f"{float(t) * 1e3:.1f} ({float(t) / ideal:.2f}x)" for t in ts)
            print(f"| {int(n) / 2**20:g} | {ideal * 1e3:.1f} | {cells} |")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        _peer(sys.argv[2], sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", nargs="+", default=["200mbit"])
    parser.add_argument("--latency", nargs="+", default=[ClusterSpec.latency], help="tbf queue limits to try")
    args = parser.parse_args()
    for latency in args.latency:
        for rate in args.rate:
            measure(rate, latency)
    return 0


if __name__ == "__main__":
    from moe_plugins.core.rank_exit import exit_rank
    exit_rank(main())     # not interpreter finalization: see moe_plugins.core.rank_exit
