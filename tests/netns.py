"""Several hosts on one machine: each process in its own network namespace.

Every host gets a namespace ``<prefix>-<name>`` with one veth link to a bridge in the root
namespace (``<prefix>A``, 10.77.0.0/24; the root namespace is 10.77.0.1, so the test process
reaches everyone). ``partition(names)`` moves those hosts' links onto a second bridge: they
still reach each other, and nothing else; ``heal()`` moves them back. Needs root and iproute2.
"""

from __future__ import annotations

import shutil
import subprocess


class NetnsLab:
    def __init__(self, names: list[str], prefix: str = "sps", subnet: str = "10.77.0"):
        self.names = list(names)
        self.prefix = prefix
        self.subnet = subnet
        self.main = f"{prefix}A"
        self.minority = f"{prefix}B"
        self.ip = {n: f"{subnet}.{10 + i}" for i, n in enumerate(self.names)}
        self.partitioned: list[str] = []

    @staticmethod
    def available() -> str:
        """'' when namespaces can be made here, else the reason they cannot."""
        if shutil.which("ip") is None:
            return "iproute2 (`ip`) is not installed"
        probe = "spsprobe"
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if r.returncode != 0:
            return f"cannot create network namespaces: {r.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return ""

    def _ip(self, *args: str, ns: str | None = None) -> None:
        cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")

    def ns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def veth(self, name: str) -> str:
        return f"{self.prefix}v{self.names.index(name)}"

    def _forwarding(self, add: bool) -> None:
        """With br_netfilter loaded (Docker loads it and sets FORWARD to DROP), bridged frames
        pass the iptables FORWARD chain: let our bridges' traffic through."""
        if shutil.which("iptables") is None:
            return
        for bridge in (self.main, self.minority):
            rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
            while subprocess.run(["iptables", "-D"] + rule, capture_output=True).returncode == 0:
                pass
            if add:
                subprocess.run(["iptables", "-I"] + rule, capture_output=True)

    def up(self) -> "NetnsLab":
        self.down()
        for bridge in (self.main, self.minority):
            self._ip("link", "add", bridge, "type", "bridge")
            self._ip("link", "set", bridge, "up")
        self._forwarding(True)
        self._ip("addr", "add", f"{self.subnet}.1/24", "dev", self.main)
        for name in self.names:
            ns, v = self.ns(name), self.veth(name)
            self._ip("netns", "add", ns)
            self._ip("link", "add", v, "type", "veth", "peer", "name", f"{v}p")
            self._ip("link", "set", f"{v}p", "netns", ns)
            self._ip("addr", "add", f"{self.ip[name]}/24", "dev", f"{v}p", ns=ns)
            self._ip("link", "set", f"{v}p", "up", ns=ns)
            self._ip("link", "set", "lo", "up", ns=ns)
            self._ip("link", "set", v, "master", self.main)
            self._ip("link", "set", v, "up")
        return self

    def wrap(self, name: str) -> list[str]:
        """Command prefix running a process inside ``name``'s namespace."""
        return ["ip", "netns", "exec", self.ns(name)] if name in self.ip else []

    def partition(self, names: list[str]) -> None:
        for name in names:
            self._ip("link", "set", self.veth(name), "master", self.minority)
        self.partitioned = list(names)

    def heal(self) -> None:
        for name in self.partitioned:
            self._ip("link", "set", self.veth(name), "master", self.main)
        self.partitioned = []

    def down(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "link", "del", self.veth(name)], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.ns(name)], capture_output=True)
        for bridge in (self.main, self.minority):
            subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        self._forwarding(False)
