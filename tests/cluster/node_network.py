"""The real node's own network: a network namespace joined to the host by a veth pair, with addresses and
routes of its own, so that the kubelet has a node IP that is not loopback and traffic never leaves the machine.

Each test run picks a free index, so two runs on one machine get disjoint names and addresses:
host 10.201.N.1, node 10.201.N.2, pods 10.202.N.0/24, Services 10.203.N.0/24.
"""

from __future__ import annotations

import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

NETNS_FOLDER = Path("/run/netns")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass(frozen=True)
class NodeNetwork:
    index: int

    @property
    def namespace(self) -> str:
        return f"capstan-node-{self.index}"

    @property
    def host_interface(self) -> str:
        return f"capstan{self.index}"  # at most 15 characters

    host_ip = property(lambda self: f"10.201.{self.index}.1")
    node_ip = property(lambda self: f"10.201.{self.index}.2")
    pod_cidr = property(lambda self: f"10.202.{self.index}.0/24")
    service_cidr = property(lambda self: f"10.203.{self.index}.0/24")

    def enter(self) -> list[str]:
        """The prefix that runs a command inside the namespace (network only: mounts stay shared with the host,
        so the kubelet's volume mounts are visible to containerd's runc)."""
        return ["nsenter", f"--net={NETNS_FOLDER / self.namespace}", "--"]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.enter(), *args], capture_output=True, text=True, check=check, timeout=30)

    def destroy(self) -> None:
        """Deleting the namespace deletes the veth pair, and the host's routes through it with it."""
        ip("netns", "delete", self.namespace, check=False)
        ip("link", "delete", self.host_interface, check=False)


def create_node_network() -> NodeNetwork:
    for index in random.sample(range(1, 255), 254):
        network = NodeNetwork(index)
        if ip("netns", "add", network.namespace, check=False).returncode == 0:  # atomic: a taken name fails
            break
    else:
        raise RuntimeError("no free capstan-node-N network namespace")
    try:
        node_side = f"{network.host_interface}n"
        ip("link", "add", network.host_interface, "type", "veth", "peer", "name", node_side, "netns", network.namespace)
        ip("addr", "add", f"{network.host_ip}/24", "dev", network.host_interface)
        ip("link", "set", network.host_interface, "up")
        network.run("ip", "link", "set", "lo", "up")
        network.run("ip", "link", "set", node_side, "name", "eth0")
        network.run("ip", "addr", "add", f"{network.node_ip}/24", "dev", "eth0")
        network.run("ip", "link", "set", "eth0", "up")
        network.run("ip", "route", "add", "default", "via", network.host_ip)
        network.run("sysctl", "-q", "-w", "net.ipv4.ip_forward=1")  # the node routes between pods and the host
        # The test process reaches pods and Services the way another machine on the node's network would.
        ip("route", "add", network.pod_cidr, "via", network.node_ip)
        ip("route", "add", network.service_cidr, "via", network.node_ip)
    except Exception:
        network.destroy()
        raise
    return network
