"""``--diff`` for the suite's own file operations (pyinfra_vllm/operations/util/file_diff.py): a
file whose digest differs is read and diffed in pyinfra's format, a matching set reads nothing, and
a secret file's values (old and new) appear nowhere, not even in what ``pyinfra -vvv`` prints: the
facts' commands and outputs.

The -vvv host below runs each fact's real command with ``sh`` against files under
tmp_path and logs its input and output the way pyinfra 3.10 does at ``-vvv``
(``api/facts.py``: ``print_fact_input``, ``print_fact_output``); nothing else is faked.
"""

from __future__ import annotations

import hashlib
import logging
import re
import subprocess

import pytest
from pyinfra.api import FileUploadCommand, StringCommand
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from facts.files import SecretFileLines
from pyinfra_vllm.core.templating import render
from pyinfra_vllm.operations import file_set, gateway
from pyinfra_vllm.operations.util import file_diff
from pyinfra_vllm.plans import gateway as gateway_plan
from pyinfra_vllm.plans.vllm_service import ENV_TEMPLATE


def render_env(hf_token: str | None = None, api_key: str | None = None) -> str:
    """An environment file of the unit's format with up to two secrets: the diff's
    masking is the same for any secret file the suite writes."""
    pairs = [("HF_TOKEN", hf_token), ("VLLM_API_KEY", api_key)]
    return render(ENV_TEMPLATE, secrets=[(n, v) for n, v in pairs if v is not None])

OLD_KEY = "sk-old-Zq8vN3rT5yU7iO9pA1sD3fG5hJ7kL9mx"
NEW_KEY = "sk-new-Wc2eR4tY6uI8oP0aS2dF4gH6jK8lZ0vb"
HF_OLD = "hf_oldTokenAbCdEfGhIjKlMnOpQrStUvWx"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
ENV = "/etc/vllm/vllm.env"
UNIT = "/etc/systemd/system/vllm.service"


def plain(caplog) -> list[str]:
    return [ANSI.sub("", r.getMessage()) for r in caplog.records]


def _digests(*pairs):
    return {path: {"sha256": hashlib.sha256(data).hexdigest(), "mode": mode, "owner": "root:root"}
            for path, data, mode in pairs}


def _run(files, facts, diff=True, executing=False):
    state = FakeState()
    state.config.DIFF = diff
    state.is_executing = executing
    state.should_check_for_changes = lambda: True
    host = create_host(state, facts=facts)
    with ctx_state.use(state), ctx_host.use(host):
        return list(file_set.present._inner(files=files)), host


def test_secret_line_digests_here_match_the_fact_on_a_real_shell(tmp_path):
    text = f"# comment=1\nVLLM_API_KEY='{NEW_KEY}'\n\n  indented=2\nHF_TOKEN='{HF_OLD}'"
    path = tmp_path / "vllm.env"
    path.write_text(text)
    command = SecretFileLines().command(str(path)).get_raw_value()
    out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True)
    found = SecretFileLines().process(out.stdout.splitlines())
    assert found == file_diff.secret_lines(text.encode())
    assert [name for name, _d in found] == [None, "VLLM_API_KEY", None, None, "HF_TOKEN"]
    assert NEW_KEY not in out.stdout and HF_OLD not in out.stdout
    missing = subprocess.run(["sh", "-c", SecretFileLines().command(str(tmp_path / "no")).get_raw_value()],
                             capture_output=True, text=True, check=True)
    assert SecretFileLines().process(missing.stdout.splitlines()) is None


