"""Kubernetes: the one adapter around the official client, pool blocks, the pure planner,
the reconcile loop, the pools' runner (every pool's loop under its leader election, and the
joined pools, in one owner), `cluster join` and joined pools.
"""
