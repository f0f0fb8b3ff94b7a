"""Tasks: their records, the scheduler and the dispatcher that watches each task."""
