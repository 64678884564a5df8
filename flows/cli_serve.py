"""`rlmill serve` and `rlmill feedback ...`: an OpenAI-compatible API over the promoted model, and
what users say about its answers, from the broker into storage and into training rows.

    rlmill serve                                            # the built-in model on 127.0.0.1:8000
    rlmill serve --model arith --root s3://bucket/rl --engine vllm --port 8000 --redis redis://127.0.0.1:6379/0
    rlmill serve --model arith --root s3://bucket/rl --watch-s 5 --event-wait-ms 250   # the defaults
    rlmill serve --host 0.0.0.0 --api-keys keys.yaml --rate-limit 5 --feedback-rate-limit 1   # see auth.py
    rlmill feedback consume --root s3://bucket/rl --redis redis://127.0.0.1:6379/0 [--follow]
    rlmill feedback dataset --root s3://bucket/rl --model arith --out s3://bucket/data/arith-feedback.parquet

The work is gpu_jobs/online/; this module parses, checks what a user can get wrong (a model not
registered, a port in use, the broker not reachable, a negative wait: one `rlmill: ...` line each),
and starts it. While it serves, models/<name>/CURRENT is read every --watch-s seconds and a newly
promoted version is swapped in (gpu_jobs/online/swap.py); an answer goes out once its event is in
the broker, or after --event-wait-ms with the event still queued (gpu_jobs/online/broker.py).
models/<name>/CANARY (gpu_jobs/online/canary.py) is read at start and at each poll: while a canary runs, its
candidate is loaded beside CURRENT and the record's share of users (by `user`, else `session_id`;
requests with neither go to CURRENT) is answered by it, the same users on every server and restart.

Keys (--api-keys FILE or $RLMILL_API_KEYS; format in gpu_jobs/online/auth.py) are required to
listen on anything but a loopback address. The limits' flags (--max-body-bytes, --rate-limit, ...)
are generated from gpu_jobs.online.limits.ServeLimits, their one declaration. On SIGTERM `serve`
stops accepting connections, finishes the requests in flight, sends their events to the broker
(all within --grace-s) and exits 0; `feedback consume --follow` on SIGTERM or SIGINT commits and
acknowledges the batch in hand and exits 0 (a second signal ends either at once). Ctrl-C (SIGINT)
to `serve` drains the same way and exits 130.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import threading
import time

from flows.user_errors import UserError
from gpu_jobs.online.broker import DEFAULT_REDIS

__all__ = ["add_serve_parsers"]

KEYS_ENV = "RLMILL_API_KEYS"
# Kills `rlmill feedback consume` between a segment's commit and its XACK (tests/serve).
FAILPOINT_AFTER_COMMIT = "feedback:after-commit"


def add_serve_parsers(sub) -> None:
    """`rlmill serve` and `rlmill feedback consume|dataset` under the command parsers `sub`."""
    serve = sub.add_parser("serve", help="an OpenAI-compatible API over the promoted model (or the built-in one)",
                           description="Serve /v1/chat/completions, /v1/completions, /v1/models and /v1/feedback.")
    serve.add_argument("--model", default=None, help="registered model name (models/<name>/CURRENT under --root); "
                                                     "default: the built-in model")
    serve.add_argument("--root", default=None, help="storage root the model is registered under (folder or s3://)")
    serve.add_argument("--engine", default="hf",
                       help="rollout engine: a name registered in gpu_jobs.rollout.ROLLOUT_ENGINES (default hf; built in: "
                            "hf, vllm)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1); any non-loopback address needs --api-keys")
    serve.add_argument("--api-keys", default=os.environ.get(KEYS_ENV) or None, metavar="FILE",
                       help=f"YAML/JSON file mapping each API key to {{principal, roles}} (roles: query, feedback, "
                            f"metrics); callers send `Authorization: Bearer <key>`; default ${KEYS_ENV}, else no keys "
                            "(loopback only)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
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
    _add_limit_flags(serve)
    _add_http_flags(serve)
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
    from flows.cli_forget import add_governance_parsers

    add_governance_parsers(fsub)  # forget, retain


def _add_limit_flags(parser) -> None:
    """One flag per ServeLimits field (--max-body-bytes, ...), its help and default from there."""
    from gpu_jobs.online.limits import ServeLimits  # stdlib only: cheap at parser build

    group = parser.add_argument_group("limits (per request and per caller)")
    for f in dataclasses.fields(ServeLimits):
        shown = f.metadata.get("shown") or (f"{f.default:g}" if isinstance(f.default, float) else f"{f.default}")
        group.add_argument("--" + f.name.replace("_", "-"), dest=f"limit_{f.name}",
                           type=f.metadata.get("type", type(f.default)), default=f.default, metavar="N",
                           help=f"{f.metadata['help']} (default {shown})")


def _add_http_flags(parser) -> None:
    """--docs, --allowed-hosts, --trusted-proxies: gpu_jobs.online.http_guard.HttpGuard's fields."""
    from gpu_jobs.online.http_guard import HttpGuard  # stdlib only: cheap at parser build

    group = parser.add_argument_group("HTTP exposure (docs pages, Host names, proxies)")
    for f in dataclasses.fields(HttpGuard):
        flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"]
        if f.default is False:
            group.add_argument(flag, dest=f"http_{f.name}", action="store_true", help=text)
        else:
            group.add_argument(flag, dest=f"http_{f.name}", default=None, metavar="LIST", help=text)


