"""agent-flywheel: episodes from the lake, outcome rewards, LLM judge, PARL shaping."""
