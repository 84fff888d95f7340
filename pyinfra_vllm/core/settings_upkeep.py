"""The settings of looking after the fleet: the audit's reports, monitoring, the
acceptance benchmark and removal (a section of pyinfra_vllm/core/settings.py's Settings,
where they are validated).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from pyinfra_vllm.core import (
    settings_checks_engine,
    settings_checks_networks,
    settings_checks_paths,
)
from pyinfra_vllm.core.settings_docs import SettingsSection


class UpkeepSettings(SettingsSection):
    """Looking after the fleet: reports, monitoring, the acceptance benchmark, and
    removal."""

    # --- reports ---------------------------------------------------------------------
    textfile_collector_dir: str = "/var/lib/pyinfra-vllm-metrics"
    """Where root writes the suite's textfiles for node_exporter's textfile collector
    (pyinfra_vllm.prom, the GPUs' health, the benchmark's figures): a directory the metrics
    stage makes root's, 0755, and points node_exporter at. Every directory of the path
    must be root's and writable by root alone, or the host is refused and nothing is
    written (Debian's and Ubuntu's /var/lib/prometheus/node-exporter is not: its parent is
    the prometheus account's). Under the same rules as model_dir; deploys/remove.py
    deletes the suite's files there.
    """
    audit_report_dir: str = "reports"
    """Directory, on the operator's machine, where the audit writes its reports."""
    audit_report_keep: int = Field(default=30, ge=1, le=10000)
    """Audit report sets (``audit-<UTC>.json``, ``.md`` and ``.html``) kept in
    ``audit_report_dir``, the one just written included; older sets are removed after each
    audit. Other files there are never touched.
    """

    # --- monitoring ------------------------------------------------------------------
    node_exporter_install: bool = True
    """The metrics stage installs the distribution's prometheus-node-exporter, enabled and
    running with its textfile collector on textfile_collector_dir, on loopback only
    (node_exporter_port); the gateway serves it as /node-metrics behind the /metrics allow
    list. False writes the textfile alone, for a node_exporter run another way.
    """
    node_exporter_port: int = Field(default=9100, ge=1, le=65535)
    """Port node_exporter listens on, on 127.0.0.1 only (the package's own default, :9100 on
    every address, is never used): a central Prometheus reads it through the gateway.
    """
    prometheus_servers: list[str] = Field(default_factory=list)
    """Addresses (CIDR, IPv4 or IPv6, no scope id) of the central Prometheus servers: added
    to metrics_allow for the gateway's /metrics and /node-metrics; host bits are cleared.
    """
    metrics_address: str | None = None
    """Host name or IP address a central Prometheus reaches this host's gateway at, for
    ``python -m tools.scrape_config``; None takes the inventory's ssh_hostname, else the
    host's inventory name. No port, scheme or path (the port is gateway_port).
    """

    # --- the sentinel (files/sentinel.py, pyinfra_vllm/stages/sentinel.py) --------------
    sentinel: bool = True
    """A sentinel on the host (vllm-sentinel.service, the sentinel stage): every
    sentinel_interval_s it sends the engine a one-token completion (/health answers 200
    while the engine core is frozen); after sentinel_failures failures in a row the host
    leaves the load balancers' rotation (the gateway's /health answers 503, /v1 keeps
    serving) and, with sentinel_restart, the engine is restarted; once completions answer
    the host returns. On by default: an engine alive but broken answers /health and fails
    every request, and nothing else takes it out. False removes the sentinel's units,
    state and textfile (docs/runtime.md, "The sentinel").
    """
    sentinel_interval_s: int = Field(default=30, ge=5, le=3600)
    """Seconds between two of the sentinel's completions, and the first wait between two
    of its restarts (doubled after each, at most 600 s). A host leaves the rotation about
    sentinel_interval_s x sentinel_failures after its engine stopped answering.
    """
    sentinel_timeout_s: int = Field(default=20, ge=1, le=3599)
    """Seconds the sentinel waits for its one-token completion; longer is a failure. Less
    than sentinel_interval_s. A busy engine queues the completion behind its batch: a wait
    this long means every new request waits as long.
    """
    sentinel_failures: int = Field(default=3, ge=1, le=100)
    """Failed completions in a row that take the host out of the rotation (and restart the
    engine, with sentinel_restart). 1 acts on a single slow answer.
    """
    sentinel_restart: bool = True
    """The sentinel restarts an engine it took out of rotation (systemctl restart, never a
    GPU reset), again after a doubling wait while it fails, never more than 3 times within
    the engine unit's start-limit interval (30 min), so systemd's own retry and the deploy
    still have a start. False: out of rotation only; the audit names the host (exit 1).
    """

    # --- acceptance benchmark (python -m tools.bench) ---------------------------------
    bench_input_len: int = Field(default=8192, ge=1, le=1048576)
    """Prompt tokens of each benchmark request (vLLM's random dataset), before bench_scale.
    Long, as the 128K-context workload the suite serves: prefill and the KV cache are
    what such a server spends on. docs/bench.md says why this shape.
    """
    bench_output_len: int = Field(default=512, ge=1, le=65536)
    """Output tokens of each benchmark request (end of sequence ignored), before
    bench_scale: enough tokens for inter-token latency to dominate the stream.
    """
    bench_concurrency: int = Field(default=16, ge=1, le=4096)
    """Requests in flight at once during the benchmark, before bench_scale: 16 of the
    default shape need about 140,000 tokens of KV cache, what two 80 GB GPUs hold beside
    a 27B model in BF16, so the benchmark measures steady serving, not preemption.
    """
    bench_requests: int = Field(default=64, ge=1, le=100000)
    """Requests of one benchmark run, before bench_scale: four waves of bench_concurrency.
    """
    bench_scale: float = Field(default=1.0, gt=0, le=1)
    """Multiplies bench_input_len, bench_output_len, bench_concurrency and bench_requests
    (each rounded, at least 1), for small hosts: sandbox hosts (a CPU engine) use 1/16.
    """
    bench_min_output_tokens_per_s: float | None = Field(default=None, ge=0)
    """The least output tokens/s a host's last benchmark must reach: the audit names a host
    below it (exit 1) and the alert PyinfraVllmBenchSlow fires. None: not judged.
    """
    bench_max_ttft_p95_ms: float | None = Field(default=None, gt=0)
    """The largest time-to-first-token p95 (ms) a host's last benchmark may show: the
    audit names a host above it (exit 1) and the alert PyinfraVllmBenchSlow fires. None:
    not judged.
    """
    bench_slo_ttft_ms: float | None = Field(default=None, gt=0)
    """Latency target for goodput: a request's time to first token (ms) at most this.
    With a bench_slo_* set, the benchmark reports goodput (completed requests per second
    that met every target set, vLLM's ``--goodput ttft:MS``) and the share of requests
    that met them, and the canary and python -m tools.tune compare goodput instead of
    output tokens/s (docs/bench.md). Needs a stack whose benchmark client has goodput
    (every row but vLLM 0.6.3's). None: not set.
    """
    bench_slo_itl_ms: float | None = None
    """Refused when set: vLLM's goodput (``--goodput``) takes ttft, tpot and e2el targets,
    not itl. Inter-token latency is a list of gaps per request, and vLLM judges none of
    them against a target; the per-request figure it judges is TPOT (the mean gap after
    the first token): use bench_slo_tpot_ms. Kept as a key so that setting it says this.
    """
    bench_slo_tpot_ms: float | None = Field(default=None, gt=0)
    """Latency target for goodput: a request's time per output token after the first (ms)
    at most this (vLLM's ``--goodput tpot:MS``; a request of one output token counts as
    0). As bench_slo_ttft_ms. None: not set.
    """

    # --- removal (deploys/remove.py) ---------------------------------------------------
    remove_model_files: bool = False
    """deploys/remove.py also deletes the model's files: what the downloader wrote in
    {model_dir}/{model_id} (the lock's files, its record and download area), then that
    directory where it is left empty; other files there stay. Without it the weights
    stay. Never set by the deploy itself.
    """
    remove_volume_fstab: bool = False
    """deploys/remove.py also unmounts model_dir and removes its /etc/fstab line (the
    model_volume stage's); the volume itself is never formatted or wiped.
    """

    # --- rules of one setting (settings_checks* say what each allows) -----------------
    _collector_path = field_validator("textfile_collector_dir")(settings_checks_paths.host_path)
    _prometheus_networks = field_validator("prometheus_servers")(
        settings_checks_networks.networks
    )
    _reachable_address = field_validator("metrics_address")(
        settings_checks_networks.reachable_address
    )
    _itl_target = field_validator("bench_slo_itl_ms")(settings_checks_engine.itl_target_refused)
