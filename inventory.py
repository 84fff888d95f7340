"""An example fleet: edit the names, addresses and per-host data, keep the shape.

Run from the repository root:

    pyinfra inventory.py deploys/audit.py      # read-only report of every host
    pyinfra inventory.py deploys/full.py       # converge every host

Each group is a list of hosts; a host is "address" or ("name", {data}). Host data
overrides group_data/<group>.py, which overrides group_data/all.py, which overrides
the defaults in pyinfra_vllm/core/settings.py (docs/settings.md lists every key).
"""

# Two-A100 80GB PCIe servers with an NVLink bridge: the product's target machine.
a100_nvlink = [
    (
        "gpu-a100-01.example.internal",
        {
            "ssh_user": "ubuntu",
            "_sudo": True,
            # The spare NVMe disk for the weights; left unformatted by the vendor.
            "model_volume_device": "/dev/nvme1n1",
            # Allow mkfs.xfs on it, once, because it carries no file system yet.
            "model_volume_mkfs": True,
        },
    ),
    (
        "gpu-a100-02.example.internal",
        {
            "ssh_user": "ubuntu",
            "_sudo": True,
            "model_volume_device": "/dev/nvme1n1",
        },
    ),
]
