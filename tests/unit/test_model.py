"""The model stage: what counts as verified, the download operation, the model lock and the token."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from pyinfra.api import FileUploadCommand, StringCommand
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from facts.model import mtime_ns, unverified
from pyinfra_vllm.core import model_files as model_plan
from pyinfra_vllm.core.locks import LockFileError, load_lock, lock_path, safetensors_bytes
from pyinfra_vllm.core.model_files import FETCH_LOCK, INCOMING, VERIFIED_NAME, unsafe_model_path
from pyinfra_vllm.core.settings import Settings, validate
from pyinfra_vllm.operations import model as model_ops

_SPEC = importlib.util.spec_from_file_location(
    "fetch_model", Path(__file__).resolve().parents[2] / "files" / "fetch_model.py")
fetch_model = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(fetch_model)


MODEL_ID = "Qwen/Qwen3.6-27B"


COMMIT = "5f1e0c3a9b7d2e4f6a8c0b1d3e5f7a9c2b4d6e8f"


# --- model files ------------------------------------------------------------------------
def test_mtime_ns_is_exact():
    assert mtime_ns("1700000000.1234567890") == 1700000000123456789
    assert mtime_ns("1700000000.5") == 1700000000500000000
    assert mtime_ns("1700000000") == 1700000000000000000
    assert mtime_ns("1700000000.0000000010") == 1700000000000000001


def _lock(*files: tuple[str, int, str]) -> dict:
    return {"model_id": MODEL_ID, "commit": COMMIT,
            "files": [{"path": p, "size": s, "algo": "sha256", "digest": d} for p, s, d in files]}


LOCK = _lock(("config.json", 10, "c" * 64), ("model.safetensors", 100, "a" * 64))


NOW = {"config.json": {"size": 10, "mtime_ns": 1}, "model.safetensors": {"size": 100,
                                                                           "mtime_ns": 2}}


RECORD = {"config.json": {"size": 10, "mtime_ns": 1, "algo": "sha256", "digest": "c" * 64},
          "model.safetensors": {"size": 100, "mtime_ns": 2, "algo": "sha256",
                                "digest": "a" * 64}}


def test_unverified_without_a_directory_is_every_file():
    assert unverified(None, LOCK) == ["config.json", "model.safetensors"]


def test_unverified_when_all_verified_and_unchanged():
    assert unverified({"verified": RECORD, "files": NOW}, LOCK) == []


@pytest.mark.parametrize(
    "verified, files, why",
    [
        (RECORD, {"config.json": NOW["config.json"]}, "file missing"),
        ({"config.json": RECORD["config.json"]}, NOW, "no record"),
        (RECORD, dict(NOW, **{"model.safetensors": {"size": 100, "mtime_ns": 3}}),
         "mtime changed"),
        (RECORD, dict(NOW, **{"model.safetensors": {"size": 99, "mtime_ns": 2}}),
         "size changed"),
        (dict(RECORD, **{"model.safetensors": dict(RECORD["model.safetensors"],
                                                   digest="b" * 64)}),
         NOW, "verified against another lock"),
    ],
)
def test_unverified_names_the_file(verified, files, why):
    assert unverified({"verified": verified, "files": files}, LOCK) == ["model.safetensors"], why


def test_unverified_when_the_lock_size_differs_from_file_and_record():
    # The lock moved to a new revision of the same path with another size.
    lock = _lock(("config.json", 10, "c" * 64), ("model.safetensors", 120, "a" * 64))
    assert unverified({"verified": RECORD, "files": NOW}, lock) == ["model.safetensors"]


# --- the model download op: the token never on a command line ---------------------------
def test_downloaded_keeps_the_token_and_proxy_credentials_out_of_every_command_string():
    token = "hf_unit-test-token-7c4f9e"
    password = "proxy-pw-31d2"
    lock = _lock(("config.json", 10, "c" * 64))
    state = FakeState()
    host = create_host(state, facts={"model.ModelFiles": {"path=/srv/m/Q": None},
                                     "units.SystemdBooted": False})
    with ctx_state.use(state), ctx_host.use(host):
        commands = list(model_ops.downloaded._inner(
            lock=lock, dest="/srv/m/Q", base_url="https://huggingface.co", token=token,
            proxy=f"http://ops:{password}@proxy:3128",
        ))
    strings = [c for c in commands if isinstance(c, StringCommand)]
    uploads = [c for c in commands if isinstance(c, FileUploadCommand)]
    assert strings and uploads
    for command in strings:
        for secret in (token, password):
            assert secret not in command.get_raw_value()
            assert secret not in command.get_masked_value()
    def text(upload):
        data = upload.src.getvalue() if hasattr(upload.src, "getvalue") else ""
        return data.decode() if isinstance(data, bytes) else data

    carrying = {u.dest: u for u in uploads if token in text(u) or password in text(u)}
    assert sorted(carrying) == ["/run/pyinfra-vllm/hf_token",
                                "/run/pyinfra-vllm/model-download.env"]
    # Under sudo, pyinfra's SFTP step lands in the login user's private spool, not /tmp.
    for upload in carrying.values():
        assert upload.remote_temp_filename.startswith("/run/pyinfra-vllm-upload/")
    last = strings[-1].get_raw_value()
    assert last.startswith("set -a && . /run/pyinfra-vllm/model-download.env && set +a && ")
    assert "--token-file /run/pyinfra-vllm/hf_token" in last
    assert last.endswith(
        "rm -f /run/pyinfra-vllm/model-download.env /run/pyinfra-vllm/hf_token ; exit $rc")


def test_the_download_job_keeps_the_token_and_proxy_credentials_in_its_env_file_only():
    # With systemd the downloader runs as a transient unit: ExecStart and the unit's
    # description are shown to any user by systemctl, so neither may carry a secret;
    # nor may the job script, the watch's arguments, or any command string.
    token = "hf_unit-test-token-5e1a2b"
    password = "proxy-pw-77c0"
    lock = _lock(("config.json", 10, "c" * 64))
    unit = "pyinfra-vllm-model-" + "0" * 12
    state = FakeState()
    host = create_host(state, facts={"model.ModelFiles": {"path=/srv/m/Q": None},
                                     "units.SystemdBooted": True,
                                     "units.UnitState": {f"unit={unit}": None}})
    with ctx_state.use(state), ctx_host.use(host), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr("pyinfra_vllm.operations.util.jobs.unit_name", lambda *_: unit)
        commands = list(model_ops.downloaded._inner(
            lock=lock, dest="/srv/m/Q", base_url="https://huggingface.co", token=token,
            proxy=f"http://ops:{password}@proxy:3128",
        ))

    def text(command) -> str:
        if isinstance(command, StringCommand):
            return command.get_raw_value()
        if isinstance(command, FileUploadCommand):
            data = command.src.getvalue() if hasattr(command.src, "getvalue") else ""
            return data.decode() if isinstance(data, bytes) else data
        return json.dumps([command.args, command.kwargs])

    carrying = [c for c in commands if token in text(c) or password in text(c)]
    assert [c.dest for c in carrying] == [f"/run/pyinfra-vllm/jobs/{unit}/env"]
    assert text(carrying[0]) == (f"https_proxy=http://ops:{password}@proxy:3128\n"
                                 f"http_proxy=http://ops:{password}@proxy:3128\n"
                                 f"HF_TOKEN={token}\n")
    assert carrying[0].remote_temp_filename.startswith("/run/pyinfra-vllm-upload/")
    start = [c for c in commands if isinstance(c, StringCommand)
             and c.get_raw_value().startswith("systemd-run")]
    assert len(start) == 1
    assert "--token-file" not in start[0].get_raw_value()


def test_model_path():
    assert model_plan.model_path("/srv/models/", MODEL_ID) == "/srv/models/Qwen/Qwen3.6-27B"
    assert model_plan.model_path("/srv/models", "gpt2") == "/srv/models/gpt2"


# --- the model lock ----------------------------------------------------------------------
def _settings(tmp_path: Path, name: str, **extra):
    return validate({"model_id": MODEL_ID, "model_lock": str(tmp_path / name), "gateway_open": True, **extra})


def _lock_file(**overrides) -> dict:
    data = {
        "lock_version": 1, "model_id": MODEL_ID, "revision": "main", "commit": COMMIT,
        "base_url": "https://huggingface.co", "created": "2026-06-01T12:00:00Z",
        "total_size": 10,
        "files": [{"path": "config.json", "size": 10, "algo": "git-blob-sha1",
                   "digest": "3c2b1a0f9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b", "lfs": False}],
        "config": {"architectures": ["Qwen3_5ForConditionalGeneration"]},
    }
    data.update(overrides)
    return data


def test_lock_path_default_and_setting(tmp_path):
    assert lock_path(validate({"model_id": MODEL_ID, "gateway_open": True})) == Path("locks/Qwen--Qwen3.6-27B.json")
    assert lock_path(_settings(tmp_path, "x.json")) == tmp_path / "x.json"


def test_load_lock_missing_file(tmp_path):
    settings = _settings(tmp_path, "missing.json")
    with pytest.raises(LockFileError) as error:
        load_lock(settings)
    message = str(error.value)
    assert f"python -m tools.model_lock {MODEL_ID}" in message
    assert "--revision main" in message and f"--out {tmp_path / 'missing.json'}" in message
    assert load_lock(settings, required=False) is None


def test_load_lock_reads_and_checks(tmp_path):
    path = tmp_path / "good.json"
    path.write_text(json.dumps(_lock_file()))
    lock = load_lock(_settings(tmp_path, "good.json"))
    assert lock["commit"] == COMMIT
    # Read once per run: later calls answer from the cache, not the file.
    path.unlink()
    assert load_lock(_settings(tmp_path, "good.json"))["commit"] == COMMIT


def test_load_lock_accepts_the_commit_as_revision(tmp_path):
    (tmp_path / "by-commit.json").write_text(json.dumps(_lock_file()))
    assert load_lock(_settings(tmp_path, "by-commit.json", model_revision=COMMIT))


def test_load_lock_for_another_model(tmp_path):
    (tmp_path / "other.json").write_text(json.dumps(_lock_file(model_id="Qwen/Qwen2.5-7B")))
    with pytest.raises(LockFileError) as error:
        load_lock(_settings(tmp_path, "other.json"))
    message = str(error.value)
    assert "it locks 'Qwen/Qwen2.5-7B', model_id is 'Qwen/Qwen3.6-27B'" in message
    assert f"python -m tools.model_lock {MODEL_ID}" in message


def test_load_lock_without_config(tmp_path):
    data = _lock_file()
    del data["config"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    with pytest.raises(LockFileError, match="older tools.model_lock"):
        load_lock(_settings(tmp_path, "old.json"))


def test_load_lock_lists_every_problem(tmp_path):
    (tmp_path / "bad.json").write_text(json.dumps(_lock_file(lock_version=0, files=[],
                                                             revision="v1", commit="0" * 40)))
    with pytest.raises(LockFileError) as error:
        load_lock(_settings(tmp_path, "bad.json"))
    message = str(error.value)
    assert "lock_version 0, expected 1" in message
    assert "model_revision is 'main'" in message
    assert "it lists no files" in message


def test_load_lock_unreadable(tmp_path):
    (tmp_path / "cut.json").write_text('{"lock_version": 1, "files": [')
    with pytest.raises(LockFileError, match="unreadable"):
        load_lock(_settings(tmp_path, "cut.json"))


def test_safetensors_bytes():
    assert safetensors_bytes(_lock_file()) is None
    assert safetensors_bytes(_lock(("a.safetensors", 5, "x"), ("b.json", 7, "y"),
                                   ("c.safetensors", 6, "z"))) == 11


# --- the Hugging Face token ------------------------------------------------------------
def test_hf_token_from_setting_then_file_then_environment(tmp_path, monkeypatch):
    from pyinfra_vllm.core.locks import LockFileError, hf_token

    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert hf_token(validate({"gateway_open": True})) == "hf_from_env"
    secret = tmp_path / "token"
    secret.write_text("hf_from_file\n")
    secret.chmod(0o600)
    assert hf_token(validate({"hf_token_file": str(secret), "gateway_open": True})) == \
        "hf_from_file"
    assert hf_token(validate({"hf_token": "hf_inline", "hf_token_file": str(secret),
                              "gateway_open": True})) == "hf_inline"
    monkeypatch.delenv("HF_TOKEN")
    assert hf_token(validate({"gateway_open": True})) is None
    # validate() refuses a missing file (tests/unit/test_settings_rejected.py); one that
    # went away after validation is still named.
    gone = Settings.model_construct(hf_token_file=str(tmp_path / "missing"))
    with pytest.raises(LockFileError, match="hf_token_file .*/missing: cannot be read"):
        hf_token(gone)


def test_the_downloader_reserves_the_names_the_model_fact_skips():
    # files/fetch_model.py runs alone on the host: its copy of the names must be ours.
    assert (fetch_model.VERIFIED_NAME, fetch_model.INCOMING, fetch_model.FETCH_LOCK) == (
        VERIFIED_NAME, INCOMING, FETCH_LOCK)


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a/../../x", ".", "",
                                  ".incoming/x.part", ".fetch.lock", ".verified.json",
                                  ".verified.json.tmp"])
def test_the_lock_and_the_downloader_refuse_paths_outside_or_reserved(path):
    assert unsafe_model_path(path) is not None
    with pytest.raises(fetch_model.UsageError):
        fetch_model.safe_relpath(path)


def test_plain_model_paths_pass():
    for path in ("config.json", "model-00001-of-00015.safetensors", "tokenizer/vocab.json"):
        assert unsafe_model_path(path) is None
        assert fetch_model.safe_relpath(path) == path


def test_the_token_follows_a_redirect_only_to_the_same_scheme_and_host():
    import urllib.request

    handler = fetch_model.SameHostAuthRedirect("hub.example", "hf_tok", "https")
    request = urllib.request.Request("https://hub.example/m/resolve/main/a")
    request.add_header("Authorization", "Bearer hf_tok")
    for target, sent in (("https://hub.example/other", True),
                         ("http://hub.example/other", False),   # https -> http: dropped
                         ("https://cdn.example/signed", False)):
        new = handler.redirect_request(request, None, 302, "Found", {}, target)
        assert new.has_header("Authorization") is sent, target
