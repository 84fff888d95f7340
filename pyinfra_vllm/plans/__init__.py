"""What a host should look like and the verdicts on what it is: pure functions of settings
and facts (flags, units, gateway configuration, environment paths, checks, gates)."""
