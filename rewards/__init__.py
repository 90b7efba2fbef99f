"""flywheel.rewards: the episode builder (sessions + matured outcomes -> rewarded episode rows), outcome reward
rules, the LLM judge and PARL shaping."""