def _http(args: argparse.Namespace):
    from gpu_jobs.online.http_guard import HttpGuard

    return HttpGuard.for_host(args.host, _is_loopback(args.host), args.http_docs, args.http_allowed_hosts,
                              args.http_trusted_proxies)


def _limits(args: argparse.Namespace):
    from gpu_jobs.online.limits import ServeLimits

    try:
        return ServeLimits(**{f.name: getattr(args, f"limit_{f.name}") for f in dataclasses.fields(ServeLimits)})
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _keys(args: argparse.Namespace):
    """The API keys of --api-keys / $RLMILL_API_KEYS, or None; refuses a non-loopback --host without them."""
    if args.api_keys is None:
        if not _is_loopback(args.host):
            raise UserError(f"--host {args.host} is reachable from other machines and no API keys are set: pass "
                            f"--api-keys FILE (or set {KEYS_ENV}; format: `rlmill serve --help`), or listen on "
                            "127.0.0.1")
        return None
    from gpu_jobs.online.auth import ApiKeys, ApiKeysError

    try:
        return ApiKeys.from_file(args.api_keys)
    except ApiKeysError as exc:
        raise UserError(str(exc)) from None


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
    from gpu_jobs.online.broker import BrokerUnreachable, EventPublisher, connect, url_password_problem

    if (problem := url_password_problem(url, "--redis")) is not None:
        raise UserError(problem)
    key = _event_key("serve")
    try:
        connect(url)
    except BrokerUnreachable as exc:
        raise UserError(f"{exc}, or --redis none to serve without logging") from None
    return EventPublisher(url, max_queue=queue_size, event_key=key)


def _event_key(who: str) -> bytes | None:
    """The key serve signs events with and the consumer checks them with (gpu_jobs/online/signing.py),
    or None: then one warning line says they are unsigned and how to set it."""
    from gpu_jobs.online.signing import UNSIGNED_WARNING, SigningKeyError, event_key

    try:
        key = event_key()
    except SigningKeyError as exc:
        raise UserError(str(exc)) from None
    if key is None:
        print(f"rlmill: warning ({who}): {UNSIGNED_WARNING}", file=sys.stderr, flush=True)
    return key


def _check_numbers(args) -> None:
    for flag, value in (("--watch-s", args.watch_s), ("--event-wait-ms", args.event_wait_ms),
                        ("--batch-wait-ms", args.batch_wait_ms)):
        if not value >= 0:  # also refuses nan
            raise UserError(f"{flag} {value:g} is negative: give 0 or more seconds/milliseconds")
    for flag, value in (("--max-batch", args.max_batch), ("--queue-size", args.queue_size)):
        if value < 1:
            raise UserError(f"{flag} {value} is below 1: give a positive number")


def _check_engine(name: str) -> None:
    # The registry, not a list here: an engine a user registers is servable with no edit of the CLI.
    from gpu_jobs.registry import UnknownNameError
    from gpu_jobs.rollout import ROLLOUT_ENGINES  # the package registers the built-in engines

    try:
        ROLLOUT_ENGINES[name]
    except UnknownNameError as exc:
        raise UserError(f"--engine: {exc}") from None


