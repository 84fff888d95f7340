"""Command line: ``python3 -m sandbox.mirror {generate,serve}``.

``generate --out DIR`` writes one repo into DIR and prints its manifest summary as JSON.
``serve --root DIR`` serves every repo under DIR (generating the default one at
``DIR/<repo-id>`` when there is none), prints the URL it listens on as the first line of
stdout, and runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

from sandbox.mirror import model, server


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m sandbox.mirror", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="write the tiny model repository")
    gen.add_argument("--out", type=Path, required=True, help="repository directory")
    _repo_args(gen)
    serve = sub.add_parser("serve", help="serve generated repositories over HTTP")
    serve.add_argument("--root", type=Path, required=True, help="directory holding the repos")
    serve.add_argument("--bind", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port")
    serve.add_argument("--token-file", type=Path, help="require this bearer token (gated repo)")
    serve.add_argument("--pid-file", type=Path, help="write the server's pid here")
    serve.add_argument("--url-file", type=Path, help="also write the URL here")
    serve.add_argument("--verbose", action="store_true", help="log requests to stderr")
    _repo_args(serve)
    return parser


def _repo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repo-id", default=model.DEFAULT_REPO_ID)
    parser.add_argument("--revision", default=model.DEFAULT_REVISION, help="branch name")
    parser.add_argument("--seed", type=int, default=0)


def _summary(manifest: dict[str, object]) -> dict[str, object]:
    return {k: manifest[k] for k in ("repo_id", "revision", "sha", "total_size", "weights")}


def cmd_generate(args: argparse.Namespace) -> int:
    manifest = model.generate(args.out, repo_id=args.repo_id, revision=args.revision,
                              seed=args.seed)
    print(json.dumps(_summary(manifest), indent=1))
    return 0


def _read_token(path: Path | None) -> str | None:
    if path is None:
        return None
    token = path.read_text(encoding="utf-8").strip()
    if not token:
        raise SystemExit(f"{path}: token file is empty")
    return token


def cmd_serve(args: argparse.Namespace) -> int:
    root: Path = args.root
    if not (root.is_dir() and server.discover(root)):  # generate only into an empty root
        model.generate(root / args.repo_id, repo_id=args.repo_id, revision=args.revision,
                       seed=args.seed)
    mirror = server.MirrorServer(root, bind=args.bind, port=args.port,
                                 token=_read_token(args.token_file), quiet=not args.verbose)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if args.pid_file:
        args.pid_file.write_text(f"{os.getpid()}\n", encoding="utf-8")
    try:
        mirror.start()
        if args.url_file:
            args.url_file.write_text(mirror.url + "\n", encoding="utf-8")
        # The URL alone on the first line, so a script can read it; details go to stderr.
        print(mirror.url, flush=True)
        for repo in mirror.repos.values():
            print(f"serving {repo.repo_id}@{repo.revision} ({repo.sha}) from {repo.directory}",
                  file=sys.stderr, flush=True)
        stop.wait()
    finally:
        mirror.stop()
        if args.pid_file:
            args.pid_file.unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return cmd_generate(args) if args.command == "generate" else cmd_serve(args)


if __name__ == "__main__":
    sys.exit(main())