def test_a_differing_file_is_read_and_diffed_the_matching_one_is_not(caplog):
    old_unit = "[Service]\nExecStart=/opt/vllm/bin/python -m vllm --max-model-len 8192\nUser=vllm\n"
    new_unit = old_unit.replace("8192", "131072").encode()
    env = render_env(api_key=NEW_KEY).encode()
    facts = {
        "files.FileDigests": {
            f"paths={[UNIT, ENV]}".replace('"', "'"): _digests((UNIT, old_unit.encode(), "644"),
                                                           (ENV, env, "600")),
        },
        # Only the unit's content: reading the environment file would fail the test.
        "files.FileContents": {f"path={UNIT}": old_unit.splitlines()},
    }
    caplog.set_level(logging.INFO, logger="pyinfra")
    commands, _host = _run({UNIT: (new_unit, "644"), ENV: (env, "600")}, facts)
    assert plain(caplog) == [
        f"Will modify {UNIT}",
        "  @@ -1,3 +1,3 @@",
        "    [Service]",
        "  - ExecStart=/opt/vllm/bin/python -m vllm --max-model-len 8192",
        "  + ExecStart=/opt/vllm/bin/python -m vllm --max-model-len 131072",
        "    User=vllm",
        "",
    ]
    assert [c.dest for c in commands if isinstance(c, FileUploadCommand)] == [f"{UNIT}.pyinfra-new"]


def test_a_secret_file_is_diffed_masked(caplog):
    old = render_env(hf_token=HF_OLD, api_key=OLD_KEY).encode()
    new = render_env(hf_token=HF_OLD, api_key=NEW_KEY).encode()
    facts = {
        "files.FileDigests": {f"paths=['{ENV}']": _digests((ENV, old, "600"))},
        "files.SecretFileLines": {f"path={ENV}": file_diff.secret_lines(old)},
    }
    caplog.set_level(logging.INFO, logger="pyinfra")
    _run({ENV: (new, "600")}, facts)
    lines = plain(caplog)
    assert lines[0] == f"Will modify {ENV} (secret: values masked)"
    assert lines[-4:] == [
        "    HF_TOKEN=<secret, unchanged>",
        "  - VLLM_API_KEY=<secret, old>",
        "  + VLLM_API_KEY=<secret, changed>",
        "",
    ]
    text = "\n".join(lines)
    assert OLD_KEY not in text and NEW_KEY not in text and HF_OLD not in text


def test_a_new_secret_file_reads_nothing_and_shows_its_names_only(caplog):
    new = render_env(api_key=NEW_KEY).encode()
    caplog.set_level(logging.INFO, logger="pyinfra")
    _run({ENV: (new, "600")}, {"files.FileDigests": {f"paths=['{ENV}']": {ENV: None}}})
    lines = plain(caplog)
    assert lines[0] == f"Will create {ENV} (secret: values masked)"
    assert "  + VLLM_API_KEY=<secret, new>" in lines
    assert NEW_KEY not in "\n".join(lines)


@pytest.mark.parametrize("diff,executing", [(True, False), (False, False), (True, True)])
def test_a_matching_set_reads_and_prints_nothing(caplog, diff, executing):
    env = render_env(api_key=NEW_KEY).encode()
    caplog.set_level(logging.DEBUG, logger="pyinfra")
    commands, host = _run({ENV: (env, "600")},
                          {"files.FileDigests": {f"paths=['{ENV}']": _digests((ENV, env, "600"))}},
                          diff=diff, executing=executing)
    assert commands == [] and host.noop_description == "1 file(s) in place"
    assert plain(caplog) == []


def test_the_diff_is_printed_once_per_run_not_again_when_executing(caplog):
    caplog.set_level(logging.INFO, logger="pyinfra")
    facts = {"files.FileDigests": {f"paths=['{UNIT}']": {UNIT: None}}}
    commands, _ = _run({UNIT: (b"[Unit]\n", "644")}, facts, executing=True)
    assert commands and plain(caplog) == []