def cmd_serve(args) -> None:
    _check_numbers(args)
    _check_engine(args.engine)
    limits = _limits(args)
    keys = _keys(args)
    _check_port(args.host, args.port)
    publisher = _publisher(args.redis, args.queue_size)
    import torch

    from gpu_jobs.online.app import Server, ServeSettings, create_app
    from gpu_jobs.online.model import ModelNotServable, ModelSource

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
                             watch_s=args.watch_s, limits=limits, http=_http(args))
    from gpu_jobs.online.recall import AnswerRecall

    recall = AnswerRecall(None if publisher is None else args.redis, args.root, served.name,
                          event_key=None if publisher is None else publisher.event_key)
    server = Server(served, publisher, settings, source=source, keys=keys, recall=recall)
    watch = (f"; watching models/{served.name}/CURRENT every {args.watch_s:g} s" if server.models.watching else "")
    if (canary := server.models.canary) is not None:
        watch += f"; canary {canary.id}: {canary.share:.0%} of users/sessions to version {canary.candidate}"
    auth = f"; {len(keys)} API key(s) for {', '.join(keys.principals())}" if keys is not None else "; no API keys"
    print(f"rlmill: serving {served.name} version {served.version} ({args.engine}) on "
          f"http://{args.host}:{args.port}/v1{watch}{auth}", flush=True)
    uv = _drained_uvicorn(create_app(server), args.host, args.port, limits.grace_s, settings.http.uvicorn_kwargs())
    try:
        uv.run()
    finally:
        # the engines close once their batchers are done; then the events of every answered
        # request go to the broker within what is left of the grace
        left = limits.grace_s - (time.monotonic() - uv.signalled_at) if uv.signalled_at else 5.0
        server.close(events_timeout_s=max(1.0, left))
    if uv.stopped_by is not None:
        stats = publisher.stats() if publisher is not None else {}
        print(f"rlmill: {uv.stopped_by.name}: drained and stopped ({server.counts['answers']} answers; "
              f"{stats.get('published', 0)} events sent, {stats.get('dropped', 0)} dropped)", flush=True)
        if uv.stopped_by == signal.SIGINT:
            sys.exit(130)  # Ctrl-C's conventional status; SIGTERM, a requested stop, is 0


def _drained_uvicorn(app, host: str, port: int, grace_s: float, http: dict | None = None):
    """A uvicorn server whose SIGTERM and SIGINT drain: stop accepting, finish the requests in
    flight (cut after `grace_s`, or at a second signal), and return (uvicorn itself re-raises
    the signal after its shutdown: -15 for SIGTERM, a KeyboardInterrupt traceback for Ctrl-C).
    `http`: HttpGuard.uvicorn_kwargs() (proxy headers believed only from trusted proxies; None:
    never believed)."""
    import uvicorn

    class Drained(uvicorn.Server):
        signalled_at: float | None = None
        stopped_by: signal.Signals | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit:  # a second signal: stop waiting for the requests
                self.force_exit = True
            self.should_exit, self.signalled_at = True, self.signalled_at or time.monotonic()
            self.stopped_by = self.stopped_by or signal.Signals(sig)

    return Drained(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                  timeout_graceful_shutdown=grace_s, **(http or {"proxy_headers": False})))


def _die_after_commit(result) -> None:
    print(f"rlmill: failpoint {FAILPOINT_AFTER_COMMIT}: killed after committing {result.segments}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def cmd_feedback_consume(args) -> None:
    from gpu_jobs.online.broker import BrokerUnreachable, url_password_problem
    from gpu_jobs.online.consumer import consume

    if not args.linger_ms >= 0:  # NaN too
        raise UserError(f"--linger-ms {args.linger_ms:g} is negative: give the milliseconds a batch may wait, or 0")
    if (problem := url_password_problem(args.redis, "--redis")) is not None:
        raise UserError(problem)
    key = _event_key("feedback consume")
    hook = _die_after_commit if os.environ.get("RLMILL_FAILPOINT") == FAILPOINT_AFTER_COMMIT else None
    stop, signalled = threading.Event(), []

    def on_signal(sig, frame) -> None:  # the batch in hand is committed and acked, then consume returns
        signalled.append(signal.Signals(sig).name)
        stop.set()
        for s in (signal.SIGTERM, signal.SIGINT):  # a second signal ends the process at once
            signal.signal(s, signal.SIG_DFL)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        r = consume(args.root, args.redis, consumer=args.consumer, follow=args.follow, after_commit=hook,
                    linger_s=args.linger_ms / 1000, stop=stop, event_key=key)
    except BrokerUnreachable as exc:
        raise UserError(str(exc)) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signalled:
        print(f"rlmill: {signalled[0]}: stopped after committing and acknowledging what was read", flush=True)
    reasons = "".join(f"; {n} {why}" for why, n in sorted(r.reasons.items()))
    print(f"rlmill: {r.read} events read: {r.answers} answers and {r.feedback} feedback committed in "
          f"{len(r.segments)} segment(s), {r.duplicates} duplicate(s) skipped, {r.quarantined} quarantined{reasons}",
          flush=True)


def cmd_feedback_dataset(args) -> None:
    from gpu_jobs.online.dataset import write_training_dataset
    from storage.errors import InvalidNameError

    try:
        n = write_training_dataset(args.root, args.model, args.out)
    except InvalidNameError as exc:
        raise UserError(str(exc)) from None
    print(f"rlmill: {n} training rows -> {args.out}", flush=True)
    if n == 0:
        print(f"rlmill: no feedback for model {args.model!r} under {args.root}/feedback yet: "
              "run `rlmill feedback consume` first", flush=True)
