"""The sysctl stage's helpers: the per-key plan, the drop-in path and its template."""

from __future__ import annotations

from facts.sysctl import KernelParam, normalize, proc_sys_path
from pyinfra_vllm.core.templating import render
from pyinfra_vllm.plans.sysctl import TEMPLATE, drop_in_path, plan_sysctl


def test_sysctl_plan_per_key():
    params = {"vm.swappiness": 1, "net.core.somaxconn": 65535, "net.ipv4.ip_local_port_range":
              "1024 65000", "vm.gone": 1}
    current = {
        "vm.swappiness": {"value": "60", "writable": False},
        "net.core.somaxconn": {"value": "4096", "writable": True},
        "net.ipv4.ip_local_port_range": {"value": "1024 65000", "writable": True},
        "vm.gone": None,
    }
    to_write, not_applied = plan_sysctl(params, current)
    assert to_write == [("net.core.somaxconn", "65535")]
    assert not_applied == {
        "vm.swappiness": "/proc/sys is read-only here; running value 60",
        "vm.gone": "unknown to this kernel",
    }


def test_sysctl_paths_and_values():
    assert drop_in_path(60) == "/etc/sysctl.d/60-vllm.conf"
    assert proc_sys_path("net.core.somaxconn") == "/proc/sys/net/core/somaxconn"
    assert normalize("32768\t60999") == "32768 60999"
    assert KernelParam().process(["read-only", "60"]) == {"value": "60", "writable": False}
    assert KernelParam().process(["writable", "32768\t60999"]) == {
        "value": "32768 60999", "writable": True}


def test_sysctl_template_renders_one_line_per_key():
    # The renderer pyinfra_vllm/operations/sysctl.py drop_in uses (strict, keep_trailing_newline).
    text = render(TEMPLATE, params=[("vm.swappiness", "1"), ("net.core.somaxconn", "65535")])
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert body == ["vm.swappiness = 1", "net.core.somaxconn = 65535"]
    assert text.endswith("65535\n")
