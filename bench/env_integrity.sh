#!/usr/bin/env bash
# What the vLLM environment's integrity check costs on a no-op run (bench/env_integrity.md
# has the figures): the listing (find, stat only) sorted and compared with the manifest,
# exactly as facts/python_env.py VllmEnvironments runs it, on a converged sandbox host's
# environment (vLLM 0.17.0's CPU build, about 7.9 GB).
#
#   python -m sandbox up --hosts 1 --scenario seed
#   pyinfra -y .sandbox/inventory.py deploys/full.py       # converge (builds the environment)
#   bash bench/env_integrity.sh
#
# Root, from the repository root. It runs the check on the host's own files through its
# root file system as this machine sees it (the same files and disk the host reads),
# with bench/timing.py: warm page cache (a run every few minutes keeps the inodes cached),
# then once with the caches dropped.
set -euo pipefail
PY=.venv/bin/python
ROOTFS=${ROOTFS:-/var/lib/pyinfra-vllm-sandbox/hosts/gpu-sbx-1/merged}
ENV=$(readlink "$ROOTFS/opt/vllm/current")
DIR="$ROOTFS$ENV"
CHECK=$($PY - "$DIR" <<'PY'
import sys
from pyinfra.api import QuoteString
from pyinfra_testing.util import get_command_string
from facts.python_env import MANIFEST, listing_command
path = sys.argv[1]
print(get_command_string(listing_command(QuoteString(path)))
      + f" | cmp -s - {path}/{MANIFEST} && echo intact")
PY
)
echo "environment: $ENV: $(du -sh --apparent-size "$DIR" | cut -f1), $(find "$DIR" -xdev | wc -l) entries"
echo "check: $CHECK" | cut -c1-200
sh -c "$CHECK"
python3 bench/timing.py -n 10 -- sh -c "$CHECK"
sync; echo 3 > /proc/sys/vm/drop_caches
/usr/bin/time -f "cold caches: %e s wall, %U s user, %S s sys" sh -c "$CHECK"
