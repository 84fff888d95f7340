"""Operator-side commands (run on the operator's machine, not on the servers)."""
