"""The stages as ``@stage`` functions (pyinfra ``@deploy`` functions, pyinfra_vllm/run/stage.py),
one module per stage, named after it.

deploys/<stage>.py runs one; deploys/full.py runs them all (``full``). Another deploy
repository can call them too: ``from pyinfra_vllm.stages.sysctl import sysctl``.
"""
