"""Who owns the suite's secrets and the engine's access paths, and who may use them: one
table, each path with its owner, group, mode and kind, the stage that keeps it and the
settings that make it apply (pyinfra_vllm/operations/access.py puts them back; docs/security.md
lists them).

A path of the table that exists with another owner, group or mode (a ``chmod 0644`` of
the engine's key, a ``chmod 0777`` of the engine's socket directory) is drift: the
audit names it and the next run puts it back, without following a symbolic link and
without a moment in which the path is more open than both what was found and what is
declared. A path that is a symbolic link or another kind than its row's is never
changed: the stage refuses the host, naming it. A path that does not exist is not
made here: the operation that writes it makes it with its row's mode (a secret from
its first byte), and a run reads it next time.

Every path's parent directory is root's and no other user can write it (``/etc/vllm``,
``/etc/nginx``, ``/run``, the spool), so nobody can swap a path between the read and
the change; except the engine's socket, whose directory is the engine's user's: its
mode is changed as that user (who could do that much already), never as root.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pyinfra_vllm.core.settings import Settings
from pyinfra_vllm.plans import engine_access
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.plans import router as router_plan
from pyinfra_vllm.plans import vllm_service as vllm_service_plan
from pyinfra_vllm.plans.engine_access import Endpoint

# The spools of pyinfra_vllm/operations/util/uploads.py and pyinfra_vllm/operations/util/jobs.py,
# defined here so that the table can name them (operations import plans, never the other way).
# tmpfs and root-only: secrets a command needs (a token, proxy credentials) exist here
# only while it runs, never on its command line.
SECRET_DIR = "/run/pyinfra-vllm"
# A long job's directory is below it (jobs/<unit>/: its env file, script and progress).
JOB_ROOT = f"{SECRET_DIR}/jobs"
# Root-owned, traversable, not listable; each upload gets a 0700 directory of the login
# user inside it.
UPLOAD_ROOT = "/run/pyinfra-vllm-upload"

# What a row's kind is called in messages.
KIND_WORDS = {"file": "a file", "directory": "a directory", "socket": "a socket",
              "link": "a symbolic link", "other": "a special file (fifo or device)",
              "unknown": "unreadable (stat failed)"}


def _always(_settings: Settings, _place: Endpoint) -> bool:
    return True


def _on_socket(_settings: Settings, place: Endpoint) -> bool:
    return place.socket is not None


def _on_tcp(_settings: Settings, place: Endpoint) -> bool:
    return place.socket is None


def _with_tls(settings: Settings, _place: Endpoint) -> bool:
    return bool(settings.gateway_tls_cert and settings.gateway_tls_key)


@dataclass(frozen=True)
class Access:
    """One path's owner, group, mode and kind, and who keeps it when."""

    path: str
    owner: str
    group: str
    # Octal, as stat's %a prints it.
    mode: str
    # "file", "directory" or "socket".
    kind: str
    # The stage whose run keeps it (and whose reads read it).
    stage: str
    # What it is, in a few words (messages, docs/security.md).
    what: str
    # When it applies, in words, and as a function of the settings and the engine's
    # endpoint.
    when: str = "always"
    applies: Callable[[Settings, Endpoint], bool] = _always
    # The user a mode change runs as: root, or the owner of the path's directory where
    # that is not root (so a link put there is never followed by root).
    chmod_as: str = "root"

    def wanted(self) -> dict[str, str]:
        """The row as pyinfra_vllm.operations.access.kept takes it."""
        return {"owner": self.owner, "group": self.group, "mode": self.mode,
                "kind": self.kind, "chmod_as": self.chmod_as}


ENGINE_USER = vllm_service_plan.SERVICE_USER
# The stage of a router host (pyinfra_vllm/stages/router.py), the only one it runs.
ROUTER_STAGE = "router"
TABLE: tuple[Access, ...] = (
    Access(engine_access.KEY_ENV_PATH, "root", "root", "600", "file", "vllm_service",
           "the engine's own key, VLLM_API_KEY (the unit's second EnvironmentFile)"),
    Access(vllm_service_plan.ENV_PATH, "root", "root", "600", "file", "vllm_service",
           "the engine's environment file (the unit's first EnvironmentFile)"),
    Access(engine_access.SOCKET_DIR, ENGINE_USER, engine_access.SOCKET_GROUP, "750",
           "directory", "vllm_service",
           "the engine's socket directory: only nginx's workers may enter it (also made "
           "so by the unit's ExecStartPre at every start)",
           "the engine listens on a Unix socket", _on_socket),
    Access(engine_access.SOCKET_PATH, ENGINE_USER, ENGINE_USER, "666", "socket",
           "vllm_service",
           "the engine's socket (made connectable by the readiness wait; its directory "
           "keeps everyone else out)",
           "the engine listens on a Unix socket, while it runs", _on_socket,
           chmod_as=ENGINE_USER),
    Access(engine_access.FIREWALL_PATH, "root", "root", "644", "file", "vllm_service",
           "the engine's nftables table, loaded as root before every start",
           "the engine listens on TCP", _on_tcp),
    Access(SECRET_DIR, "root", "root", "700", "directory", "vllm_service",
           "the secrets' spool: a long job's env file, the download credentials, the "
           "canary's key, while a command needs them",
           "always (on tmpfs: there from the first secret upload after a boot)"),
    Access(JOB_ROOT, "root", "root", "700", "directory", "vllm_service",
           "the long jobs' directories, each with its env file, script and progress"),
    Access(UPLOAD_ROOT, "root", "root", "711", "directory", "vllm_service",
           "the upload spool: each upload in a 0700 directory of the login user, not "
           "listable"),
    Access(engine_access.KEY_NGINX_PATH, "root", "root", "600", "file", "gateway",
           "the engine's key as nginx sends it"),
    Access(gateway_plan.KEYS_PATH, "root", "root", "600", "file", "gateway",
           "the API-key map"),
    Access(gateway_plan.TLS_KEY_PATH, "root", "root", "600", "file", "gateway",
           "the TLS key (from gateway_tls_key)", "gateway_tls_cert and gateway_tls_key set",
           _with_tls),
    Access(gateway_plan.STAGING_DIR, "root", "root", "700", "directory", "gateway",
           "the gateway's staging directory (candidate key files before nginx -t)"),
    Access(router_plan.KEYS_PATH, "root", "root", "600", "file", ROUTER_STAGE,
           "the front door's key list (the sha256 of each accepted header)",
           "a router host"),
    Access(router_plan.TLS_DIR, "root", "root", "755", "directory", ROUTER_STAGE,
           "the front door's TLS directory (its certificate and key, the gateways' CA): "
           "nobody else may write it", "a router host"),
    Access(router_plan.TLS_KEY_PATH, "root", "root", "600", "file", ROUTER_STAGE,
           "the front door's TLS key (from router_tls_key)", "a router host"),
    Access(router_plan.STAGING_DIR, "root", "root", "700", "directory", ROUTER_STAGE,
           "the front door's staging directory (candidate files before haproxy -c)",
           "a router host"),
)
ROWS = {row.path: row for row in TABLE}
# The stages of a serving host that keep rows of the table (the router stage keeps a
# router host's, which a serving host never reads).
STAGES = tuple(sorted({row.stage for row in TABLE if row.stage != ROUTER_STAGE}))


