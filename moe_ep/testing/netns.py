"""An emulated two-host cluster on one Linux machine: one network namespace per "host", joined by a
veth pair whose rate (and optional delay) is shaped with ``tc`` on both ends; ranks of a host share
their namespace and talk to each other through it (own-address traffic never leaves the namespace),
ranks of different hosts cross the shaped veth. Needs root (``ip netns``, ``tc``).

    with TwoHostCluster(rate="1gbit") as cluster:
        results = cluster.run("mypkg.mod:fn", ranks_per_host=2, kwargs={...})

``fn`` (``"module:function"`` or ``"path/file.py:function"``) is called as ``fn(rank, world_size, **kwargs)``
in a fresh ``python`` process per rank with a gloo process group
(rendezvous over a TCPStore on host A's address, gloo bound to the namespace's veth); its JSON-able
return value comes back. Inside ``fn``, :func:`link_bytes` reads the host's veth byte counters.
The namespaces (and with them the veth pair and its qdiscs) are removed on exit, on error, and at
interpreter exit; only traffic between these two namespaces is created.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

__all__ = ["TwoHostCluster", "available", "link_bytes", "run_local"]

_RESULT = "MOE_EP_NETNS_RESULT "
_ADDRS = ("10.77.0.1", "10.77.0.2")
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds moe_ep/


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> tuple[bool, str]:
    """Whether namespaces, veth pairs and tc work here: ``(ok, reason)`` (creates and removes a probe)."""
    if sys.platform != "linux":
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root"
    ns, a, b = f"mepprobe{os.getpid()}", f"mpa{os.getpid()}"[:15], f"mpb{os.getpid()}"[:15]
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("link", "set", b, "netns", ns)
        subprocess.run(["tc", "qdisc", "add", "dev", a, "root", "tbf", "rate", "1gbit", "burst", "64kb",
                        "latency", "50ms"], capture_output=True, text=True, check=True, timeout=30)
        return True, ""
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", "") or str(exc)
        return False, f"network namespaces / veth / tc not permitted here: {err.strip()}"
    finally:
        _ip("link", "del", a, check=False)
        _ip("netns", "del", ns, check=False)


class TwoHostCluster:
    """Two namespaces ``A`` (10.77.0.1) and ``B`` (10.77.0.2) joined by a shaped veth pair.

    Arguments:
        rate: ``tc`` rate of each direction (``"1gbit"``, ``"100mbit"``, ...).
        delay_ms: one-way delay added with netem (0: tbf only).
        burst: tbf bucket size.
    """

    def __init__(self, rate: str = "1gbit", delay_ms: float = 0.0, burst: str = "128kb"):
        tag = os.getpid()
        self.rate, self.delay_ms, self.burst = rate, delay_ms, burst
        self.namespaces = (f"mep{tag}a", f"mep{tag}b")
        self.ifaces = (f"mv{tag}a"[:15], f"mv{tag}b"[:15])
        self.addrs = _ADDRS
        self._up = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "TwoHostCluster":
        atexit.register(self.stop)
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            self._up = True
            _ip("link", "add", self.ifaces[0], "netns", self.namespaces[0], "type", "veth", "peer", "name",
                self.ifaces[1], "netns", self.namespaces[1])
            for ns, dev, addr in zip(self.namespaces, self.ifaces, self.addrs):
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                if self.delay_ms:
                    qdisc = ["netem", "delay", f"{self.delay_ms}ms", "rate", self.rate, "limit", "10000"]
                else:
                    qdisc = ["tbf", "rate", self.rate, "burst", self.burst, "latency", "100ms"]
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *qdisc],
                               capture_output=True, text=True, check=True, timeout=30)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Remove both namespaces (the veth pair and its qdiscs go with them); idempotent."""
        if self._up:
            for ns in self.namespaces:
                _ip("netns", "del", ns, check=False)
            self._up = False

    def __enter__(self) -> "TwoHostCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def describe(self) -> str:
        shaping = f"netem {self.rate} + {self.delay_ms} ms" if self.delay_ms else f"tbf {self.rate}"
        return f"2 netns hosts joined by a veth pair ({shaping} each way)"

    # ------------------------------------------------------------------ running ranks
    def run(self, fn: str, ranks_per_host: int, kwargs: Optional[dict] = None, timeout_s: float = 300.0,
            port: int = 29611) -> list:
        """Run ``fn`` (``"module:function"``) on ``2 * ranks_per_host`` ranks, ranks ``0..G-1`` in host A."""
        hosts = [(self.namespaces[r // ranks_per_host], self.ifaces[r // ranks_per_host])
                 for r in range(2 * ranks_per_host)]
        return _spawn(fn, hosts, self.addrs[0], port, kwargs or {}, timeout_s)


def run_local(fn: str, world_size: int, kwargs: Optional[dict] = None, timeout_s: float = 300.0,
              port: Optional[int] = None) -> list:
    """The same as :meth:`TwoHostCluster.run`, all ranks on this machine's loopback (no shaping)."""
    if port is None:  # a free loopback port, so concurrent runs never collide
        import socket
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    return _spawn(fn, [(None, "lo")] * world_size, "127.0.0.1", port, kwargs or {}, timeout_s)


def _spawn(fn: str, hosts: list, master: str, port: int, kwargs: dict, timeout_s: float) -> list:
    world = len(hosts)
    procs = []
    try:
        for rank, (ns, iface) in enumerate(hosts):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=master, MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME=iface, MOE_EP_NETNS_IFACE=iface if ns else "",
                       MOE_EP_NETNS_CALL=fn, MOE_EP_NETNS_KWARGS=json.dumps(kwargs), OMP_NUM_THREADS="1",
                       PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
            cmd = [sys.executable, "-m", "moe_ep.testing.netns"]
            if ns:
                cmd = ["ip", "netns", "exec", ns, *cmd]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        deadline = time.monotonic() + timeout_s
        outs = []
        for rank, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"rank {rank} of {fn} did not finish within {timeout_s:.0f} s") from None
            lines = [ln for ln in out.splitlines() if ln.startswith(_RESULT)]
            if p.returncode != 0 or not lines:
                raise RuntimeError(f"rank {rank} of {fn} failed (exit {p.returncode}):\n{err[-3000:]}")
            outs.append(json.loads(lines[-1][len(_RESULT):]))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def link_bytes() -> Optional[tuple[int, int]]:
    """``(tx_bytes, rx_bytes)`` of this host's veth (inside a :class:`TwoHostCluster` rank), else ``None``."""
    iface = os.environ.get("MOE_EP_NETNS_IFACE")
    if not iface:
        return None
    stats = f"/sys/class/net/{iface}/statistics"
    with open(f"{stats}/tx_bytes") as f_tx, open(f"{stats}/rx_bytes") as f_rx:
        return int(f_tx.read()), int(f_rx.read())


def _worker_main() -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=300))
    module, name = os.environ["MOE_EP_NETNS_CALL"].rsplit(":", 1)
    if module.endswith(".py"):  # a file path (a test or a perf script)
        spec = importlib.util.spec_from_file_location(f"_moe_ep_netns_{rank}", module)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(module)
    fn: Any = getattr(mod, name)
    result = fn(rank, world, **json.loads(os.environ["MOE_EP_NETNS_KWARGS"]))
    print(_RESULT + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown (peers may have left)


if __name__ == "__main__":
    _worker_main()
