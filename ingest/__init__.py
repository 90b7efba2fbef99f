"""agent-flywheel: the sidecar SDK, capture proxy and lake writer (the ingest side of the loop)."""
