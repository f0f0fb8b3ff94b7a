"""Cards: the claim from NVML and the kubelet, the allocator and ledger, and the OCI/CDI
edits that give a container its cards.
"""
