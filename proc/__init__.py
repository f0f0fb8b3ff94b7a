"""Process plumbing both programs share and nothing else: structured logs, running until a
signal, glibc's malloc tuning, and the check for a program's optional packages.

It imports only the standard library and trio, so `wire`, `workerapi`, `agent` and `control`
may all build on it.
"""
