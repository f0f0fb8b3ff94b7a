"""The worker API as its callers see it: request and response models, the one validation of a
container spec both programs apply, the client the controlplane uses, and exec's framing.

Both programs import it (the agent serves this API, the controlplane calls it); it is built only
on `wire`.
"""

# The release both programs are; a worker reports it when it registers.
__version__ = "0.1.0"
