"""The `leap` command line: thin wrappers that call into leap_core, serving, registry and flows."""
