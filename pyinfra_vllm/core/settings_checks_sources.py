"""The rules of where packages and the model come from: the URLs of the package index,
the proxy and the model's files, and the driver's apt source (the rules' conventions:
settings_checks.py).
"""

from __future__ import annotations

import re
import urllib.parse

from pydantic import ValidationInfo

# The characters a URL setting may hold: RFC 3986's, less those a shell, an env file or a
# config file reads as syntax ($ ; ' " ` \\ and whitespace); percent-encode them instead.
URL_CHARS = re.compile(r"[A-Za-z0-9._~:/?#\[\]@!&()*+,=%-]+")
# apt source options that turn off the signature check.
INSECURE_APT_OPTIONS = ("trusted=yes", "allow-insecure=yes", "allow-weak=yes",
                        "allow-downgrade-to-insecure=yes")
APT_LINE = re.compile(r"deb\s+(\[(?P<options>[^\]]*)\]\s+)?(?P<uri>\S+)\s+\S+(\s+\S+)*")


def _url_problem(value: str) -> str | None:
    """What keeps ``value`` from being an http(s) URL here; the value itself is never in it."""
    scheme, _, rest = value.partition("://")
    if not rest:
        return "not a URL: write it as http(s)://HOST[:PORT]/PATH"
    if scheme not in ("http", "https"):
        return f"its scheme is {scheme[:10]!r}; allowed: http or https"
    if not URL_CHARS.fullmatch(rest):
        return ("has a character a URL here cannot carry (whitespace, a quote, $, ;, \\, ` "
                "or a control character): percent-encode it")
    try:
        parsed = urllib.parse.urlsplit(value)
        parsed.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        return "not a URL: its host or port cannot be read; write it as http(s)://HOST[:PORT]/PATH"
    if not parsed.hostname:
        return "has no host: write it as http(s)://HOST[:PORT]/PATH"
    return None


def url(value: str | None) -> str | None:
    if value is not None:
        problem = _url_problem(value)
        if problem is not None:
            raise ValueError(problem)
    return value


def no_credentials(value: str) -> str:
    """model_base_url: no user, password or token before its host. The URL is an argument
    of the downloader on the host, where ``ps`` shows it to every user, and in its
    messages; and urllib cannot use a URL's credentials anyway. (pip_index_url and
    http_proxy may carry them: they reach the host in a root-only environment file.)"""
    # The authority as a person reads it, up to the first "/": an "@" after a "?" or "#"
    # there is still a credential to the one who wrote it, whatever urllib makes of it.
    authority = value.partition("://")[2].partition("/")[0]
    if "@" in authority:
        raise ValueError(
            "has credentials in it (user:password@ or token@ before the host): the "
            "downloader would show them on its command line, which ps lists to every user "
            "of the host, and in its messages, and cannot use them (urllib reads them as "
            "part of the host name); allowed: http(s)://HOST[:PORT]/PATH without them. "
            "Remove them from the URL, and give a Hugging Face token as hf_token_file (a "
            "file, chmod 600), hf_token or HF_TOKEN on the operator's machine: it is sent "
            "as a bearer token, over https only"
        )
    return value


def apt_source(value: str | None, info: ValidationInfo) -> str | None:
    """nvidia_apt_repo; reads nvidia_apt_repo_trusted, declared before it."""
    if value is None:
        return value
    trusted = bool(info.data.get("nvidia_apt_repo_trusted"))
    signed_example = ('"deb [signed-by=/usr/share/keyrings/KEY.gpg] https://HOST/PATH '
                      'SUITE COMPONENT"')
    if any(ord(char) < 32 or ord(char) == 127 for char in value):
        raise ValueError("has a newline or another control character: give one line")
    text = value.strip()
    if text.startswith(("http://", "https://")):
        problem = _url_problem(text)
        if problem is not None:
            raise ValueError(problem)
        if not trusted:
            raise ValueError(
                'a bare URL is written as "deb [trusted=yes] URL ./", a repository apt '
                "does not verify, and unsigned packages run their scripts as root: give "
                f"a source with a keyring and an https URL, {signed_example}, or set "
                "nvidia_apt_repo_trusted=true for a repository you control"
            )
        return value
    line = APT_LINE.fullmatch(text)
    if line is None:
        raise ValueError(f"not an apt source: give a one-line source, {signed_example}, "
                         "or (with nvidia_apt_repo_trusted=true) a repository URL")
    if trusted:
        return value
    options = (line.group("options") or "").split()
    problems = []
    if not any(option.startswith("signed-by=") and len(option) > 10 for option in options):
        problems.append("it names no keyring (signed-by=)")
    if not line.group("uri").startswith("https://"):
        problems.append("its URL is not https")
    insecure = [option for option in options if option in INSECURE_APT_OPTIONS]
    if insecure:
        problems.append(f"it turns verification off ({', '.join(insecure)})")
    if problems:
        raise ValueError(
            "; ".join(problems) + ": unsigned or unverified packages run their scripts "
            f"as root; write {signed_example}, or set nvidia_apt_repo_trusted=true for "
            "a repository you control"
        )
    return value