class VerboseHost:
    """A host whose facts are their real commands, run by sh on this machine's tmp_path
    files, logged as pyinfra 3.10 logs them at -vvv (input and output)."""

    name = "@vvv"
    print_prefix = "[@vvv] "

    def __init__(self, state):
        self.state = state
        self.noop_description = None
        self.reads: list[str] = []

    def noop(self, description):
        self.noop_description = description

    def get_fact(self, fact_cls, **kwargs):
        fact = fact_cls()
        command = fact.command(**kwargs)
        raw = command.get_raw_value() if isinstance(command, StringCommand) else command
        logger = logging.getLogger("pyinfra")
        logger.info("%s>>> sh -c %s", self.print_prefix, raw)  # print_fact_input
        out = subprocess.run(["sh", "-c", raw], capture_output=True, text=True, check=True)
        for line in out.stdout.splitlines():
            logger.info("%s%s", self.print_prefix, line)  # print_fact_output
        self.reads.append(fact_cls.__name__)
        return fact.process(out.stdout.splitlines())


def _verbose_run(op, **kwargs):
    state = FakeState()
    state.config.DIFF = True
    host = VerboseHost(state)
    with ctx_state.use(state), ctx_host.use(host):
        commands = list(op._inner(**kwargs))
    for command in commands:  # print_input (-vv): what pyinfra shows of each command
        if isinstance(command, StringCommand):
            logging.getLogger("pyinfra").info("%s>>> %s", host.print_prefix,
                                              command.get_masked_value())
    return commands, host


def test_no_secret_at_vvv_for_the_env_file(tmp_path, caplog):
    env = tmp_path / "vllm.env"
    env.write_text(render_env(hf_token=HF_OLD, api_key=OLD_KEY))
    caplog.set_level(logging.DEBUG)
    _commands, host = _verbose_run(
        file_set.present,
        files={str(env): (render_env(hf_token=HF_OLD, api_key=NEW_KEY).encode(), "600")})
    assert host.reads == ["FileDigests", "SecretFileLines"]
    text = caplog.text
    assert "VLLM_API_KEY=<secret, changed>" in ANSI.sub("", text)
    for secret in (OLD_KEY, NEW_KEY, HF_OLD):
        assert secret not in text


def test_no_secret_at_vvv_for_the_api_keys_file_and_tls_key(tmp_path, caplog):
    site_path, keys_path, tls_key = (tmp_path / "vllm.conf", tmp_path / "keys.conf",
                                     tmp_path / "key.pem")
    site_text = gateway_plan.render_site(upstream="127.0.0.1:8000", gateway_port=8001,
                                    metrics_allow=["127.0.0.1/32"], body_mib=2,
                                    proxy_timeout_s=3600, keys_path=str(keys_path))
    site_path.write_text(site_text.replace("3600", "600"))
    keys_path.write_text(gateway_plan.render_keys_map([OLD_KEY]))
    pem_old = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7old\n"
    pem_new = "-----BEGIN PRIVATE KEY-----\nMIIEvgIBADANBgkqhkiG9w0BAQEFAASCBKgwggSkAgEAAoIBAQDnew0\n"
    tls_key.write_text(pem_old)
    caplog.set_level(logging.DEBUG)
    _commands, host = _verbose_run(
        gateway.site, site_content=site_text,
        keys_content=gateway_plan.render_keys_map([NEW_KEY]),
        site_path=str(site_path), keys_path=str(keys_path),
        staging_dir=str(tmp_path / "staging"),
        extra_files={str(tls_key): (pem_new, "600")}, secrets=[NEW_KEY])
    assert host.reads.count("SecretFileLines") == 2 and "FileContents" in host.reads
    text = caplog.text
    plain_text = ANSI.sub("", text)
    # The site is shown in clear; the key map and the TLS key only masked.
    assert "+     proxy_read_timeout 3600s;" in plain_text
    assert f"Will modify {keys_path} (secret: values masked)" in plain_text
    assert "<secret, changed>" in plain_text or "<secret, new>" in plain_text
    for secret in (OLD_KEY, NEW_KEY, gateway_plan.key_regex(OLD_KEY), gateway_plan.key_regex(NEW_KEY),
                   "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7old",
                   "MIIEvgIBADANBgkqhkiG9w0BAQEFAASCBKgwggSkAgEAAoIBAQDnew0"):
        assert secret not in text
