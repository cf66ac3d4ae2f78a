"""An emulated multi-node cluster on one machine: network namespaces joined by rate-shaped links.

Topology: one "switch" namespace holds a Linux bridge; every node is a namespace with one NIC (``nic0``)
whose veth peer is a bridge port (``p<i>``) in the switch. A tbf qdisc on both ends of every veth caps the
node's upload and download at the same rate, like a NIC on a non-blocking switch. Ranks inside one node
talk over that namespace's loopback, so intra-node traffic never crosses the shaped link.

Everything this module creates lives in the namespaces it made: it never touches an interface of the
namespace it runs in. Names carry the creating process id and a random suffix
(``moeb<pid>x<hex4>sw``, ``...n0``), so two runs never collide and namespaces left behind by a killed run
(SIGKILL cannot be caught) are recognised by :func:`stale_namespaces`, whose owner process is gone.

Measured facts this relies on (docs/benchmarks.md, "The emulated cluster"): tbf works, netem does not (so no
added delay or loss), and gloo must be told the NIC (``GLOO_SOCKET_IFNAME=nic0``) or it binds 127.0.0.1.

TCP congestion control is set in every node namespace (``ClusterSpec.congestion_control``, reno by default).
A new namespace inherits this machine's default, BBR, and with BBR over the tbf link we measured stalls
of 60-150 ms in 15-50 % of the timed rounds of one row (same code, same bytes; fast retransmits and loss
probes with no packet dropped anywhere), which made medians bimodal. With reno the stalls were gone in the
same side-by-side runs (docs/benchmarks.md). cubic cannot be set in a child namespace here: it is not in
``net.ipv4.tcp_allowed_congestion_control`` and loading it needs the host namespace, which this module
never touches.

The tbf bucket is 128 KiB (``ClusterSpec.burst``), not the 512 KiB used before git 74d4bf4. A bucket fills while the link is
idle and its bytes then leave at veth speed: with 512 KiB, a 512 KiB message sent after 20 ms of idle took
1.7 ms at 200 Mbit/s instead of 21 ms, so an all-to-all that follows the experts' GEMMs was nearly free
(benchmarks/tbf_burst.py). 64 KiB is smaller than a GSO packet plus headers, so tbf splits packets and two
concurrent connections retransmitted 194 segments; at 128 KiB they retransmitted none, and a 512 KiB
message after idle takes 0.81x its time at the rate.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

from moe_plugins.tools.bench.matrix import UNSHAPED, parse_rate

PREFIX = "moeb"
IFNAME = "nic0"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)x[0-9a-f]{{4}}(sw|n\d+)$")
_CMD_TIMEOUT_S = 20.0


class ClusterError(RuntimeError):
    """An ip/tc command failed; the message holds the command and its stderr."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    nodes: int
    burst: str = "128kb"        # tbf bucket: the smallest that holds 2 GSO packets (see module doc)
    latency: str = "100ms"      # tbf queue limit expressed as delay
    subnet: str = "10.99.0"     # node i gets <subnet>.<i+1>/24 (private to the namespaces)
    congestion_control: str = "reno"   # TCP congestion control in every node namespace (see module doc)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Names of what :func:`bring_up` made; plain data, so rank processes can receive it."""

    run_id: str
    switch: str
    nodes: Tuple[str, ...]
    addresses: Tuple[str, ...]
    burst: str
    latency: str
    congestion_control: str
    ifname: str = IFNAME

    @property
    def namespaces(self) -> Tuple[str, ...]:
        return (self.switch,) + self.nodes


def new_run_id() -> str:
    return f"{PREFIX}{os.getpid()}x{secrets.token_hex(2)}"


def plan_cluster(spec: ClusterSpec, run_id: str) -> Cluster:
    """Names and addresses only (pure)."""
    if spec.nodes < 2 or spec.nodes > 250:
        raise ValueError(f"nodes ({spec.nodes}) must be between 2 and 250")
    return Cluster(run_id=run_id, switch=f"{run_id}sw", nodes=tuple(f"{run_id}n{i}" for i in range(spec.nodes)),
                   addresses=tuple(f"{spec.subnet}.{i + 1}" for i in range(spec.nodes)), burst=spec.burst,
                   latency=spec.latency, congestion_control=spec.congestion_control)


