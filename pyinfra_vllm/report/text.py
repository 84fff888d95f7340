"""Text that comes from hosts, made safe where the audit shows it: on a terminal and in
the Markdown report.

The sanitizers themselves are in pyinfra_vllm/core/host_text.py, below the plans, whose
benchmark report uses them too; the audit's modules take them from here. The HTML report
escapes ``printable`` text with ``html.escape`` (pyinfra_vllm/report/html_page.py).
"""

from __future__ import annotations

from pyinfra_vllm.core.host_text import markdown_text, printable, printable_keeping_colours

__all__ = ["markdown_text", "printable", "printable_keeping_colours"]
