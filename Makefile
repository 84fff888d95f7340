# The faces of the project. Run everything from the repository root.
SHELL := /bin/bash
PY ?= .venv/bin/python
PYINFRA ?= .venv/bin/pyinfra
HOSTS ?= 1

.PHONY: venv test demo audit-local

venv: .venv/.done
.venv/.done: pyproject.toml requirements.lock
	python3 -m venv .venv
	.venv/bin/pip install -q -r requirements.lock
	touch $@

# --- lead: test / demo targets (filled in by the lead) ---
test: venv
	$(PY) -m pytest

audit-local: venv
	$(PYINFRA) -y @local deploys/audit.py

# --- sandbox targets (owned by the sandbox work) ---
