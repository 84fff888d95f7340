#!/usr/bin/env bash
# What the environment's proof costs on a fresh host (bench/fresh_host.md has the
# figures): files/vllm_probe.py inside vLLM 0.6.3's CUDA environment, with Python's
# bytecode caches (__pycache__) removed first, as on a fresh host, and then present.
# PROBE=FILE times another version of the probe beside it, in turn (e.g. an older one:
# `git show REV:files/vllm_probe.py > /tmp/probe.py`). Each timing is bash's `time` on
# the host.
#
#   bash bench/probe.sh [RUNS]          # default 2 runs of each
#   PROBE=/tmp/probe.py bash bench/probe.sh 2
#
# Root, from the repository root, with the sandbox's uv cache holding the stack's wheels
# (any earlier run of bench/fresh_host.sh or the e2e tests). Boots one `seed` host
# (--own-caches), builds the environment with deploys/full.py (the engine not started),
# times on the host, and tears the sandbox down.
set -euo pipefail
PY=.venv/bin/python
PYINFRA=.venv/bin/pyinfra
RUNS=${1:-2}

$PY -m sandbox down >/dev/null
$PY -m sandbox up --hosts 1 --scenario seed --own-caches >/dev/null
$PYINFRA -y --json .sandbox/inventory.py deploys/full.py --data vllm_device=cuda \
    --data vllm_version=0.6.3 --data vllm_start=false 2>/dev/null \
    | $PY -c 'import json,sys; t=json.load(sys.stdin)["results"]["totals"]; sys.exit(t["error"] != 0)'

$PY - "$RUNS" "${PROBE:-}" <<'PYEOF'
import json, subprocess, sys
from sandbox import hosts
address = json.load(open(".sandbox/state.json"))["hosts"][0]["address"]
runs, other = sys.argv[1], sys.argv[2]
probes = [("the probe", "$E/pyinfra-vllm-probe.py")]
setup = ""
if other:
    # The other version, written on the host through the script itself.
    text = open(other).read()
    setup = f"cat > /tmp/probe-other.py <<'EOF_PROBE'\n{text}\nEOF_PROBE\n"
    probes.append((f"PROBE ({other})", "/tmp/probe-other.py"))
body = ""
for words, path in probes:
    body += f"""
    clean; echo "run $run, {words}, no bytecode cache (a fresh host): "; time probe {path}
    echo "run $run, {words}, bytecode cached: "; time probe {path}"""
script = setup + r"""
E=$(readlink -f /opt/vllm/current)
TIMEFORMAT='%R s wall, %U s user + %S s sys'
clean() { find "$E" -name __pycache__ -type d -prune -exec rm -rf {} + ; }
probe() { "$E/bin/python" "$1" --expect-vllm 0.6.3 --marker /tmp/m.json \
          --stack bench --requirements-sha256 bench --manager uv >/dev/null 2>&1; }
cd /tmp
for run in $(seq RUNS); do BODY
done
echo "bytecode files after the imports: $(find "$E" -name '*.pyc' | wc -l)"
""".replace("RUNS", runs).replace("BODY", body)
argv = [*hosts.ssh_argv(address), "--", "sudo -n bash -s"]
done = subprocess.run(argv, input=script, capture_output=True, text=True, check=True)
# bash's `time` writes to stderr, after the words on stdout: each beside its words.
words, times = done.stdout.splitlines(), done.stderr.strip().splitlines()
for index, line in enumerate(words):
    print(line + (times[index] if index < len(times) else ""))
PYEOF
$PY -m sandbox down >/dev/null
