"""The rules of the secrets: the gateway's API keys (api_keys, api_keys_file) and the
Hugging Face token (hf_token, hf_token_file); no message ever holds a key or a token (the
rules' conventions: settings_checks.py).
"""

from __future__ import annotations

import os
import re

from pydantic import SecretStr

from pyinfra_vllm.core.secret_files import private_file_problem, read_key_lines

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


def api_keys(value: list[SecretStr]) -> list[SecretStr]:
    problems = _key_problems(
        [(f"api_keys[{index}]", key.get_secret_value()) for index, key in enumerate(value)]
    )
    if problems:
        raise ValueError("; ".join(problems))
    return value


def api_keys_file(value: str | None) -> str | None:
    if value is None:
        return value
    problem = private_file_problem(value)
    if problem is not None:
        raise ValueError(_file_remedy(problem, "one API key per line"))
    try:
        keys = read_key_lines(value)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot be read as text ({type(exc).__name__}): write one "
                         "API key per line") from None
    if not keys:
        raise ValueError("holds no key (only blank lines or # comments): write one API "
                         "key per line, or remove api_keys_file")
    problems = _key_problems([(f"line {number}", key) for number, key in keys])
    if problems:
        raise ValueError("; ".join(problems))
    return value


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


def file_keys(inline_keys: list[SecretStr], api_keys_file: str | None,
              ) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
    """The keys of api_keys_file as (line, key), and the problems of the file beside
    api_keys: unreadable, or a key that api_keys holds already."""
    problems: list[tuple[str, str]] = []
    from_file: list[tuple[int, str]] = []
    if api_keys_file is None:
        return from_file, problems
    try:
        from_file = read_key_lines(api_keys_file)
    except (OSError, ValueError):
        problems.append(("api_keys_file", f"api_keys_file = {api_keys_file!r} "
                         "cannot be read: write one API key per line, chmod 600"))
    first_seen = {key.get_secret_value().lower(): f"api_keys[{index}]"
                  for index, key in enumerate(inline_keys)}
    for number, key in from_file:
        if key.lower() in first_seen:
            problems.append((
                "api_keys_file",
                f"api_keys_file = {api_keys_file!r}: line {number} repeats "
                f"{first_seen[key.lower()]} (or differs from it only in letter "
                "case): keep the key in one place",
            ))
    return from_file, problems
