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
# Boot sandbox hosts (Debian 12 + systemd + sshd in systemd-nspawn; needs root), e.g.
#   make sandbox HOSTS=2 SCENARIOS=seed,bare    then: pyinfra .sandbox/inventory.py ...
SCENARIOS ?= seed
.PHONY: sandbox sandbox-down sandbox-status sandbox-rootfs sandbox-test
sandbox: venv
	$(PY) -m sandbox up --hosts $(HOSTS) --scenario $(SCENARIOS)

sandbox-down: venv
	$(PY) -m sandbox down

sandbox-status: venv
	$(PY) -m sandbox status

sandbox-rootfs: venv
	$(PY) -m sandbox rootfs

sandbox-test: venv
	$(PY) -m pytest -m e2e tests/e2e
