"""The names the model downloader (files/fetch_model.py) reserves inside a model's
directory, for the operator side that reads what it left.

files/fetch_model.py runs alone on the host and imports nothing of this repository, so
it carries the same two names; tests/unit/test_model.py holds them equal.
"""

from __future__ import annotations

# The record of the files verified against the lock: path, size, mtime, checksum.
VERIFIED_NAME = ".verified.json"
# Where partial downloads wait, under their path in the lock plus ".part".
INCOMING = ".incoming"
