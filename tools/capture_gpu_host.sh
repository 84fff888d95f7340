#!/usr/bin/env bash
# Capture, read-only, what the facts read on a real GPU host, then run the project's
# facts and the audit against @local. Nothing here changes a GPU setting: only queries
# (no -pm, -mig, -r, no driver or service change).
#
#   tools/capture_gpu_host.sh OUTDIR
#
# OUTDIR/raw/<command>.txt are fixtures for tests/fixtures/nvidia/<host>/, with each
# command's exit status in OUTDIR/raw/exit-codes.txt; OUTDIR/facts.json is the facts'
# JSON; OUTDIR/audit.log and OUTDIR/reports/ are the audit's output.
set -uo pipefail
out=${1:?usage: tools/capture_gpu_host.sh OUTDIR}
mkdir -p "$out/raw"
pyinfra=${PYINFRA:-pyinfra}

capture() {  # capture NAME COMMAND...
    local name=$1; shift
    "$@" >"$out/raw/$name.txt" 2>&1
    echo "$name $?" >>"$out/raw/exit-codes.txt"
}

capture smi nvidia-smi
capture L nvidia-smi -L
capture topo-m nvidia-smi topo -m
capture topo-p2p-r nvidia-smi topo -p2p r
capture nvlink-s nvidia-smi nvlink --status
capture q nvidia-smi -q
capture query-gpu-csv nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,mig.mode.current,mig.mode.pending,persistence_mode,driver_version --format=csv
capture query-gpu-csv-noheader-nounits nvidia-smi --query-gpu=index,name,uuid,pci.bus_id,memory.total,mig.mode.current,mig.mode.pending,persistence_mode,driver_version --format=csv,noheader,nounits
capture query-gpu-bus-id-compute-cap nvidia-smi --query-gpu=pci.bus_id,compute_cap --format=csv,noheader
capture query-compute-apps nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv,noheader,nounits
capture proc-driver-nvidia-version cat /proc/driver/nvidia/version
capture nvcc-version nvcc --version
capture os-release cat /etc/os-release
capture dpkg-nvidia dpkg-query -W -f '${Package}\t${Version}\t${db:Status-Abbrev}\n' 'nvidia-*' 'libnvidia-*' 'cuda-*'
capture apt-mark-showhold apt-mark showhold
capture systemd-detect-virt systemd-detect-virt
# GPU health (facts.gpu_health): the whole query holds ECC, remapped rows, retired pages,
# clocks event reasons, PCIe and sensors; the XML and the kernel log for the same.
capture q-x nvidia-smi -q -x
capture nvlink-e nvidia-smi nvlink -e
capture dmesg-xid sh -c "dmesg --time-format iso 2>/dev/null | grep -E 'NVRM: Xid' || true"
capture journal-xid sh -c "journalctl -k -b -q --no-pager -o short-iso 2>/dev/null | grep -E 'NVRM: Xid' || true"

facts=(
    facts.topology.GpuTopology facts.topology.NvlinkStatus facts.driver.KernelModule
    facts.cuda.CudaToolkit facts.gpus.GpuInventory facts.driver.DriverInfo
    facts.gpus.GpuComputeCapability facts.gpus.GpuProcesses facts.driver.DriverPackages facts.driver.HeldPackages
    facts.driver.NvmlError facts.topology.P2pRead facts.gpu_health.GpuHealth
    facts.gpu_health.NvlinkErrors facts.gpu_health.XidEvents
)
$pyinfra @local fact "${facts[@]}" --json >"$out/facts.json" 2>"$out/facts.log"
echo "facts $?" >>"$out/raw/exit-codes.txt"
$pyinfra -y @local deploys/audit.py --data audit_report_dir="$out/reports" ${AUDIT_ARGS:-} >"$out/audit.log" 2>&1
echo "audit $?" >>"$out/raw/exit-codes.txt"
# The saved outputs as a support bundle: the ones with any output (an empty one has no kind).
bundle=()
for name in q q-x nvlink-s nvlink-e dmesg-xid journal-xid; do
    [ -s "$out/raw/$name.txt" ] && bundle+=("$out/raw/$name.txt")
done
${PYTHON:-python3} -m tools.gpu_health "${bundle[@]}" >"$out/gpu-health.json" 2>"$out/gpu-health.log"
echo "gpu_health $?" >>"$out/raw/exit-codes.txt"
