"""The library behind the deploys: settings, stacks, plans and verdicts, the operations,
the run context, the audit's reports, and the stages as ``@deploy`` functions
(``pyinfra_vllm.stages``)."""
