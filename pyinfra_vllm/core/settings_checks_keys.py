"""The rules of the secrets: the gateway's API keys (api_keys, api_keys_file) and the
Hugging Face token (hf_token, hf_token_file); no message ever holds a key or a token (the
rules' conventions: settings_checks.py).

The API keys are read and checked here only, once, while the settings are validated:
api_keys' rule reads api_keys_file and keeps its keys after api_keys' own, so the frozen
Settings' api_keys is every key the gateway accepts (pyinfra_vllm/plans/gateway.py renders
them as they are, trusting these rules).
"""

from __future__ import annotations

import os
import re

from pydantic import SecretStr, ValidationInfo

from pyinfra_vllm.core.secret_files import (
    mask_credentials,
    private_file_problem,
    read_key_lines,
)
from pyinfra_vllm.core.settings_checks import rule_errors

# An API key: long enough that it cannot be guessed (32 characters of base64 are 192
# bits), and only characters nginx reads as part of a word in the key map's line
# `"Bearer <key>" 1;` (a quote, backslash, semicolon, brace or space would be syntax).
API_KEY_MIN_LENGTH = 32
# What a key may hold: a token from secrets.token_urlsafe, a base64 key, an OpenAI-style
# "sk-..." key. No quote, blank or "$": the key sits in nginx config and an env file.
API_KEY_ALPHABET = "letters, digits and _.~+/=:-"
API_KEY_CHARS = re.compile(r"[A-Za-z0-9_.~+/=:-]+")


def _key_problems(keys: list[tuple[str, str]]) -> list[str]:
    """What is wrong with API keys, each named by ``where`` (its position), never by value."""
    problems = []
    first_seen: dict[str, tuple[str, str]] = {}
    for where, key in keys:
        if len(key) < API_KEY_MIN_LENGTH:
            problems.append(
                f"{where} is shorter than {API_KEY_MIN_LENGTH} characters, short enough to "
                "be guessed: use a random key, e.g. `openssl rand -base64 36`"
            )
        if not API_KEY_CHARS.fullmatch(key):
            problems.append(
                f"{where} has characters other than {API_KEY_ALPHABET} (nginx "
                "would read a quote, space, ';' or brace in it as syntax)"
            )
        if key.lower() in first_seen:
            earlier, earlier_key = first_seen[key.lower()]
            same = "repeats" if key == earlier_key else "differs only in letter case from"
            problems.append(f"{where} {same} {earlier}: keep one of them")
        else:
            first_seen[key.lower()] = (where, key)
    return problems


def _file_remedy(problem: str, holding: str) -> str:
    """A secret file's problem with what to do (the mode problem names its chmod)."""
    if "chmod" in problem:
        return problem
    return f"{problem}: point it at a file holding {holding}, mode 0600 (chmod 600 FILE)"


def token_source(hf_token: SecretStr | None, hf_token_file: str | None) -> str | None:
    """Where the Hugging Face token comes from (as pyinfra_vllm.core.locks.hf_token reads it)."""
    if hf_token is not None and hf_token.get_secret_value():
        return "hf_token"
    if hf_token_file:
        return "hf_token_file"
    if os.environ.get("HF_TOKEN"):
        return "HF_TOKEN in the environment"
    return None


def api_keys_file(value: str | None) -> str | None:
    """api_keys_file's own rule: a regular file that only its owner may read. Its keys are
    read by api_keys' rule (``api_keys``, below), the one read of the file."""
    if value is not None:
        problem = private_file_problem(value)
        if problem is not None:
            raise ValueError(_file_remedy(problem, "one API key per line"))
    return value


def api_keys(value: list[SecretStr], info: ValidationInfo) -> list[SecretStr]:
    """api_keys' rule, the one place the gateway's keys are read and checked: the keys of
    api_keys, then those of api_keys_file (declared before api_keys, so validated first;
    read here, once), each named by its position (``api_keys[0]``, ``line 3``), never by
    value. Its problems are whole sentences (``rule_errors``), each naming its setting: the
    file's name api_keys_file. The value kept is every key, api_keys' first: what the
    gateway and the benchmark use, with no second check."""
    inline = [(f"api_keys[{index}]", key.get_secret_value()) for index, key in enumerate(value)]
    problems: list[tuple[str, str]] = []
    own = _key_problems(inline)
    if own:
        # Written as settings.py's errors write a secret setting's problem.
        problems.append(("api_keys", "api_keys = <secret>: " + "; ".join(own)))
    # Absent when unset or refused by its own rule (reported under api_keys_file).
    path = info.data.get("api_keys_file")
    from_file: list[tuple[int, str]] = []
    if path is not None:
        from_file, file_problems = _file_keys(path, inline)
        problems += file_problems
    if problems:
        raise rule_errors(problems)
    return [*value, *(SecretStr(key) for _, key in from_file)]


def _file_keys(path: str, inline: list[tuple[str, str]],
               ) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
    """The keys of the key file ``path`` as (line, key), and its problems as (setting,
    sentence): not text, no key, a key's own problem, a key ``inline`` holds already."""
    where = f"api_keys_file = {mask_credentials(repr(path))}"
    try:
        keys = read_key_lines(path)
    except (OSError, ValueError) as exc:
        return [], [("api_keys_file", f"{where}: cannot be read as text "
                     f"({type(exc).__name__}): write one API key per line")]
    if not keys:
        return [], [("api_keys_file", f"{where}: holds no key (only blank lines or # "
                     "comments): write one API key per line, or remove api_keys_file")]
    problems = []
    own = _key_problems([(f"line {number}", key) for number, key in keys])
    if own:
        problems.append(("api_keys_file", f"{where}: " + "; ".join(own)))
    first_seen = {key.lower(): name for name, key in inline}
    for number, key in keys:
        if key.lower() in first_seen:
            problems.append((
                "api_keys_file",
                f"{where}: line {number} repeats {first_seen[key.lower()]} (or differs "
                "from it only in letter case): keep the key in one place",
            ))
    return keys, problems


def token_chars(value: SecretStr | None) -> SecretStr | None:
    token = value.get_secret_value() if value is not None else ""
    if token and not API_KEY_CHARS.fullmatch(token):
        raise ValueError(
            f"has characters other than {API_KEY_ALPHABET} (a Hugging Face "
            "token is hf_ and letters); it is written into an environment file"
        )
    return value


def token_file(value: str | None) -> str | None:
    if value is not None:
        problem = private_file_problem(value)
        if problem is not None:
            raise ValueError(_file_remedy(problem, "the Hugging Face token"))
    return value

