"""The demo's simulated production side (tasks, agent, outcome sources, warm start, tiny base model)
and the one-command closed loop with its report. Nothing in the pipeline imports it."""
