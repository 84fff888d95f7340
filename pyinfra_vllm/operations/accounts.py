"""A system account for a service: a user and its own group, no login, no home made.

pyinfra's ``server.group`` and ``server.user`` read four facts between them (groups,
users, the OS twice); this reads one (facts.accounts.Account) for both.
"""

from __future__ import annotations

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from facts.accounts import Account


@operation()
def system_account(account: str, home: str, shell: str = "/usr/sbin/nologin"):
    """
    A system user ``account`` in its own system group ``account``.

    + account: user and group name
    + home: the user's home directory (recorded, not created: systemd's StateDirectory=
      makes it with the right owner and mode)
    + shell: login shell (no login by default)

    Both present as wanted: no command. A user whose home, shell or group differs is
    changed with ``usermod``.
    """
    found = host.get_fact(Account, account=account)
    quoted = QuoteString(account)
    changed = False
    if found["group"] is None:
        yield StringCommand("groupadd --system", quoted)
        changed = True
    user = found["user"]
    if user is None:
        yield StringCommand("useradd --system --gid", quoted, "--home-dir", QuoteString(home),
                            "--no-create-home --shell", QuoteString(shell), quoted)
        changed = True
    elif (user["home"], user["shell"]) != (home, shell) or (
        found["group"] is not None and user["gid"] != found["group"]["gid"]
    ):
        yield StringCommand("usermod --gid", quoted, "--home", QuoteString(home), "--shell",
                            QuoteString(shell), quoted)
        changed = True
    if not changed:
        host.noop(f"system account {account} exists ({home}, {shell})")
