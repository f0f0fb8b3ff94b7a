"""Kubernetes: the one adapter around the official client, pool blocks, the pure planner,
the reconcile loop, `cluster join` and joined pools.
"""
