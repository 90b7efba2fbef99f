"""agent-flywheel: the continuous learner (off-policy policy gradient on logged tokens)."""
