"""flywheel.serving: the vLLM tier (publishing weights, the admin client), the router and the capture proxy in
front of it, the MLflow registry, and the promotion gate."""
