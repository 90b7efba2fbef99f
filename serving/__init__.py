"""agent-flywheel: the vLLM tier, weight publishing, routing, MLflow registry promotion and rollback."""
