"""Benchmarks of levers9.

Each benchmark is a module run as ``python -m bench.<name> [--quick] --json FILE``: it prints a
table for people and writes ``{"figures": ..., "ratios": ..., "anchors": ..., "machine": ...}``
(see ``bench.report``). A figure alone says little about the code and much about the machine, so
every benchmark measures its anchors (direct TCP, OpenSSH, ...) in the same run and reports
ratios, ours divided by the anchor's. Timing goals live here, never in ``tests/``.
"""
