"""Audit: read every host's OS, driver, GPUs, MIG, persistence, topology and NVLink
state, judge it against the settings, and write a JSON and a Markdown report.

Changes nothing on any host: it adds no operation, it only reads facts.

    pyinfra inventory.py deploys/audit.py
"""

from pyinfra import host

from deploys.audit_report import record, summarize
from deploys.context import context

ctx = context(host)
record(
    host.name,
    summarize(host.name, ctx.state, ctx.settings),
    report_dir=ctx.settings.audit_report_dir,
)
