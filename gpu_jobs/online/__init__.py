"""Serving the promoted model and collecting what users say about its answers.

    rlmill serve --model arith --root s3://bucket/rl --redis redis://127.0.0.1:6379/0 --watch-s 5
    rlmill feedback consume --root s3://bucket/rl --redis redis://127.0.0.1:6379/0

- app.py: the OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions,
  /v1/models, /v1/feedback, /health, /metrics.
- model.py: which model and version to serve (models/<name>/CURRENT, or the built-in model), loaded.
- swap.py: hot swap: CURRENT watched, a new version loaded beside the old one and switched to; a
  request finishes on the version it started on, which its event names.
- batching.py: concurrent requests -> one `engine.generate` call per batch, in one worker thread.
- answers.py: ids that carry their time, and the bounded index of recent answers feedback checks.
- events.py: the answer and feedback events, and the quality gate the consumer applies.
- broker.py: Redis Streams: a response waits (bounded) until its event is XADDed; a slow or down
  broker never blocks answering: events wait in a bounded queue (counted as buffered), what does
  not fit is dropped, counted and logged.
- consumer.py: the stream -> Parquet segments committed through storage's manifest, acked after.
- dataset.py: answers joined with their feedback as verl-format training rows.

Importing this package is light: torch and the engines load when a server is built.
"""
