"""Facts about nginx's configuration as nginx itself reads it: the server blocks of every
file ``nginx -T`` dumps, with the ports they listen on, and ``server_tokens`` set outside
any server block.

``nginx -T`` tests the configuration and prints every file it read, each after a
``# configuration file PATH:`` line (nginx docs, "Command-line parameters"). The dump
holds the API key map (a secret) and whatever else the files hold, so it is reduced on
the host, by awk, to structure: file names, block openings and ends, and the arguments
of ``listen``, ``server_name``, ``server_tokens`` and ``location``. No other directive's
arguments leave the host.
"""

from __future__ import annotations

from typing import Any

from pyinfra.api import StringCommand
from typing_extensions import override

from facts.base import FactBase

# Tokenizes nginx's syntax as ngx_conf_read_token does (nginx src/core/ngx_conf_file.c):
# words separated by blanks, quotes with backslash escapes, "#" a comment at the start
# of a word, ";" ending a directive, "{" and "}" blocks. Prints, per file: "F PATH",
# "B LINE NAME [ARGS]" (ARGS for location only), "D LINE NAME ARGS" (listen, server_name
# and server_tokens only), "E" (a block's end).
_AWK = r"""
function flush() { if (word != "" || quoted) { words[n++] = word }; word = ""; quoted = 0 }
function statement(kind,   i, out) {
  if (n == 0) { return }
  out = kind " " start " " words[0]
  if (kind == "D" || words[0] == "location") { for (i = 1; i < n; i++) out = out " " words[i] }
  if (kind == "B" || words[0] == "listen" || words[0] == "server_name" || words[0] == "server_tokens") print out
  n = 0
}
/^# configuration file .*:$/ && inq == "" {
  print "F " substr($0, 22, length($0) - 22)
  line = 0; n = 0; word = ""; quoted = 0; next
}
{
  line++
  for (i = 1; i <= length($0); i++) {
    c = substr($0, i, 1)
    if (inq != "") {
      if (esc) { word = word c; esc = 0 }
      else if (c == "\\") { esc = 1 }
      else if (c == inq) { inq = "" }
      else { word = word c }
      continue
    }
    if (n == 0 && word == "" && !quoted) start = line
    if (c == "#" && word == "" && !quoted) break
    if (c == " " || c == "\t" || c == "\r") { flush(); continue }
    if (c == "\"" || c == "'") { inq = c; quoted = 1; continue }
    if (c == "{") { flush(); statement("B"); continue }
    if (c == ";") { flush(); statement("D"); continue }
    if (c == "}") { flush(); n = 0; print "E"; continue }
    word = word c
  }
  if (inq != "") { word = word "\n" } else { flush() }
}
"""


class NginxServers(FactBase[dict[str, Any] | None]):
    """
    Returns every file nginx's configuration reads, in nginx's order (the main file
    first), with its server blocks; None when nginx is absent or its configuration fails
    ``nginx -t`` (nothing is dumped then):

    .. code:: python

        {"files": [
            {"path": "/etc/nginx/nginx.conf", "symlink": False, "main": True, "servers": []},
            {"path": "/etc/nginx/sites-enabled/default", "symlink": True, "main": False,
             "servers": [{"line": 22, "listen": ["80 default_server",
                                                 "[::]:80 default_server"],
                          "server_name": ["_"], "locations": ["/"]}]},
        ],
         "server_tokens": []}

    A server's ``listen`` are the arguments of each listen directive, as written;
    ``[]`` when it has none (nginx then listens on port 80). ``server_tokens``: each
    ``server_tokens`` outside a server block, ``{"path", "line", "value"}``: at http level
    in nginx.conf's http block and in a file it includes there (conf.d/, sites-enabled/).
    nginx -T does not say where a file was included: one included inside a server block
    is counted here too.
    """

    @override
    def requires_command(self) -> str:
        return "nginx"

    @override
    def command(self) -> StringCommand:
        return StringCommand(
            "nginx -T 2>/dev/null | awk", StringCommand(repr_awk(), _separator=""),
            '| while IFS= read -r l; do case "$l" in',
            '"F "*) p="${l#F }"; if [ -L "$p" ]; then echo "F L $p"; else echo "F R $p"; fi;;',
            "*) printf '%s\\n' \"$l\";; esac; done",
        )

    @override
    def process(self, output: list[str]) -> dict[str, Any] | None:
        return parse_servers(output)


def repr_awk() -> str:
    """The awk program as one shell word (single-quoted; it holds no single quote)."""
    program = "\n".join(line.strip() for line in _AWK.strip().splitlines())
    return "'" + program.replace("'", "'\\''") + "'"


def parse_servers(output: list[str]) -> dict[str, Any] | None:
    """NginxServers' lines as its value; None without any file."""
    files: list[dict[str, Any]] = []
    server_tokens: list[dict[str, Any]] = []
    stack: list[dict[str, Any] | None] = []
    for raw in output:
        kind, _, rest = raw.rstrip("\n").partition(" ")
        if kind == "F":
            link, _, path = rest.partition(" ")
            files.append({"path": path, "symlink": link == "L", "main": not files,
                          "servers": []})
            stack = []
        elif not files:
            continue
        elif kind == "B":
            line, _, words = rest.partition(" ")
            name, _, args = words.partition(" ")
            if name == "server":
                server: dict[str, Any] = {"line": int(line), "listen": [], "server_name": [],
                                          "locations": []}
                files[-1]["servers"].append(server)
                stack.append(server)
                continue
            current = _innermost(stack)
            if name == "location" and current is not None:
                current["locations"].append(args)
            stack.append(None)
        elif kind == "E":
            if stack:
                stack.pop()
        elif kind == "D":
            line, _, words = rest.partition(" ")
            name, _, args = words.partition(" ")
            current = _innermost(stack)
            if current is None and name == "server_tokens":
                server_tokens.append({"path": files[-1]["path"], "line": int(line),
                                      "value": args})
            elif current is not None and name == "listen":
                current["listen"].append(args)
            elif current is not None and name == "server_name":
                current["server_name"] += args.split()
    return {"files": files, "server_tokens": server_tokens} if files else None


def _innermost(stack: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    return next((entry for entry in reversed(stack) if entry is not None), None)
