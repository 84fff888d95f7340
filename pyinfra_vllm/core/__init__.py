"""The core everything stands on: settings, stacks as data, templates, version numbers,
the names shared with the host scripts, secrets and locks on the operator's machine, and
text from hosts made safe to show."""
