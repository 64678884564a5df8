"""benchmarks/bench_serve.py's code path in seconds: the closed-loop client, feedback-to-committed
latency and the audit against a real redis-server and the built-in model served in a thread
(the benchmark itself runs `rlmill serve` processes: `python -m benchmarks.bench_serve`)."""

from __future__ import annotations

import argparse
import threading

import pytest

from benchmarks import bench_serve
from benchmarks.chaos.serve_stack import RedisServer, audit_answers, stream_drained, wait_until


def test_percentile_is_nearest_rank():
    assert bench_serve.percentile([0.3, 0.1, 0.2], 0.5) == 0.2
    assert bench_serve.percentile([5.0], 0.99) == 5.0
    assert bench_serve.percentile(list(range(1, 101)), 0.99) == 99  # the 99th of 100 values


@pytest.mark.parametrize("argv, named", [(["--concurrency", "1,x"], "--concurrency"), (["--seconds", "0"], "--seconds"),
                                         (["--feedback-load", "-1"], "--feedback-load")])
def test_bad_options_are_refused_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit):
        bench_serve.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in err and "Traceback" not in err, err


def test_load_feedback_latency_and_audit_on_a_real_broker(tmp_path):
    import torch

    from gpu_jobs.online.app import Server
    from gpu_jobs.online.broker import EventPublisher
    from gpu_jobs.online.consumer import consume
    from gpu_jobs.online.model import load_served_model
    from tests.serve.conftest import running

    torch.set_num_threads(1)
    redis = RedisServer(tmp_path).start()
    served = load_served_model(None)
    server = Server(served, EventPublisher(redis.url))
    root = tmp_path / "store"
    stop = threading.Event()

    def consumer() -> None:  # drains what is waiting, again and again, until the test is done
        while not stop.is_set():
            consume(str(root), redis.url)
            stop.wait(0.05)

    worker = threading.Thread(target=consumer, daemon=True)
    try:
        with running(server) as base:
            got = bench_serve.measure(base, concurrency=2, warmup_s=0.2, seconds=1.0, max_tokens=4)
            assert got["latencies"] and got["errors"] == 0 and len(got["ids"]) >= len(got["latencies"])
            worker.start()
            fb, more = bench_serve.feedback_latency(base, root, "builtin", got["ids"], n=5, rate=20, load=1,
                                                    max_tokens=4)
            assert len(fb) == 5 and all(0 <= s < 60 for s in fb), fb  # from each POST to its manifest
            assert more, "the completions made meanwhile are returned for the audit"
            assert server.publisher.flush(30)
            wait_until("the stream committed and acked", lambda: stream_drained(redis.url), 60)
        audit = audit_answers(str(root), got["ids"] + more, dropped=0)
        assert audit.answered == len(set(got["ids"] + more)) and not audit.missing and not audit.duplicated
        args = argparse.Namespace(model="builtin", max_tokens=4, repeats=1, seconds=1.0, warmup=0.2, feedbacks=5,
                                  feedback_rate=20.0, feedback_load=1)
        lat = {(2, "on"): got["latencies"], (2, "off"): [x * 2 for x in got["latencies"]]}
        table = bench_serve.report(args, [2], lat, {(2, "on"): [30.0], (2, "off"): [10.0]},
                                   {(2, "on"): 0, (2, "off"): 0}, fb, audit)
        assert "| 2 | on |" in table and "| 0.500 |" in table  # p50 on/off: half the made-up 'off' latency
        assert bench_serve.ratio_cell(2, 1.0, {(2, "on"): [1.0, 3.0], (2, "off"): [2.0, 2.0]}) == "1.000 (0.50-1.50)"
        assert ">= 20 req/s with logging on: 30.0 (met)" in table and "logging adds <= 10% to p50: worst -50.0% (met)" \
            in table
    finally:
        stop.set()
        worker.join(30)
        server.close()
        served.close()
        redis.stop()
    assert not worker.is_alive(), "the consumer thread did not end within 30 s of the test's end"
