"""Hosts simulated on one machine: a network namespace per host, each joined by a veth pair to a
bridge in the root namespace (``ip netns``, root only). Processes run in a host with
``ip netns exec NS ...`` (``Hosts.run``); a partition is a host's link taken down.

Interface, namespace and bridge names start with a prefix of their own, and one lock file
serializes the runs that use a prefix, so a run can first remove what a killed one left behind.
Names stay within Linux's 15 characters.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


class NetnsUnavailable(RuntimeError):
    """This machine (or this user) cannot make network namespaces."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def probe(prefix: str) -> None:
    """Raise ``NetnsUnavailable`` (with the reason) unless ``ip netns add`` works here."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("no `ip` command (iproute2)")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root (ip netns add), and this runs as uid "
                               f"{os.geteuid()}")
    name = f"{prefix}-probe"
    _ip("netns", "del", name, check=False)
    result = _ip("netns", "add", name, check=False)
    if result.returncode != 0:
        raise NetnsUnavailable(f"`ip netns add` failed: {result.stderr.strip()}")
    _ip("netns", "del", name, check=False)


class Hosts:
    """One namespace per name in ``hosts`` (name -> last octet of its address in ``subnet``.0/24),
    each with ``eth0`` on the bridge ``PREFIX-br``, whose root-namespace side holds ``subnet``.1
    (the tests reach every host from there). ``close`` removes everything ``build`` made."""

    def __init__(self, prefix: str, subnet: str, hosts: dict[str, int], lock_dir: Path = Path("/tmp")) -> None:
        if len(prefix) + 1 + max(len(h) for h in hosts) > 15 or len(prefix) + 3 > 15:
            raise ValueError("interface names are at most 15 characters")
        self.prefix, self.subnet, self.hosts = prefix, subnet, dict(hosts)
        self.bridge = f"{prefix}-br"
        self._lock_path = lock_dir / f"mooncake-test-{prefix}.lock"
        self._lock: int | None = None

    # -- names -----------------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def link(self, host: str) -> str:
        """The root-namespace end of ``host``'s veth pair (its port on the bridge)."""
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts[host]}"

    def root_address(self) -> str:
        return f"{self.subnet}.1"

    def run(self, host: str, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run inside ``host``."""
        return ["ip", "netns", "exec", self.ns(host), *cmd]

    # -- life ------------------------------------------------------------------------------------------
    def build(self, lock_timeout_s: float = 300.0) -> None:
        """Take the prefix's lock (another run may hold it), clear what a killed run left, and
        make the bridge and the hosts. Raises ``RuntimeError`` if the network cannot be made."""
        self._lock = os.open(self._lock_path, os.O_CREAT | os.O_RDWR, 0o600)
        deadline = time.monotonic() + lock_timeout_s
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    os.close(self._lock)
                    self._lock = None
                    raise RuntimeError(f"another run holds {self._lock_path}") from e
                time.sleep(0.5)
        self._remove()
        _ip("link", "add", self.bridge, "type", "bridge")
        # Bridged frames must not meet the root namespace's iptables (a FORWARD policy of DROP,
        # as Docker sets, would drop them when br_netfilter is loaded); older kernels lack the knob.
        _ip("link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
        _ip("addr", "add", f"{self.root_address()}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            ns, link = self.ns(host), self.link(host)
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", link, "master", self.bridge)
            _ip("link", "set", link, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _remove(self) -> None:
        listed = _ip("netns", "list", check=False).stdout.split("\n")
        for line in listed:
            name = line.split(" ", 1)[0]
            if name.startswith(self.prefix + "-"):
                _ip("netns", "del", name, check=False)  # its end of a veth pair goes, and the pair with it
        for host in self.hosts:
            _ip("link", "del", self.link(host), check=False)
        _ip("link", "del", self.bridge, check=False)

    def close(self) -> None:
        """Remove the hosts and the bridge (stop the processes in them first) and release the lock."""
        try:
            self._remove()
        finally:
            if self._lock is not None:
                os.close(self._lock)  # releases the flock
                self._lock = None

    # -- faults and views ----------------------------------------------------------------------------
    def set_link(self, host: str, up: bool) -> None:
        """Take ``host``'s link to the bridge down (a partition: nothing reaches it or leaves it)
        or bring it back up."""
        _ip("link", "set", self.link(host), "up" if up else "down")

    def counters(self, host: str) -> tuple[int, int]:
        """Bytes (sent, received) by ``host`` over its link so far (its veth end in the root
        namespace counts the other way round)."""
        stats = Path("/sys/class/net") / self.link(host) / "statistics"
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    def connections(self, host: str) -> list[tuple[str, str]]:
        """``host``'s established TCP connections, as (local address:port, peer address:port)."""
        out = subprocess.run(self.run(host, ["ss", "-Htn", "state", "established"]), capture_output=True,
                             text=True, timeout=30, check=True).stdout
        pairs = []
        for line in out.splitlines():
            fields = line.split()
            if len(fields) >= 4:
                pairs.append((fields[-2], fields[-1]))
        return pairs
