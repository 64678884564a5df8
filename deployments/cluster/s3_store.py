"""The s3 host's S3 server: moto, made to keep its objects across a restart with a journal on the
host's disk, standing in for the persistent S3 a real cluster runs (MinIO, Ceph, a cloud bucket).

    python -m deployments.cluster.s3_store --host 10.231.0.11 --port 5000 --journal /tmp/s3/journal.jsonl

moto keeps objects in memory only. Its recorder appends every request it receives (method, URL,
headers, body) to a file before handling it; at boot this server replays that file into a fresh
moto before it listens, so a restarted host serves what the last one had stored. A request that
was journaled but not answered when the host died is replayed too: the client saw a failure and
retries, and rlmill's writes (write new, commit with a manifest last) are safe to repeat. A torn
last line (the host killed mid-append) is dropped. Reads are journaled by moto as well and
replayed with the rest (they change nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from base64 import b64decode
from urllib.parse import parse_qsl, urlencode, urlsplit

UPLOAD_ID = re.compile(r"<UploadId>([^<]+)</UploadId>")


def entries(path: str) -> list[dict]:
    """The journal's requests in order; a last line cut off mid-write is dropped, any other bad line refused."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 2 or (i == len(lines) - 2 and lines[-1] != ""):
                raise SystemExit(f"rlmill s3_store: journal {path} line {i + 1} is not JSON (not a torn last line): "
                                 "move the journal aside to start empty")
    return out


def cut_torn_tail(path: str) -> None:
    """Drop a last line cut off mid-write from the file itself, so the next entry starts on a line of its own."""
    if not os.path.exists(path):
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


def replay(app, journal: list[dict]) -> tuple[int, int]:
    """Send the journal's requests to `app` (moto's WSGI app) in order; returns (sent, failed).

    moto names a multipart upload with a new random id, so the ids the journal's part and complete
    requests carry are mapped to the ones the replayed initiations got, in order per object."""
    from werkzeug.test import Client

    client, sent, failed = Client(app), 0, 0
    new_ids: dict[str, list[str]] = {}  # object path -> ids of replayed initiations not yet matched
    ids: dict[str, str] = {}  # journaled upload id -> replayed one
    for entry in journal:
        url = urlsplit(entry["url"])
        query = parse_qsl(url.query, keep_blank_values=True)
        old = dict(query).get("uploadId")
        if old is not None and old not in ids and new_ids.get(url.path):
            ids[old] = new_ids[url.path].pop(0)
        query = [(k, ids.get(v, v) if k == "uploadId" else v) for k, v in query]
        body = entry.get("body") or b""
        if entry.get("body_encoded"):
            body = b64decode(body)
        headers = {k: v for k, v in entry.get("headers", {}).items() if k.lower() != "transfer-encoding"}
        try:
            response = client.open(url.path, method=entry["method"], query_string=urlencode(query), headers=headers,
                                   data=body, base_url=f"{url.scheme}://{url.netloc}")
            if entry["method"] == "POST" and "uploads" in dict(query) and response.status_code == 200:
                new_ids.setdefault(url.path, []).append(UPLOAD_ID.search(response.get_data(as_text=True)).group(1))
            sent += 1
        except Exception:  # what failed the first time (an upload id long gone) fails again: go on
            failed += 1
    return sent, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.cluster.s3_store", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--journal", required=True, help="the journal file (on the host's own disk)")
    args = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.journal)), exist_ok=True)
    journal = entries(args.journal)
    cut_torn_tail(args.journal)
    # Before moto is imported: its recorder reads these once.
    os.environ.update({"MOTO_RECORDER_FILEPATH": args.journal, "MOTO_ENABLE_RECORDING": "true",
                       "MOTO_PORT": str(args.port)})
    from moto.moto_api import recorder
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    # moto appends an entry in two writes: one at a time, or two threads' entries interleave.
    lock, record = threading.Lock(), recorder._record_request

    def record_one_at_a_time(*a, **kw):
        with lock:
            record(*a, **kw)

    recorder._record_request = record_one_at_a_time
    app = DomainDispatcherApplication(create_backend_app)
    recorder.stop_recording()  # the replay is not journaled again
    sent, failed = replay(app, journal)
    recorder.start_recording()
    print(f"rlmill s3_store: replayed {sent} journaled requests from {args.journal} ({failed} failed)", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_simple(args.host, args.port, app, threaded=True, request_handler=MotoRequestHandler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
