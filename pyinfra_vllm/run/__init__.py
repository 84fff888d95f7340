"""One run of the suite: the context per host, its one read of the host, and the shape of
every stage (``@stage``)."""
