"""`rlmill serve` and `rlmill feedback ...`: an OpenAI-compatible API over the promoted model, and
what users say about its answers, from the broker into storage and into training rows.

    rlmill serve                                            # the built-in model on 127.0.0.1:8000
    rlmill serve --model arith --root s3://bucket/rl --engine vllm --port 8000 --redis redis://127.0.0.1:6379/0
    rlmill serve --model arith --root s3://bucket/rl --watch-s 5 --event-wait-ms 250   # the defaults
    rlmill feedback consume --root s3://bucket/rl --redis redis://127.0.0.1:6379/0 [--follow]
    rlmill feedback dataset --root s3://bucket/rl --model arith --out s3://bucket/data/arith-feedback.parquet

The work is gpu_jobs/serve/; this module parses, checks what a user can get wrong (a model not
registered, a port in use, the broker not reachable, a negative wait: one `rlmill: ...` line each),
and starts it. While it serves, models/<name>/CURRENT is read every --watch-s seconds and a newly
promoted version is swapped in (gpu_jobs/serve/swap.py); an answer goes out once its event is in
the broker, or after --event-wait-ms with the event still queued (gpu_jobs/serve/broker.py).
models/<name>/CANARY (storage/canary.py) is read at start and at each poll: while a canary runs, its
candidate is loaded beside CURRENT and the record's share of users (by `user`, else `session_id`;
requests with neither go to CURRENT) is answered by it, the same users on every server and restart.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from flows.reporting import UserError

__all__ = ["add_serve_parsers"]

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
# Kills `rlmill feedback consume` between a segment's commit and its XACK (tests/serve).
FAILPOINT_AFTER_COMMIT = "feedback:after-commit"


def add_serve_parsers(sub) -> None:
    """`rlmill serve` and `rlmill feedback consume|dataset` under the command parsers `sub`."""
    serve = sub.add_parser("serve", help="an OpenAI-compatible API over the promoted model (or the built-in one)",
                           description="Serve /v1/chat/completions, /v1/completions, /v1/models and /v1/feedback.")
    serve.add_argument("--model", default=None, help="registered model name (models/<name>/CURRENT under --root); "
                                                     "default: the built-in model")
    serve.add_argument("--root", default=None, help="storage root the model is registered under (folder or s3://)")
    serve.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="rollout engine (default hf)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--redis", default=DEFAULT_REDIS, help=f"event broker URL, or 'none' (default {DEFAULT_REDIS})")
    serve.add_argument("--retention-hours", type=float, default=24.0, help="feedback is taken this long after an answer")
    serve.add_argument("--max-batch", type=int, default=16, help="requests per generate call at most")
    serve.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long to collect a batch")
    serve.add_argument("--queue-size", type=int, default=10_000, help="events held while the broker is slow or down")
    serve.add_argument("--event-wait-ms", type=float, default=250.0,
                       help="how long an answer waits for its event to reach the broker before it goes out anyway "
                            "(the event stays queued, counted as buffered); 0 = never wait (default 250)")
    serve.add_argument("--watch-s", type=float, default=5.0,
                       help="seconds between reads of models/<name>/CURRENT and CANARY: when CURRENT moves, the new "
                            "version is loaded and swapped in without cutting a request; when a canary starts or "
                            "ends, its candidate is loaded beside it or retired; 0 = off (CANARY is still read once "
                            "at start; default 5; the built-in model has nothing to watch)")
    serve.set_defaults(fn=cmd_serve)
    feedback = sub.add_parser("feedback", help="feedback: consume the event stream into storage, build a dataset")
    fsub = feedback.add_subparsers(dest="feedback_command", required=True, metavar="command")
    consume = fsub.add_parser("consume", help="stream -> Parquet segments under <root>/feedback/, acked after commit")
    consume.add_argument("--root", required=True, help="storage root (folder or s3://)")
    consume.add_argument("--redis", default=DEFAULT_REDIS, help=f"event broker URL (default {DEFAULT_REDIS})")
    consume.add_argument("--consumer", default="consumer-1", help="this consumer's name in the consumer group")
    consume.add_argument("--follow", action="store_true", help="keep reading (default: drain what is there, exit)")
    consume.add_argument("--linger-ms", type=float, default=1000.0,
                         help="with --follow: how long a batch waits for more events before its commit (default 1000)")
    consume.set_defaults(fn=cmd_feedback_consume)
    dataset = fsub.add_parser("dataset", help="answers joined with their feedback as a verl-format Parquet file")
    dataset.add_argument("--root", required=True)
    dataset.add_argument("--model", required=True)
    dataset.add_argument("--out", required=True, help="the .parquet file to write (any storage URL)")
    dataset.set_defaults(fn=cmd_feedback_dataset)


def _check_port(host: str, port: int) -> None:
    with socket.socket() as s:
        # As uvicorn binds: with SO_REUSEADDR a killed server's TIME_WAIT connections do not make
        # its restart refuse its own port (~60 s), while a live listener still does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}): stop what uses it or pass "
                            "--port with a free one") from None


def _publisher(url: str, queue_size: int):
    if url.lower() == "none":
        print("rlmill: --redis none: answers and feedback are not logged", flush=True)
        return None
    from gpu_jobs.serve.broker import BrokerUnreachable, EventPublisher, connect

    try:
        connect(url)
    except BrokerUnreachable as exc:
        raise UserError(f"{exc}, or --redis none to serve without logging") from None
    return EventPublisher(url, max_queue=queue_size)


def _check_numbers(args) -> None:
    for flag, value in (("--watch-s", args.watch_s), ("--event-wait-ms", args.event_wait_ms),
                        ("--batch-wait-ms", args.batch_wait_ms)):
        if not value >= 0:  # also refuses nan
            raise UserError(f"{flag} {value:g} is negative: give 0 or more seconds/milliseconds")
    for flag, value in (("--max-batch", args.max_batch), ("--queue-size", args.queue_size)):
        if value < 1:
            raise UserError(f"{flag} {value} is below 1: give a positive number")


def cmd_serve(args) -> None:
    _check_numbers(args)
    _check_port(args.host, args.port)
    publisher = _publisher(args.redis, args.queue_size)
    import torch
    import uvicorn

    from gpu_jobs.serve.app import Server, ServeSettings, create_app
    from gpu_jobs.serve.model import ModelNotServable, ModelSource

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    # The batcher thread runs the model's Python generate loop; the event loop and the event
    # publisher each need the GIL for a moment per answer. At Python's default 5 ms switch
    # interval every such hand-off can wait 5 ms (logging measured +37% p50 at 4 clients on the
    # built-in model); 1 ms keeps the hand-offs short.
    sys.setswitchinterval(0.001)
    source = ModelSource(args.model, args.root, backend=args.engine)
    try:
        served = source.load()
    except ModelNotServable as exc:
        if publisher is not None:
            publisher.close(0.1)
        raise UserError(str(exc)) from None
    settings = ServeSettings(retention_hours=args.retention_hours, max_batch=args.max_batch,
                             batch_wait_ms=args.batch_wait_ms, event_wait_ms=args.event_wait_ms,
                             watch_s=args.watch_s)
    server = Server(served, publisher, settings, source=source)
    watch = (f"; watching models/{served.name}/CURRENT every {args.watch_s:g} s" if server.models.watching else "")
    if (canary := server.models.canary) is not None:
        watch += f"; canary {canary.id}: {canary.share:.0%} of users/sessions to version {canary.candidate}"
    print(f"rlmill: serving {served.name} version {served.version} ({args.engine}) on "
          f"http://{args.host}:{args.port}/v1{watch}", flush=True)
    try:
        uvicorn.run(create_app(server), host=args.host, port=args.port, log_level="warning")
    finally:
        server.close()  # closes the engines of the served version and of any still retiring


def _die_after_commit(result) -> None:
    print(f"rlmill: failpoint {FAILPOINT_AFTER_COMMIT}: killed after committing {result.segments}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def cmd_feedback_consume(args) -> None:
    from gpu_jobs.serve.broker import BrokerUnreachable
    from gpu_jobs.serve.consumer import consume

    if not args.linger_ms >= 0:  # NaN too
        raise UserError(f"--linger-ms {args.linger_ms:g} is negative: give the milliseconds a batch may wait, or 0")
    hook = _die_after_commit if os.environ.get("RLMILL_FAILPOINT") == FAILPOINT_AFTER_COMMIT else None
    try:
        r = consume(args.root, args.redis, consumer=args.consumer, follow=args.follow, after_commit=hook,
                    linger_s=args.linger_ms / 1000)
    except BrokerUnreachable as exc:
        raise UserError(str(exc)) from None
    reasons = "".join(f"; {n} {why}" for why, n in sorted(r.reasons.items()))
    print(f"rlmill: {r.read} events read: {r.answers} answers and {r.feedback} feedback committed in "
          f"{len(r.segments)} segment(s), {r.duplicates} duplicate(s) skipped, {r.quarantined} quarantined{reasons}",
          flush=True)


def cmd_feedback_dataset(args) -> None:
    from gpu_jobs.serve.dataset import write_training_dataset
    from storage.errors import InvalidNameError

    try:
        n = write_training_dataset(args.root, args.model, args.out)
    except InvalidNameError as exc:
        raise UserError(str(exc)) from None
    print(f"rlmill: {n} training rows -> {args.out}", flush=True)
    if n == 0:
        print(f"rlmill: no feedback for model {args.model!r} under {args.root}/feedback yet: "
              "run `rlmill feedback consume` first", flush=True)
