"""operations/util/uploads.py: the commands that keep an upload private, under sudo too."""

from __future__ import annotations

from pyinfra.api import FileUploadCommand, StringCommand

from operations.util.uploads import (
    SECRET_DIR,
    UPLOAD_ROOT,
    env_file_text,
    private_upload,
    secret_file,
    sourced,
    spool_dir,
)


def test_the_destination_has_its_mode_before_the_upload_and_the_spool_is_private():
    prepare, upload, cleanup = list(private_upload(b"secret\n", "/etc/x/keys.conf", mode="600",
                                                   owner="root:www-data"))
    spool = spool_dir("/etc/x/keys.conf")
    assert spool.startswith(UPLOAD_ROOT + "/")
    assert isinstance(prepare, StringCommand) and prepare.get_raw_value() == (
        f"install -d -m 711 -o root -g root {UPLOAD_ROOT} "
        f'&& install -d -m 700 -o "${{SUDO_USER:-$(id -un)}}" {spool} '
        "&& mkdir -p /etc/x && install -m 600 /dev/null /etc/x/keys.conf "
        "&& chown root:www-data /etc/x/keys.conf")
    # pyinfra's SFTP step (as the login user, under sudo) lands in the private spool.
    assert isinstance(upload, FileUploadCommand)
    assert upload.dest == "/etc/x/keys.conf"
    assert upload.remote_temp_filename == f"{spool}/upload"
    assert upload.src.getvalue() == b"secret\n"
    assert cleanup.get_raw_value() == f"rm -rf {spool}"


def test_secret_files_live_in_a_root_only_tmpfs_directory():
    prepare, upload, _cleanup = list(secret_file(b"t\n", "hf_token"))
    assert f"&& install -d -m 700 -o root -g root {SECRET_DIR} " in prepare.get_raw_value()
    assert upload.dest == f"{SECRET_DIR}/hf_token"


def test_env_files_keep_values_values():
    text = env_file_text({"HTTPS_PROXY": "http://u:p w$x@proxy:3128"}).decode()
    assert text == "HTTPS_PROXY='http://u:p w$x@proxy:3128'\n"
    assert StringCommand(*sourced("/run/x.env"), "true").get_raw_value() == (
        "set -a && . /run/x.env && set +a && true")
