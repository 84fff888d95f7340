"""The MIG stage's helpers: the mig-parted plan, busy GPUs and the verification messages."""

from __future__ import annotations

from pyinfra_vllm.plans.mig import busy_gpus, busy_reason, mig_disabled_on, plan_mig


def _gpu(index, current="Disabled", pending="Disabled"):
    return {"index": index, "uuid": f"GPU-{index}", "mig_current": current, "mig_pending": pending}


def test_mig_plan_follows_mig_parted():
    gpus = [_gpu(1, "Enabled", "Enabled"), _gpu(0), _gpu(2, "Disabled", "Enabled"),
            _gpu(3, "Enabled", "Disabled"), _gpu(4, None, None)]
    assert plan_mig(gpus) == [
        {"index": 1, "uuid": "GPU-1", "set_pending": True, "reset": True},
        {"index": 2, "uuid": "GPU-2", "set_pending": True, "reset": False},
        {"index": 3, "uuid": "GPU-3", "set_pending": False, "reset": True},
    ]
    assert mig_disabled_on(_gpu(4, None, None))  # no MIG support: nothing to do
    assert plan_mig([_gpu(0), _gpu(1)]) == []


def test_busy_gpus_ignores_our_service_and_other_gpus():
    steps = plan_mig([_gpu(0, "Enabled", "Enabled"), _gpu(1)])
    processes = [
        {"gpu_uuid": "GPU-0", "pid": 10, "process_name": "python3"},
        {"gpu_uuid": "GPU-0", "pid": 11, "process_name": "nvtop"},
        {"gpu_uuid": "GPU-1", "pid": 12, "process_name": "other"},
    ]
    assert busy_gpus(steps, processes, ignore_pids=[10]) == {0: [11]}
    assert busy_gpus(steps, processes, ignore_pids=[10, 11]) == {}
    assert busy_gpus(steps, None) == {}
    reason = busy_reason({0: [11]}, processes)
    assert "GPU 0: pid 11 (nvtop)" in reason and "nothing was changed" in reason


def test_mig_verification_messages(inventory_host):
    from pyinfra_vllm.operations.mig import _verify_mig_disabled

    host = inventory_host([_gpu(0), _gpu(1, "Enabled", "Disabled")])
    assert _verify_mig_disabled(None, host, [0], False) is True
    assert _verify_mig_disabled(None, host, [0, 1], False) is False
    assert host.logged == [
        "MIG still pending after reset on GPU 1: reboot required; re-run after rebooting or "
        "set allow_reboot=true"
    ]
    host.logged.clear()
    assert _verify_mig_disabled(None, host, [1], True) is False
    assert host.logged[0].startswith("MIG still enabled on GPU 1 after reset and reboot")
    assert _verify_mig_disabled(None, inventory_host(None), [0], False) is False
