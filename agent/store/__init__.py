"""The node-local content-addressed object store and its API routes."""
