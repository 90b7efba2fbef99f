"""flywheel.ingest: the event schema, the in-process SDK (SessionLogger, OutcomeReporter) with its spool,
and the lake: the exactly-once Kafka -> Parquet writer and the lake's file layout."""
