"""bench (imported as `bench`, not installed): the benchmarks behind `flywheel bench NAME`; each prints a table
and, as its last line, one JSON object. bench.fixtures holds the synthetic inputs the tests share."""
