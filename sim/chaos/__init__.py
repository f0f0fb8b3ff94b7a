"""The seeded fault campaign over the loopback installation."""
