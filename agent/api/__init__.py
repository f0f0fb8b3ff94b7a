"""The worker API as its callers see it: request and response models, the client the
controlplane uses, and exec's framing. Built only on `agent.wire`.
"""
