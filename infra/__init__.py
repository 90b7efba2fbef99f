"""agent-flywheel: local stack, tiny model, the flywheel command line, demo."""