def mode(path: str) -> str:
    """The declared mode of ``path``, for the operation that writes it."""
    return ROWS[path].mode


def rows(settings: Settings, stage: str, place: Endpoint) -> list[Access]:
    """The rows ``stage`` keeps under ``settings``, by path. ``place``: the engine's
    endpoint as the run's context decided it (HostContext.endpoint), which the stages'
    reads are handed too."""
    return sorted((row for row in TABLE if row.stage == stage and row.applies(settings, place)),
                  key=lambda row: row.path)


def read(settings: Settings, stage: str, place: Endpoint) -> dict[str, list[str]]:
    """facts.files.PathModes' arguments for ``stage`` (``place`` as ``rows``): the
    stage's read and its operation's are the same read."""
    return {"paths": [row.path for row in rows(settings, stage, place)]}


def wanted(settings: Settings, stage: str, place: Endpoint) -> dict[str, dict[str, str]]:
    """pyinfra_vllm.operations.access.kept's ``paths`` for ``stage`` (``place`` as
    ``rows``)."""
    return {row.path: row.wanted() for row in rows(settings, stage, place)}


def declared_words(row: Access) -> str:
    """``a file root:root 0600``: what the row declares."""
    return f"{KIND_WORDS[row.kind]} {row.owner}:{row.group} 0{row.mode}"


def wrong_kinds(stage_rows: list[Access], found: dict[str, dict[str, str] | None]
                ) -> list[str]:
    """Why the host is refused: each path (facts.files.PathModes) that exists as a
    symbolic link or another kind than its row's, which the suite never changes."""
    reasons = []
    for row in stage_rows:
        have = (found or {}).get(row.path)
        if have is not None and have["kind"] != row.kind:
            reasons.append(
                f"{row.stage}: {row.path} ({row.what}) is {KIND_WORDS[have['kind']]}, "
                f"not {declared_words(row)}: the suite neither follows nor changes it; "
                "look at what it is and move it away, and the next run makes the suite's "
                "own in its place")
    return reasons


def differs(wanted: dict[str, str], have: dict[str, str] | None) -> bool:
    """Does a path of the kind ``wanted`` (a row's ``wanted()``) declares have another
    owner, group or mode (``have``: facts.files.PathModes)?"""
    return have is not None and have["kind"] == wanted["kind"] and (
        have["owner"] != wanted["owner"] or have["group"] != wanted["group"]
        or int(have["mode"], 8) != int(wanted["mode"], 8))


def findings(stage_rows: list[Access], found: dict[str, dict[str, str] | None]
             ) -> list[str]:
    """The audit's words for each path that is not as declared: another owner, group or
    mode (the next run puts it back), or another kind (the stage refuses the host)."""
    lines = []
    for row in stage_rows:
        have = (found or {}).get(row.path)
        if have is None:
            continue
        if have["kind"] != row.kind:
            lines.append(f"access: {row.path} is {KIND_WORDS[have['kind']]}, should be "
                         f"{declared_words(row)}: not followed, not changed")
        elif differs(row.wanted(), have):
            lines.append(f"access: {row.path} is {have['owner']}:{have['group']} "
                         f"0{int(have['mode'], 8):o}, should be {row.owner}:{row.group} "
                         f"0{row.mode} ({row.what})")
    return lines


def markdown() -> str:
    """The table as docs/security.md carries it (tests/unit/test_access.py keeps them
    equal)."""
    lines = ["| path | owner:group | mode | kind | kept by the stage | when | what |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| `{row.path}` | {row.owner}:{row.group} | 0{row.mode} | {row.kind} | "
              f"{row.stage} | {row.when} | {row.what} |" for row in TABLE]
    return "\n".join(lines) + "\n"
