"""The online loop's work: serving the promoted model, collecting what users say about its
answers, and the records that turn that feedback into retraining windows and canaries. Its flows
(drain, retrain, decide) are flows/online/; the `rlmill serve|feedback|simulate` commands are
flows/cli_serve.py and flows/cli_simulate.py.

    rlmill serve --model arith --root s3://bucket/rl --redis redis://127.0.0.1:6379/0 --watch-s 5
    rlmill feedback consume --root s3://bucket/rl --redis redis://127.0.0.1:6379/0

Serving:
- app.py: the OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions,
  /v1/models, /v1/feedback, /health, /metrics; protocol.py its request and response shapes,
  streaming.py its server-sent events (detok.py: incremental detokenisation), auth.py and limits.py
  its keys, roles, limits and in-flight caps, http_guard.py the docs pages, Host names and proxies.
- model.py: which model and version to serve (models/<name>/CURRENT, or the built-in model), loaded.
- swap.py: hot swap: CURRENT watched, a new version loaded beside the old one and switched to; a
  request finishes on the version it started on, which its event names; a running canary's
  candidate served beside it to its share of ids.
- batching.py: concurrent requests -> one `engine.generate` call per batch, in one worker thread;
  a request nobody waits for is dropped (never batched, or its call stopped).
- answers.py: ids that carry their time, and the bounded index of recent answers feedback checks;
  recall.py: an answer the server no longer holds, found where it was logged (the stream, else the
  committed feedback log), through a bounded id index and negative cache in its own executor.
Feedback:
- signals.py: what a vote is: the feedback signals (score, thumbs, preference, text), who gave
  one, and the one number a rating is worth -- read by the API, the gate, the dataset and the canary.
- events.py: the answer and feedback events, and the quality gate the consumer applies; wire.py
  a stream entry <-> an event, parsed within bounds (size, nesting, every number); signing.py the
  HMAC serve signs each entry with and the consumer checks.
- broker.py: Redis Streams: a response waits (bounded) until its event is XADDed; a slow or down
  broker never blocks answering: events wait in a bounded queue (counted as buffered), what does
  not fit is dropped, counted and logged.
- consumer.py: the stream -> Parquet segments committed through storage's manifest, acked after;
  ingest.py one batch (gate, dedupe, each feedback's version from its answer, commit); segments.py
  the segments' layout, manifests and the committed-ids index;
  deliveries.py: the consumer group's bookkeeping (dead letters, a vanished consumer's entries
  taken over, trimming, lag, broker outages).
- dataset.py: answers joined with their feedback as verl-format training rows.
- governance.py: forgetting a party (user, session, principal): its request, done and lineage
  records; forget.py: the party's rows rewritten out of segments, training files, the stream and
  its dead letters; retention.py: raw events, quarantine and dead letters older than a set age removed.
- simulate.py: simulated users against a running server (`rlmill simulate`).
Windows and canaries (records under models/<name>/, written create-only with storage's primitives):
- windows.py: which committed feedback a retraining run trained on, each piece exactly once.
- canary.py: a candidate's share of live traffic (by voter, a keyed hash), and the outcome that ended it.
- canary_stats.py: the stated test on the two arms' feedback (Welch, mSPRT).

Importing this package is light: torch and the engines load when a server is built.
"""
