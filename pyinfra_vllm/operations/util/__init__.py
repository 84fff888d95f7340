"""Helpers the operations share (as pyinfra.operations.util): no operation here."""
