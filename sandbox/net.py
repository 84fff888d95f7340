"""Per-host network namespaces, veth pairs and the NAT that lets hosts reach apt and PyPI.

Host N lives in netns ``gpu-sbx-N``; the veth pair is ``vsbx-N`` (host side, 10.213.N.1/30)
and ``eth0`` inside (10.213.N.2/30, default route via 10.213.N.1). The addresses only exist
inside namespaces this tool creates. The address config is done from outside, so it survives
the container rebooting and the image needs no network manager.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass
from pathlib import Path

from sandbox.util import SandboxError, run

SUBNET = "10.213.0.0/16"
NAT_COMMENT = "pyinfra-vllm-sandbox"
IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")
# Rules this tool owns, all tagged with NAT_COMMENT so `down` can find leftovers too.
RULES: tuple[tuple[str, str, list[str]], ...] = (
    ("nat", "POSTROUTING", ["-s", SUBNET, "!", "-d", SUBNET, "-j", "MASQUERADE"]),
    # Explicit accepts so a host firewall with FORWARD policy DROP (docker, ufw) still routes us.
    ("filter", "FORWARD", ["-s", SUBNET, "-j", "ACCEPT"]),
    ("filter", "FORWARD", ["-d", SUBNET, "-j", "ACCEPT"]),
)


@dataclass(frozen=True)
class HostNet:
    index: int

    @property
    def netns(self) -> str:
        return f"gpu-sbx-{self.index}"

    @property
    def veth(self) -> str:
        return f"vsbx-{self.index}"

    @property
    def gateway(self) -> str:
        """Host-side address: what the host reaches the machine from, and its default route."""
        return f"10.213.{self.index}.1"

    @property
    def address(self) -> str:
        """The sandbox host's own address (sshd listens here on port 22)."""
        return f"10.213.{self.index}.2"


def check_index(index: int) -> None:
    if not 1 <= index <= 254:
        raise SandboxError(f"host index {index} out of range 1..254")
    ipaddress.ip_address(f"10.213.{index}.2")


def netns_list() -> list[str]:
    out = run(["ip", "netns", "list"], step="net: list namespaces").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def create(net: HostNet) -> None:
    """netns + veth + addresses + default route for one host."""
    check_index(net.index)
    if net.netns in netns_list():
        raise SandboxError(
            f"net: namespace {net.netns} already exists (run `python -m sandbox down`)"
        )
    step = f"net: set up {net.netns}"
    run(["ip", "netns", "add", net.netns], step=step)
    run(
        ["ip", "link", "add", net.veth, "type", "veth", "peer", "name", "eth0", "netns", net.netns],
        step=step,
    )
    run(["ip", "addr", "add", f"{net.gateway}/30", "dev", net.veth], step=step)
    run(["ip", "link", "set", net.veth, "up"], step=step)
    inside = ["ip", "netns", "exec", net.netns]
    run([*inside, "ip", "link", "set", "lo", "up"], step=step)
    run([*inside, "ip", "addr", "add", f"{net.address}/30", "dev", "eth0"], step=step)
    run([*inside, "ip", "link", "set", "eth0", "up"], step=step)
    run([*inside, "ip", "route", "add", "default", "via", net.gateway], step=step)


def destroy(netns: str, veth: str) -> list[str]:
    """Remove one host's netns and veth; returns problems instead of raising (teardown)."""
    problems = []
    # Deleting the netns takes the inner veth end with it, and so the host end.
    if netns in netns_list():
        proc = run(["ip", "netns", "del", netns], step="net: delete netns", check=False)
        if proc.returncode != 0:
            problems.append(f"ip netns del {netns}: {proc.stderr.strip()}")
    # The host end goes away asynchronously after the netns is deleted: give it a moment.
    for _ in range(20):
        if not Path(f"/sys/class/net/{veth}").exists():
            break
        time.sleep(0.1)
    else:
        proc = run(["ip", "link", "del", veth], step="net: delete veth", check=False)
        if proc.returncode != 0 and Path(f"/sys/class/net/{veth}").exists():
            problems.append(f"ip link del {veth}: {proc.stderr.strip()}")
    return problems


def _tagged(spec: list[str]) -> list[str]:
    return [*spec, "-m", "comment", "--comment", NAT_COMMENT]


def enable_nat() -> bool:
    """Turn on forwarding and add our rules; returns whether ip_forward had to be switched on."""
    switched = IP_FORWARD.read_text().strip() != "1"
    if switched:
        IP_FORWARD.write_text("1\n")
    for table, chain, spec in RULES:
        rule = _tagged(spec)
        exists = run(
            ["iptables", "-t", table, "-C", chain, *rule], step="net: check rule", check=False
        )
        if exists.returncode != 0:
            # FORWARD accepts go first so they win over any DROP rule already there.
            op = "-A" if table == "nat" else "-I"
            run(["iptables", "-t", table, op, chain, *rule], step=f"net: add {table}/{chain} rule")
    return switched


def disable_nat(restore_ip_forward: bool) -> list[str]:
    """Remove every rule tagged with our comment; put ip_forward back if we switched it on."""
    problems = []
    for table, chain in {(t, c) for t, c, _ in RULES}:
        listing = run(["iptables", "-t", table, "-S", chain], step="net: list rules", check=False)
        for line in listing.stdout.splitlines():
            if NAT_COMMENT not in line or not line.startswith("-A "):
                continue
            spec = line.split()[2:]
            spec = [part.strip('"') for part in spec]
            proc = run(
                ["iptables", "-t", table, "-D", chain, *spec], step="net: delete rule", check=False
            )
            if proc.returncode != 0:
                problems.append(
                    f"iptables -t {table} -D {chain} {' '.join(spec)}: {proc.stderr.strip()}"
                )
    if restore_ip_forward:
        IP_FORWARD.write_text("0\n")
    return problems


def leftover_rules() -> list[str]:
    found = []
    for table in ("nat", "filter"):
        proc = run(["iptables", "-t", table, "-S"], step="net: list rules", check=False)
        found += [f"{table}: {line}" for line in proc.stdout.splitlines() if NAT_COMMENT in line]
    return found
