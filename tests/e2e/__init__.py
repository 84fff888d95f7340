"""End-to-end tests against sandbox hosts (see sandbox/README.md)."""
