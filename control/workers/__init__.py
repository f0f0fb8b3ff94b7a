"""Workers as the controlplane knows them: the registry of connected workers
(`control.workers.registry`), the directory of which replica holds which worker when several
replicas run (`directory`), and the one hop that forwards a request to that replica (`forward`).
"""
