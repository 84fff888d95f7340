"""The gateway's own cost: the same benchmark against the engine directly and through
nginx (TLS, the API key check, the rate limit), in alternating pairs (bench/serving.md
has the figures).

    make demo                                   # one host, TLS, serving
    .venv/bin/python bench/gateway_cost.py [PAIRS]

Root, from the repository root. The engine is moved to TCP on the host's own address
(the suite's nftables table lets root reach it there, as on the 0.6.3 row), each pair runs
files/bench_client.py (vLLM's client) on the host twice, direct (the engine's own key)
and through the gateway (the sandbox's API key, given on standard input, never on a
command line), and the host is converged back onto its Unix socket at the end. Prints
each pair, then the medians and the median of the pairs' ratios.
"""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sandbox import rootfs  # noqa: E402
from sandbox.hosts import API_KEY_FILE, KEY_FILE, KNOWN_HOSTS  # noqa: E402

STATE = json.loads((ROOT / ".sandbox" / "state.json").read_text())
ADDRESS = STATE["hosts"][0]["address"]
SHAPE = {"input_len": 512, "output_len": 32, "concurrency": 4, "requests": 16}
CLIENT = ("/opt/vllm/current/bin/python /usr/local/lib/pyinfra-vllm/bench_client.py "
          "--record /tmp/gateway-cost --textfile /tmp/gateway-cost/bench.prom "
          f"--stack sandbox --shape '{json.dumps(SHAPE)}' -- --backend openai "
          "--endpoint /v1/completions --model sandbox/tiny-qwen2 "
          "--tokenizer /srv/models/sandbox/tiny-qwen2 --dataset-name random --ignore-eos "
          f"--seed 0 --disable-tqdm --random-input-len {SHAPE['input_len']} "
          f"--random-output-len {SHAPE['output_len']} --num-prompts {SHAPE['requests']} "
          f"--max-concurrency {SHAPE['concurrency']}")
# The key arrives on standard input; the engine's from its root-only file, for the
# engine's listener alone (--owner: the client sends a key only to that user's listener).
DIRECT = ("set -a; . /etc/vllm/engine-key.env; set +a; OPENAI_API_KEY=$VLLM_API_KEY "
          f"{CLIENT.replace(' -- ', ' --owner vllm -- ', 1)} --base-url http://{ADDRESS}:8000")
GATEWAY = ("read -r OPENAI_API_KEY; export OPENAI_API_KEY; "
           "SSL_CERT_FILE=/etc/nginx/vllm-tls/cert.pem NO_PROXY=127.0.0.1 "
           f"{CLIENT} --base-url https://127.0.0.1:8001")
ON_TCP = ["--data", "vllm_listen_beyond_loopback=true", "--data", f"vllm_host={ADDRESS}",
          "--data", f'vllm_engine_allow=["{ADDRESS}/32"]']


def on_host(script: str, key: str = "") -> dict:
    ssh = ["ssh", "-i", str(KEY_FILE), "-o", f"UserKnownHostsFile={KNOWN_HOSTS}",
           "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", f"{rootfs.OPERATOR}@{ADDRESS}",
           "--", "sudo", "-n", "--", "sh", "-c", shlex.quote(script)]
    out = subprocess.run(ssh, input=key + "\n", capture_output=True, text=True, check=True)
    line = [line for line in out.stdout.splitlines() if line.startswith("bench: {")][-1]
    return json.loads(line.removeprefix("bench: "))


def converge(*data: str) -> None:
    subprocess.run([str(ROOT / ".venv/bin/pyinfra"), "-y", ".sandbox/inventory.py",
                    *data, "deploys/full.py"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(pairs: int) -> None:
    key = next(line for line in API_KEY_FILE.read_text().splitlines()
               if line and not line.startswith("#"))
    converge(*ON_TCP)
    try:
        on_host(DIRECT)  # warm-up, not counted
        rows = []
        for number in range(1, pairs + 1):
            # In turn, first one then the other first: neither always meets a warmer engine.
            if number % 2:
                direct, gateway = on_host(DIRECT), on_host(GATEWAY, key)
            else:
                gateway, direct = on_host(GATEWAY, key), on_host(DIRECT)
            assert direct["failed"] == gateway["failed"] == 0, (direct, gateway)
            rows.append((direct, gateway))
            print(f"pair {number}: TTFT p50 {direct['ttft_ms']['p50']} / "
                  f"{gateway['ttft_ms']['p50']} ms, output {direct['output_tokens_per_s']} / "
                  f"{gateway['output_tokens_per_s']} tokens/s (direct / gateway)", flush=True)
    finally:
        converge()
    for words, get in (("TTFT p50 ms", lambda r: r["ttft_ms"]["p50"]),
                       ("output tokens/s", lambda r: r["output_tokens_per_s"])):
        direct = statistics.median(get(d) for d, _ in rows)
        gateway = statistics.median(get(g) for _, g in rows)
        ratio = statistics.median(get(g) / get(d) for d, g in rows)
        print(f"{words}: direct {direct:g}, gateway {gateway:g}, gateway/direct (paired "
              f"median) {ratio:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
