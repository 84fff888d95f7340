"""CLI: python -m sandbox up|down|status|rootfs.

up --hosts N [--scenario seed,pcie,...] [--disk-size 4G] [--model-base-url URL] [--tls]
            [--routers M]  (M more hosts: front doors in front of the N, with --tls)
down        tear everything down (processes, mounts, loop devices, netns, veths, NAT)
status      hosts, their pids and RSS, and any leftovers
rootfs      build (or show) the cached root file system
chat        a chat completion through a host's gateway (or, --router, the front door),
            with the API key; prints the command a user would type for it
"""

from __future__ import annotations

import argparse
import json
import sys

from sandbox import chat, hosts, rootfs
from sandbox.util import SandboxError


def _scenarios(text: str | None) -> list[str] | None:
    if not text:
        return None
    return [part.strip() for part in text.split(",") if part.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sandbox",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="boot sandbox hosts and write .sandbox/inventory.py")
    up.add_argument("--hosts", type=int, default=1)
    up.add_argument(
        "--scenario",
        "--scenarios",
        dest="scenario",
        default=None,
        help=f"comma list, cycled over the hosts ({', '.join(hosts.SCENARIOS)}); default seed",
    )
    up.add_argument(
        "--disk-size",
        default=hosts.DEFAULT_DISK_SIZE,
        help="size of each host's spare loop disk (sparse), at least 2G",
    )
    up.add_argument(
        "--model-base-url",
        default=None,
        help="host data model_base_url; '{gateway}' becomes the host-side address",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="gateways serve HTTPS with a self-signed certificate (.sandbox/tls/cert.pem)",
    )
    up.add_argument(
        "--own-caches",
        action="store_true",
        help="each host gets a hard-linked copy of the package caches instead of the shared "
        "bind mount, and builds environments with hard links (bench/fresh_host.sh)",
    )
    up.add_argument(
        "--routers",
        type=int,
        default=0,
        help="this many more hosts, front doors (the inventory's routers group) in front of "
        "the others' gateways; needs --tls",
    )
    sub.add_parser("down", help="tear the sandbox down")
    st = sub.add_parser("status", help="show hosts and leftovers")
    st.add_argument("--json", action="store_true")
    ch = sub.add_parser("chat", help="a chat completion through a host's gateway")
    ch.add_argument("--host", default=None, help="host name (default: the first)")
    ch.add_argument("--router", action="store_true",
                    help="through the first front door (a host of `up --routers`)")
    ch.add_argument("message", nargs="?", default="Hello! Who are you?")
    rf = sub.add_parser("rootfs", help="build the cached rootfs now")
    rf.add_argument("--force", action="store_true", help="rebuild even if cached")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "up":
            hosts.up(
                args.hosts,
                _scenarios(args.scenario),
                disk_size=args.disk_size,
                model_base_url=args.model_base_url,
                tls=args.tls,
                own_caches=args.own_caches,
                routers=args.routers,
            )
        elif args.command == "down":
            problems = hosts.down()
            for problem in problems:
                print(f"problem: {problem}", file=sys.stderr)
            if problems:
                return 1
            print("sandbox down: nothing left behind")
        elif args.command == "status":
            rows, left = hosts.status(), hosts.leftovers()
            if args.json:
                print(json.dumps({"hosts": rows, "leftovers": left}, indent=2))
            else:
                for row in rows:
                    print(
                        f"{row['name']:<11} {row['address']:<12} {row['scenario']:<9} "
                        f"{row['loop_device']:<11} pid={row['nspawn_pid']} "
                        f"rss={row['rss_mib']}MiB"
                    )
                if not rows:
                    print("no sandbox hosts")
                for item in left:
                    print(f"present: {item}")
        elif args.command == "chat":
            state = hosts.load_state()
            if not state or not state["hosts"]:
                raise SandboxError("no sandbox: python -m sandbox up first")
            chosen = [h for h in state["hosts"] if args.host in (None, h["name"])
                      and (h.get("router", False) or not args.router)]
            if not chosen:
                raise SandboxError(f"no sandbox host {args.host}" if args.host else
                                   "no front door: python -m sandbox up --routers 1 --tls")
            chat.main(chosen[0], args.message)
        elif args.command == "rootfs":
            if args.force and hosts.leftovers():
                # Running hosts use the rootfs as their overlay lowerdir.
                raise SandboxError("rootfs --force: the sandbox is up; run `down` first")
            print(rootfs.build(force=args.force))
    except SandboxError as exc:
        print(f"sandbox: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
