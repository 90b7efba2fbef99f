"""agent-flywheel benchmarks: each prints a table and, as its last line, one JSON object."""
