"""Containers: the manager that owns each from pull to clean-up, its routes, images and
layers, the rootfs, the OCI spec, runc and its shim, networking and exec sessions.
"""
