"""A multi-host test network on one machine: each task in its own network namespace.

``NetLab(["ps0", "w0", "w1"])`` makes, all named with one random tag:

* a *switch* namespace holding a Linux bridge;
* per host a namespace with a veth to the bridge and its own address on a
  private /24 chosen so that it collides with no route of this machine;
* a veth from this (the test's) namespace to the bridge, with the subnet's
  ``.1``, so the test process (the coordinator) reaches every host.

Faults act on the switch, where a host's port is: :meth:`cut` / :meth:`heal`
drop everything to and from a host (an nftables set of cut ports, in the
bridge family), :meth:`limit` shapes a host's link both ways with a token
bucket (``tc tbf``), :meth:`drop` loses a share of its packets (nftables
``numgen``). :meth:`start` runs a command in a host's namespace. Leaving the
``with`` block (a failing test included) stops those processes by PID and
deletes every namespace, link and rule it made.

Root is required (``ip netns``, nftables, tc); without it the constructor
raises with a message saying so: tests fail, never skip in silence.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
from typing import Any

TOOLS = ("ip", "nft", "tc")


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and result.returncode:
        raise RuntimeError(f"{' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 that no route or address of this machine touches."""
    used = []
    for line in _run("ip", "-4", "route", "show", "table", "all").stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        if word[:1].isdigit():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{secrets.randbelow(8) + 200}.{secrets.randbelow(256)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free private /24 for the test network")


class NetLab:
    """Hosts in namespaces on one bridge; see the module docstring."""

    def __init__(self, hosts: list[str]) -> None:
        if os.geteuid() != 0:
            raise RuntimeError(
                "the multi-host tests need root (network namespaces, nftables, tc); "
                "run them as root, as `make test` on the CI machine does"
            )
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            raise RuntimeError(
                f"the multi-host tests need {', '.join(missing)} (Debian: apt-get "
                "install iproute2 nftables); `make test` installs them"
            )
        self.hosts = list(hosts)
        self.tag = "pl" + secrets.token_hex(3)
        self.subnet = _free_subnet()
        base = self.subnet.network_address
        self.gateway = str(base + 1)
        self._addresses = {h: str(base + 10 + i) for i, h in enumerate(self.hosts)}
        self.switch = f"{self.tag}sw"
        self._procs: list[subprocess.Popen[Any]] = []
        self._made_ns: list[str] = []
        self._made_links: list[str] = []

    # -- names ----------------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.tag}{self.hosts.index(host)}"

    def _port(self, host: str) -> str:  # the host's veth end on the switch
        return f"{self.tag}p{self.hosts.index(host)}"

    def address(self, host: str) -> str:
        return self._addresses[host]

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> NetLab:
        try:
            self._build()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _build(self) -> None:
        sw = self.switch
        _run("ip", "netns", "add", sw)
        self._made_ns.append(sw)
        _run("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", sw, "link", "set", "br0", "up")
        rules = (
            "table bridge lab {\n"
            "  set cut { type ifname; }\n"
            "  chain forward_chain { type filter hook forward priority 0;\n"
            "    iifname @cut drop\n    oifname @cut drop\n  }\n}\n"
        )
        result = subprocess.run(
            ["ip", "netns", "exec", sw, "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if result.returncode:
            raise RuntimeError(f"nft failed: {result.stderr.strip()}")
        for host in self.hosts:
            ns, inner, port = self.ns(host), f"{self.tag}h{self.hosts.index(host)}", self._port(host)
            _run("ip", "netns", "add", ns)
            self._made_ns.append(ns)
            _run("ip", "link", "add", inner, "type", "veth", "peer", "name", port)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", port, "netns", sw)
            _run("ip", "-n", sw, "link", "set", port, "master", "br0")
            _run("ip", "-n", sw, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", inner)
            _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        here, port = f"{self.tag}r", f"{self.tag}q"
        _run("ip", "link", "add", here, "type", "veth", "peer", "name", port)
        self._made_links.append(here)
        _run("ip", "link", "set", port, "netns", sw)
        _run("ip", "-n", sw, "link", "set", port, "master", "br0")
        _run("ip", "-n", sw, "link", "set", port, "up")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", here)
        _run("ip", "link", "set", here, "up")

    def __exit__(self, *exc: Any) -> None:
        for proc in self._procs:  # only what this lab started, by its PID
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream is not None:
                    stream.close()
        for link in self._made_links:
            _run("ip", "link", "del", link, check=False)
        for ns in reversed(self._made_ns):  # a namespace takes its links and rules with it
            _run("ip", "netns", "del", ns, check=False)
        self._made_ns.clear()
        self._made_links.clear()

    # -- processes ------------------------------------------------------------------------------
    def start(
        self, host: str, *args: str, env: dict[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Run ``args`` in ``host``'s namespace; stopped (by PID) when the lab closes."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *args], env=env, **popen)
        self._procs.append(proc)
        return proc

    # -- faults ---------------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """Drop every packet to and from ``host`` (both directions), until :meth:`heal`."""
        _run(
            "ip",
            "netns",
            "exec",
            self.switch,
            "nft",
            "add",
            "element",
            "bridge",
            "lab",
            "cut",
            f"{{ {self._port(host)} }}",
        )

    def heal(self, host: str) -> None:
        _run(
            "ip",
            "netns",
            "exec",
            self.switch,
            "nft",
            "delete",
            "element",
            "bridge",
            "lab",
            "cut",
            f"{{ {self._port(host)} }}",
        )

    def limit(self, host: str, rate: str) -> None:
        """Shape ``host``'s link to ``rate`` (tc syntax: ``1gbit``) in both directions."""
        inner = f"{self.tag}h{self.hosts.index(host)}"
        for ns, dev in ((self.switch, self._port(host)), (self.ns(host), inner)):
            _run(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            )

    def drop(self, host: str, percent: int) -> None:
        """Lose ``percent`` % of the packets to and from ``host``."""
        port = self._port(host)
        for direction in ("iifname", "oifname"):
            _run(
                "ip",
                "netns",
                "exec",
                self.switch,
                "nft",
                "add",
                "rule",
                "bridge",
                "lab",
                "forward_chain",
                direction,
                port,
                "numgen",
                "random",
                "mod",
                "100",
                "<",
                str(int(percent)),
                "drop",
            )
