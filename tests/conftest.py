"""Fixtures shared by test modules in several folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pyinfra_testing.util import FakeFact, FakeHost

from sandbox.mirror import model
from sandbox.mirror.server import MirrorServer

MIRROR_REPO = model.DEFAULT_REPO_ID

_get_fact = FakeHost.get_fact


def _get_fact_none_aware(self, fact_cls, *args, **kwargs):
    # pyinfra-testing 0.2.1 wraps an argument-less fact's value in a FakeFact, even a
    # JSON null, so ``fact is None`` (how the operations read "no driver") never holds.
    # Hand None back as None, like a real host does; and a boolean as itself (a FakeFact
    # of False is true: ``if host.get_fact(SystemdBooted)`` would always hold).
    value = _get_fact(self, fact_cls, *args, **kwargs)
    if isinstance(value, FakeFact) and (value.data is None or isinstance(value.data, bool)):
        return value.data
    return value


FakeHost.get_fact = _get_fact_none_aware


@pytest.fixture(scope="module")
def mirror_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the generated tiny model at ``MIRROR_REPO``."""
    base = tmp_path_factory.mktemp("mirror")
    model.generate(base / MIRROR_REPO)
    return base


@pytest.fixture(scope="module")
def mirror(mirror_root: Path):
    """The model mirror serving ``mirror_root`` on 127.0.0.1 (a free port)."""
    with MirrorServer(mirror_root) as server:
        yield server


class InventoryHost:
    """Just what the execute-time checks of the GPU operations use of a pyinfra host: the
    GPU inventory as its one fact, and the lines it logs."""

    def __init__(self, inventory):
        self.inventory = inventory
        self.logged = []

    def get_fact(self, fact, *args, **kwargs):
        return self.inventory

    def log_styled(self, message, **kwargs):
        self.logged.append(message)


@pytest.fixture
def inventory_host():
    """``inventory_host(gpus)``: a host whose GPU inventory is ``gpus``."""
    return InventoryHost


# The audit's default audit_report_dir, in the checkout (tests run from its root).
CHECKOUT_REPORTS = Path(__file__).resolve().parents[1] / "reports"


def _checkout_report_files() -> set[str]:
    return set(os.listdir(CHECKOUT_REPORTS)) if CHECKOUT_REPORTS.is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def _checkout_reports_untouched():
    """No test writes into the checkout's reports/: each audit a test runs is given a
    temporary audit_report_dir (the e2e sandbox's is ``Sandbox.reports``)."""
    before = _checkout_report_files()
    yield
    added = sorted(_checkout_report_files() - before)
    if added:
        pytest.fail(f"the tests wrote {len(added)} file(s) into {CHECKOUT_REPORTS}: "
                    f"{', '.join(added)}; give the audit audit_report_dir in a temporary "
                    "directory")


# The tests that start servers: nginx, HTTP servers (on loopback too), headless Chromium,
# testssl.sh, nft in a network namespace of the kernel. They are marked ``servers``: `make
# check`, the developers' fast loop, leaves them out (-m "not servers and not e2e"); `make
# test` runs them with the rest. Named by module file (every test of it), by fixture (what
# it starts) or, where a module holds both kinds, by test; tests/e2e has its own marker.
SERVER_MODULES = {
    "test_gateway_nginx.py",  # the rendered gateway under the real nginx
    "test_router_haproxy.py",  # the rendered front door under the real HAProxy
    "test_report_browser.py",  # the HTML report in headless Chromium
    "test_wait_ready.py",  # files/wait_ready.py against HTTP servers and another user's
    "test_relay.py",  # sandbox/relay.py on loopback
    "test_proxy.py",  # the sandbox's HTTP proxy on loopback
}
SERVER_FIXTURES = {"mirror"}  # the model mirror's HTTP server (above)
SERVER_TESTS = {
    "test_gateway_analyzers.py": {"test_testssl_finds_nothing_but_the_accepted"},
    "test_engine_firewall.py": {  # nft in a network namespace (unshare --net)
        "test_the_engines_user_serves_root_and_nginx_and_nobody_is_refused",
        "test_another_user_on_the_engines_port_completes_no_handshake",
        "test_a_listener_answering_with_syn_cookies_on_the_engine_s_port_gets_nothing",
        "test_the_engine_s_own_connections_open_and_close_through_the_table",
    },
    "test_engine_serving.py": {
        "test_the_fact_reads_what_the_engine_serves",
        "test_engine_health_prints_a_whole_line_for_the_one_read",
        "test_the_engine_s_own_key_is_sent_from_its_file_on_curl_s_input",
        "test_a_listener_of_another_user_is_named_never_asked",
    },
    "test_rolling.py": {
        "test_idle_waits_until_no_request_is_in_flight",
        "test_idle_gives_up_at_the_end_of_the_grace",
        "test_idle_does_not_wait_for_an_engine_that_does_not_answer",
        "test_idle_never_asks_a_listener_of_another_user",
    },
    "test_bench.py": {"test_the_key_goes_to_no_listener_but_root_s_on_the_gateway_s_port"},
    # files/sentinel.py against files/openai_stub.py on a Unix socket
    "test_sentinel.py": {
        "test_a_serving_engine_keeps_the_host_in",
        "test_completions_that_hang_behind_a_healthy_health_take_the_host_out_and_back",
        "test_another_owner_s_flag_a_drain_and_a_leave_pause_it",
        "test_an_engine_unit_starting_pauses_it",
    },
    # files/openai_stub.py on loopback, in the place of vLLM's server
    "test_engine_trial.py": {"test_the_whole_trial_against_a_stand_in_engine",
                             "test_a_plan_runs_from_a_copy_of_the_runner_s_files_alone"},
    "test_model_lock.py": {
        "test_cli_against_gated_mirror_keeps_token_secret",
        "test_config_that_does_not_match_its_lock_entry_is_refused",
    },
    "test_mirror_server.py": {
        "test_token_gates_repo_requests",
        "test_cli_serve_generates_prints_url_and_stops",
    },
}
E2E = Path(__file__).parent / "e2e"


def _starts_servers(item: pytest.Item) -> bool:
    module = item.path.name
    return (module in SERVER_MODULES
            or getattr(item, "originalname", item.name) in SERVER_TESTS.get(module, ())
            or not SERVER_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by it
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that start servers ``servers``. A test SERVER_TESTS names that its
    module no longer defines stops the run: a renamed server test never slips into the
    fast loop unmarked."""
    modules = {}
    for item in items:
        if E2E in item.path.parents:
            continue
        if _starts_servers(item):
            item.add_marker(pytest.mark.servers)
        module = item.getparent(pytest.Module)
        if module is not None:
            modules[item.path.name] = module.obj
    gone = [f"{name} {test}" for name, module in sorted(modules.items())
            for test in sorted(SERVER_TESTS.get(name, ())) if not hasattr(module, test)]
    if gone:
        raise pytest.UsageError(
            "tests/conftest.py SERVER_TESTS names tests their modules no longer define: "
            f"{', '.join(gone)}; name the test that starts a server under its new name")
