"""The `levers9-agent` program: settings, the direct listener, the tunnel, registration,
the self-check and the command line. The only part of the agent that wires the others.
"""
