"""Workspace buckets: pure specs and keys, rclone's argv and output, and the supervisor
that owns every FUSE mount.
"""
