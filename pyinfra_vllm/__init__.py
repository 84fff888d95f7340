"""The library behind the deploys: settings, stacks, the run context, the checks and
gates, reports, and the stages as ``@deploy`` functions (``pyinfra_vllm.stages``)."""
