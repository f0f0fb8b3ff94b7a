"""The `levers9` command line: one module per command group and its client."""
