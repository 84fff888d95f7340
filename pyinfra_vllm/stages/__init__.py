"""The stages as ``@stage`` functions (pyinfra ``@deploy`` functions, pyinfra_vllm/run/stage.py),
one module per stage, named after it.

deploys/<stage>.py runs one; deploys/full.py runs them all (``full``). Another deploy
repository can call them too: ``from pyinfra_vllm.stages.sysctl import sysctl``.
"""

# apt-get update before installing a Debian package, unless the package lists are newer
# than this (pyinfra's apt.update cache_time, Ansible's cache_valid_time): a fresh host
# refreshes them once per run, not once per stage that installs a package. Not for a
# package from an apt source the same run adds (the driver's): that one always refreshes.
APT_LISTS_MAX_AGE_S = 3600
