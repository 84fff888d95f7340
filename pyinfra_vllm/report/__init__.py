"""The audit's reports: one JSON file for machines, one Markdown and one HTML file for
people, and a short table on the terminal.

``verdicts`` builds each host's entry (the checks, the GPUs' health, the model's plan, the
hand changes) and ``drift`` what the deploy files planned before the audit would change;
``summary`` says each host in a few words (the terminal table), ``markdown`` and
``html_page`` render the files, ``changes`` compares them with the previous audit,
``store`` keeps the report sets in the reports' directory, and ``runs`` gathers each
run's hosts and writes the files once.

What hosts report is text of their choosing: the Markdown report escapes every value of
it, the HTML report escapes it with ``html.escape``, and the terminal table strips its
control characters (``text``); the JSON report keeps it exact.
"""
