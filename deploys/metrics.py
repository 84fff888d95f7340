"""Metrics: this host's verdicts for node_exporter's textfile collector.

    pyinfra inventory.py deploys/metrics.py

The stage itself: pyinfra_vllm/stages/metrics.py.
"""

from pyinfra_vllm.stages.metrics import metrics

metrics()
