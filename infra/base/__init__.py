"""The base layer every process imports: typed config, defaults, heartbeats, tracking, atomic
writes, the stop signal and version names. It imports nothing else of the project."""
