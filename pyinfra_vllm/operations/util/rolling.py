"""Rolling changes: at most ``batch`` hosts of a run at once, each drained first, and
none once a host failed (the state the operations share, and the commands they run)."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

from gevent.lock import BoundedSemaphore
from pyinfra.api import OperationValueError, QuoteString, State, StringCommand

from pyinfra_vllm.plans.gateway import DRAIN_DIR, DRAIN_FLAG, LEAVE_FLAG

# Beside the live file (one file system: the move is a rename); systemd loads no unit
# from a name with this suffix.
STAGED_SUFFIX = ".pyinfra-staged"
# A live file a canaried restart replaced, kept until its canary passed.
PREVIOUS_SUFFIX = ".pyinfra-previous"
# How a host the rollout did not reach fails: "rollout stopped: host X failed ...".
STOPPED = "rollout stopped"


class Rollout:
    """The slots and the outcome of one run's rolling restarts, shared by its hosts'
    greenlets.

    + batch: hosts in their slot at once; 0 for no limit
    """

    def __init__(self, batch: int, first_host: str = "") -> None:
        self.batch = batch
        self.first_host = first_host
        self._slots = BoundedSemaphore(batch) if batch else None
        # "host X failed readiness: ..." once a host failed; None while none did.
        self.stopped: str | None = None
        self.in_slot: list[str] = []
        # The most hosts in a slot at once, and the order they took one (the log, tests).
        self.peak = 0
        self.order: list[str] = []

    def step(self, name: str, serving: bool, work: Callable[[], str | None]) -> str | None:
        """Run ``work`` for host ``name`` in a slot; None when it succeeded, else the
        host's failure, in words.

        + name: the host
        + serving: its engine runs now; one that does not takes no slot (it has no
          capacity to lose) but still stops at a failed rollout
        + work: drains, restarts and puts back the host; returns None, or what failed
          ("readiness: <why>"), which stops the rollout

        Blocks (this greenlet only) until a slot is free. A host that gets its slot
        after another failed does not run ``work`` and gets "rollout stopped: host X
        failed readiness: <why>"; the host that failed gets "failed readiness: <why>".
        """
        if self.stopped is not None:
            return f"{STOPPED}: {self.stopped}"
        slots = self._slots if serving else None
        if slots is not None:
            slots.acquire()
        try:
            if self.stopped is not None:
                return f"{STOPPED}: {self.stopped}"
            self.in_slot.append(name)
            self.order.append(name)
            self.peak = max(self.peak, len(self.in_slot))
            reason = work()
            if reason is None:
                return None
            if self.stopped is None:
                self.stopped = f"host {name} failed {reason}"
            return f"failed {reason}"
        finally:
            if name in self.in_slot:
                self.in_slot.remove(name)
            if slots is not None:
                slots.release()


# One rollout per run: weak, so a State that is gone (a test's, a library user's) takes
# its rollout with it.
_ROLLOUTS: weakref.WeakKeyDictionary[State, Rollout] = weakref.WeakKeyDictionary()


def rollout(state: State, batch: int, host_name: str) -> Rollout:
    """The run's rollout, made by the first host that asks.

    + state: the pyinfra run
    + batch: this host's rolling_batch
    + host_name: the host asking, named when another asked with another batch

    Called while the run is planned, before any change: a host whose batch differs from
    the first one's stops the whole run (the slots are one for the fleet).
    """
    found = _ROLLOUTS.get(state)
    if found is None:
        found = _ROLLOUTS[state] = Rollout(batch, host_name)
    elif found.batch != batch:
        raise OperationValueError(
            f"rolling_batch is {batch} for host {host_name} but {found.batch} for host "
            f"{found.first_host}: the slots of a rolling restart are one for the whole run; "
            "set rolling_batch once for the fleet (group_data/all.py or --data "
            "rolling_batch=N)"
        )
    return found


def leave_command() -> StringCommand:
    """The gateway's /health answers 503 from now on while /v1 still serves (the leave
    flag exists): load balancers take the host out before the drain refuses requests.
    ``install -d -m`` sets the mode of a directory that exists too: DRAIN_DIR holds the
    flags alone, never a secret."""
    return StringCommand("install -d -m 755", DRAIN_DIR, "&& touch", LEAVE_FLAG)


def drain_command() -> StringCommand:
    """The gateway answers 503 on /v1 too from now on (the drain flag exists)."""
    return StringCommand("install -d -m 755", DRAIN_DIR, "&& touch", DRAIN_FLAG)


def drain_commands(leave_s: int) -> list[StringCommand]:
    """A host drained, in order: it leaves the load balancers (``leave_command``), waits
    ``leave_s`` (drain_leave_s: their health checks see it out; 0: no wait), then refuses
    new requests (``drain_command``). Its in-flight requests are waited for after these."""
    wait = [StringCommand("sleep", str(leave_s))] if leave_s else []
    return [leave_command(), *wait, drain_command()]


def rejoin_commands(leave_s: int) -> list[StringCommand]:
    """A host put back waits ``leave_s`` (drain_leave_s: two good health checks and a
    second) before the next host takes the slot and leaves the load balancers: never both
    out of a pool at once, which a front door of two hosts answers with its own 503 (seen:
    one request of 100 in a rolling upgrade). 0: no wait."""
    return [StringCommand("sleep", str(leave_s))] if leave_s else []


def undrain_command() -> StringCommand:
    """The gateway serves again: both flags removed, the drain's first, so /v1 serves
    before /health brings the load balancers back."""
    return StringCommand("rm -f", DRAIN_FLAG, LEAVE_FLAG)


def promote_command(staged: Sequence[tuple[str, str]], keep_previous: bool = False,
                    ) -> StringCommand:
    """Move staged files into place: ``[(live path, sha256 of the wanted content)]``.

    A staged file is moved only with the wanted content; one left by an interrupted run
    with other content is removed, never made live. No staged file (the live one was
    already right): nothing for that path. ``keep_previous``: the live file it replaces
    is kept beside it (``PREVIOUS_SUFFIX``, its mode and owner kept), for
    ``restore_command``.
    """
    parts: list[str | QuoteString] = []
    for path, digest in staged:
        candidate = QuoteString(f"{path}{STAGED_SUFFIX}")
        keep: list[str | QuoteString] = [] if not keep_previous else [
            "{ [ ! -e", QuoteString(path), "] || cp -pf", QuoteString(path),
            QuoteString(f"{path}{PREVIOUS_SUFFIX}"), "; } &&"]
        if parts:
            parts.append("&&")
        parts += [
            "{ [ ! -e", candidate, "] || { if echo", QuoteString(f"{digest}  {path}{STAGED_SUFFIX}"),
            "| sha256sum --status -c -; then", *keep, "mv -f", candidate, QuoteString(path),
            "; else rm -f", candidate, "; fi; }; }",
        ]
    return StringCommand(*parts) if parts else StringCommand("true")


def restore_command(paths: Sequence[str]) -> StringCommand:
    """The files ``promote_command(keep_previous=True)`` replaced, put back where kept."""
    parts: list[str | QuoteString] = []
    for path in paths:
        previous = QuoteString(f"{path}{PREVIOUS_SUFFIX}")
        if parts:
            parts.append("&&")
        parts += ["{ [ ! -e", previous, "] || mv -f", previous, QuoteString(path), "; }"]
    return StringCommand(*parts) if parts else StringCommand("true")


def relink_command(path: str, target: str | None) -> StringCommand:
    """The link ``path`` pointing at ``target`` again, in one rename: a new link made
    beside it (``STAGED_SUFFIX``) and moved over it, so there is never a moment without
    one (pyinfra's files.link, which moved it, removes it first, then links). ``target``
    None (there was no link): the link removed. A ``path`` that is not a link (a
    directory) is never replaced or removed: ``mv -T`` refuses it and the command fails."""
    link = QuoteString(path)
    if target is None:
        return StringCommand("{ [ ! -L", link, "] || rm -f", link, "; }")
    staged = QuoteString(f"{path}{STAGED_SUFFIX}")
    return StringCommand("rm -f", staged, "&& ln -s --", QuoteString(target), staged,
                         "&& mv -fT", staged, link)


def previous_dropped_command(paths: Sequence[str]) -> StringCommand:
    """The kept files removed (the new ones stay)."""
    return StringCommand("rm -f", *(QuoteString(f"{path}{PREVIOUS_SUFFIX}") for path in paths))


def discard_command(paths: Sequence[str]) -> StringCommand:
    """Remove the staged files of ``paths`` (a host the rollout did not reach)."""
    return StringCommand("rm -f", *(QuoteString(f"{path}{STAGED_SUFFIX}") for path in paths))
