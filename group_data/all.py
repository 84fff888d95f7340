"""Fleet-wide settings: the values every host gets unless its group or itself says else.

Only what differs from the defaults in pyinfra_vllm/core/settings.py belongs here; each key is
validated there before any operation runs (docs/settings.md lists every key).
"""

# The seed's engine recipe (two A100 80GB, TP=2, BF16, 128K context) is the default in
# pyinfra_vllm/core/settings.py, so nothing is repeated here. The gateway's API keys are
# required (gateway_open=True serves without one); keep them out of the repository, in a
# file on the operator's machine with one key per line, chmod 600:
#
# api_keys_file = "/home/operator/.config/pyinfra-vllm/api-keys"
#
# Typical site overrides:
#
# pip_index_url = "https://pypi.mirror.example.internal/simple"
# pip_ca_bundle = "/usr/local/share/ca-certificates/corp-root.crt"
# http_proxy = "http://proxy.example.internal:3128"
# metrics_allow = ["127.0.0.1/32", "10.20.0.0/16"]
