"""The peer of `flywheel bench ingest --vs quixstreams`: a Quix Streams application that lands the project's
events as Parquet with the library's own file sink, written as its documentation shows.

It runs in its own virtual environment (bench/quix/requirements.txt: quixstreams, confluent-kafka, boto3; the
bench builds it under var/venvs/), never in the project's: the library pins confluent-kafka, pydantic and protobuf
ranges that are not the project's business. It imports `flywheel.ingest.wire` (standard library only) from the
checkout through PYTHONPATH, as a Quix user would import the SDK's light base package to read its records.

    python bench/quix/app.py --bootstrap HOST:PORT --topic T --group G --out DIR|s3://BUCKET/PREFIX
                             [--events N] [--report FILE] [--commit-interval 5.0] [--numpy]

* Source: `app.topic(T, value_deserializer="bytes")`, one Application, `auto_offset_reset="earliest"`, the
  default at-least-once processing guarantee and the default checkpoint (commit_interval 5 s).
* Processing: one `sdf.apply` that decodes the record (JSON or v3 packed) and turns each packed field (token ids,
  logprobs) into a typed list, so Parquet holds list columns, not strings. With --numpy a field becomes a numpy
  array (Arrow infers list<int32> / list<float> from it, the lake's own column types) instead of a Python list
  (list<int64> / list<double>): the bench measures both and reports the faster as the peer.
* Sink: `LocalFileSink(directory, format=ParquetFormat(compression="zstd"))` (zstd as the lake writes) or
  `S3FileSink(bucket, directory, ...)` with the endpoint and keys of the AWS_* environment. The sink batches each
  partition between checkpoints and writes one file per partition per checkpoint, named by its first offset;
  offsets are committed after the files are written (at least once).

With --events N the application stops once its sink has written N rows, and (with --report) writes a JSON line:
the wall and CPU seconds (this process, all threads: librdkafka's too) from its first record to that write.
Without --events it runs until SIGTERM (the bench's visibility and kill runs).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import orjson
import pybase64

from flywheel.ingest import schema, wire


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--out", required=True, help="a local folder, or s3://BUCKET/PREFIX")
    parser.add_argument("--events", type=int, default=0, help="stop after the sink wrote this many rows (0: run on)")
    parser.add_argument("--report", default=None, help="where to write the timing JSON line")
    parser.add_argument("--commit-interval", type=float, default=5.0, help="the library's default checkpoint")
    parser.add_argument("--numpy", action="store_true", help="packed fields as numpy arrays (typed like the lake)")
    parser.add_argument("--state-dir", default=None)
    parser.add_argument("--session-timeout-ms", type=int, default=None, help="the consumer group session timeout")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    from quixstreams import Application
    from quixstreams.sinks.community.file.formats import ParquetFormat

    packed = dict(schema.PACKED_FIELDS)  # field name -> "ints" | "floats"
    marks: dict[str, float] = {}
    written = [0]

    if args.numpy:
        import numpy as np

        dtypes = {"ints": np.int32, "floats": np.float32}

        def typed(view: memoryview, kind: str) -> Any:
            return np.frombuffer(view, dtype=dtypes[kind])
    else:
        def typed(view: memoryview, kind: str) -> Any:
            return view.tolist()

    def decode(value: bytes) -> dict[str, Any]:
        if not marks:
            marks["wall"], marks["cpu"] = time.perf_counter(), time.process_time()
        record = wire.decode(value, orjson.loads, pybase64.b64decode)
        for name, kind in packed.items():
            field = record.get(name)
            if isinstance(field, memoryview):
                record[name] = typed(field, kind)
        return record

    app = Application(broker_address=args.bootstrap, consumer_group=args.group, auto_offset_reset="earliest",
                      commit_interval=args.commit_interval, state_dir=args.state_dir, loglevel="WARNING",
                      consumer_extra_config={"session.timeout.ms": args.session_timeout_ms}
                      if args.session_timeout_ms else None)

    def counted(sink_cls: type) -> type:
        class Counted(sink_cls):  # type: ignore[misc, valid-type]
            """The library's sink, counting the rows it wrote: the bench's stop condition, not a change of it."""

            def write(self, batch: Any) -> None:
                super().write(batch)
                written[0] += batch.size
                if args.events and written[0] >= args.events and "done" not in marks:
                    marks["done"], marks["done_cpu"] = time.perf_counter(), time.process_time()
                    app.stop()

        return Counted

    fmt = ParquetFormat(compression="zstd")
    if args.out.startswith("s3://"):
        from quixstreams.sinks.community.file.s3 import S3FileSink

        bucket, _, prefix = args.out[len("s3://"):].partition("/")
        sink = counted(S3FileSink)(bucket=bucket, directory=prefix, format=fmt,
                                   endpoint_url=os.environ.get("AWS_ENDPOINT_URL"),
                                   aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID"),
                                   aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY"),
                                   region_name=os.environ.get("AWS_REGION", "us-east-1"))
    else:
        from quixstreams.sinks.community.file.local import LocalFileSink

        sink = counted(LocalFileSink)(directory=args.out, format=fmt)
    topic = app.topic(args.topic, value_deserializer="bytes")
    sdf = app.dataframe(topic)
    sdf = sdf.apply(decode)
    sdf.sink(sink)
    app.run()
    if args.report and "done" in marks:
        with open(args.report, "w") as f:
            f.write(json.dumps({"wall_s": marks["done"] - marks["wall"], "cpu_s": marks["done_cpu"] - marks["cpu"],
                                "rows": written[0]}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