def _run(args: Sequence[str], tolerate: Tuple[str, ...] = ()) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if proc.returncode != 0 and not any(t in proc.stderr for t in tolerate):
        raise ClusterError(f"`{' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def netns_unavailable_reason() -> Optional[str]:
    """None when namespaces, veth and tbf can be used here; otherwise why not, in one sentence."""
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): network namespaces and tc need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    probe = f"{new_run_id()}sw"
    try:
        _run(["ip", "netns", "add", probe])
    except (ClusterError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` does not work here: {exc}"
    try:
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "1gbit",
              "burst", ClusterSpec.burst, "latency", ClusterSpec.latency])
    except (ClusterError, OSError, subprocess.TimeoutExpired) as exc:
        return f"veth or tbf does not work here: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], tolerate=("No such file",))
    return None


def bring_up(spec: ClusterSpec, run_id: Optional[str] = None) -> Cluster:
    """Create the namespaces, bridge and links (unshaped). On any failure, removes what it made and raises."""
    cluster = plan_cluster(spec, run_id or new_run_id())
    made: List[str] = []
    try:
        for ns in cluster.namespaces:
            _run(["ip", "netns", "add", ns])
            made.append(ns)
        sw = ["ip", "-n", cluster.switch]
        _run(sw + ["link", "add", "br0", "type", "bridge"])
        _run(sw + ["link", "set", "br0", "up"])
        for i, (ns, addr) in enumerate(zip(cluster.nodes, cluster.addresses)):
            _run(sw + ["link", "add", f"p{i}", "type", "veth", "peer", "name", cluster.ifname, "netns", ns])
            _run(sw + ["link", "set", f"p{i}", "master", "br0"])
            _run(sw + ["link", "set", f"p{i}", "up"])
            node = ["ip", "-n", ns]
            _run(node + ["addr", "add", f"{addr}/24", "dev", cluster.ifname])
            _run(node + ["link", "set", cluster.ifname, "up"])
            _run(node + ["link", "set", "lo", "up"])
            _set_congestion_control(ns, cluster.congestion_control)
    except BaseException:
        _delete(made)
        raise
    return cluster


def _set_congestion_control(namespace: str, name: str) -> None:
    _run(["ip", "netns", "exec", namespace, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={name}"])


def congestion_control_of(namespace: str) -> str:
    """The TCP congestion control new sockets in ``namespace`` get."""
    return _run(["ip", "netns", "exec", namespace, "sysctl", "-n", "net.ipv4.tcp_congestion_control"]).strip()


def _links(cluster: Cluster) -> List[Tuple[str, str]]:
    """(namespace, device) for both ends of every node's link."""
    return ([(ns, cluster.ifname) for ns in cluster.nodes]
            + [(cluster.switch, f"p{i}") for i in range(len(cluster.nodes))])


def set_rate(cluster: Cluster, rate: str) -> None:
    """Cap every link at ``rate`` in both directions (tbf), or remove the cap for ``unshaped``."""
    parse_rate(rate)
    for ns, dev in _links(cluster):
        if rate == UNSHAPED:
            _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                 tolerate=("handle of zero", "No such file", "Invalid handle"))
        else:
            _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                  "burst", cluster.burst, "latency", cluster.latency])


def list_namespaces(prefix: str = PREFIX) -> List[str]:
    """Namespaces whose name starts with ``prefix`` (``ip netns list`` prints ``name (id: N)``)."""
    if shutil.which("ip") is None:
        return []
    out = _run(["ip", "netns", "list"])
    return sorted(line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix))


def _delete(namespaces: Sequence[str]) -> None:
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], tolerate=("No such file",))


def tear_down(cluster: Cluster) -> List[str]:
    """Delete every namespace of the cluster (their veths, bridge and qdiscs go with them).
    Returns what is still there afterwards (empty on success)."""
    errors = []
    for ns in cluster.namespaces:
        try:
            _delete([ns])
        except (ClusterError, OSError, subprocess.TimeoutExpired) as exc:
            errors.append(str(exc))
    left = list_namespaces(cluster.run_id)
    if errors and not left:
        left = errors
    return left


def owner_pid(namespace: str) -> Optional[int]:
    m = _NAME_RE.match(namespace)
    return int(m.group(1)) if m else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_namespaces() -> List[str]:
    """Namespaces made by this module whose creating process has exited (e.g. it was SIGKILLed)."""
    return [ns for ns in list_namespaces() if (pid := owner_pid(ns)) is not None and not _alive(pid)]


def remove_stale() -> List[str]:
    stale = stale_namespaces()
    _delete(stale)
    return stale


@contextlib.contextmanager
def emulated_cluster(spec: ClusterSpec, run_id: Optional[str] = None) -> Iterator[Cluster]:
    """Bring a cluster up, and always tear it down (error, Ctrl-C, SystemExit from a signal handler)."""
    cluster = bring_up(spec, run_id)
    failed = True
    try:
        yield cluster
        failed = False
    finally:
        left = tear_down(cluster)
        if left:
            message = (f"teardown left namespaces behind: {left}; remove them with `ip netns del NAME` "
                       f"or `moe-plugins bench --remove-stale`")
            if failed:       # do not hide the error that brought us here
                print(f"moe-plugins bench: {message}", file=sys.stderr)
            else:
                raise ClusterError(message)
