"""One run of the suite: the context per host, its one read of the host, the audit's reports."""
