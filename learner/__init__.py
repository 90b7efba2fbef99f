"""flywheel.learner: the continuous learner (off-policy policy gradient on the logged tokens), its checkpoints
and the hand-off of each new version to serving."""
