"""Bench: the acceptance benchmark, through each host's gateway, with vLLM's own client

    python -m tools.bench inventory.py

The stage itself: pyinfra_vllm/stages/bench.py.
"""

from pyinfra_vllm.stages.bench import bench

bench()
