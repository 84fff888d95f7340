"""Sandbox hosts: real Debian 12 servers (systemd + sshd in systemd-nspawn) for the e2e tests."""
