"""A real S3-compatible HTTP server on the loopback for tests: moto's server mode behind a small proxy that counts and
breaks things.

`S3Server()` starts moto (`ThreadedMotoServer`) on a free port and, in front of it, a threaded HTTP proxy on another
free port; clients are pointed at the proxy through the platform's standard configuration (`env()`: AWS_ENDPOINT_URL
and dummy AWS_* credentials), exactly as a user points s3fs at MinIO or a regional endpoint. The proxy:

- logs every request (method, object key, Range, status, body bytes sent) with the client's tag, taken from the
  User-Agent's `app/<id>` (botocore sends AWS_SDK_UA_APP_ID there: a rank sets it to tell its requests apart);
- injects faults on requests whose key ends with a suffix, for the next N matching GETs: "slowdown" (HTTP 503 with
  S3's `SlowDown` error, as S3 throttles), "cut" (the headers promise the whole body, half of it is sent, then the
  connection is closed), "slow" (the answer waits 0.2 s).

Wrong bytes are made by overwriting an object with others of the same size (`put`), as a mixed upload would.
"""

from __future__ import annotations

import http.client
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
from moto.server import ThreadedMotoServer

APP = re.compile(r"app/(\S+)")
SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.'
    b"</Message></Error>"
)


@dataclass
class Request:
    method: str
    key: str
    range: str | None
    status: int
    sent: int  # body bytes sent to the client
    client: str | None


@dataclass
class Fault:
    kind: str  # "slowdown" | "cut" | "slow"
    suffix: str
    times: int


@dataclass
class S3Server:
    log: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        host, port = self.moto.get_host_and_port()
        self.upstream = (host, port)
        self.proxy = _QuietServer(("127.0.0.1", 0), _handler(self))
        self.proxy.daemon_threads = True
        self.thread = threading.Thread(target=self.proxy.serve_forever, daemon=True)
        self.thread.start()
        self.endpoint = f"http://127.0.0.1:{self.proxy.server_address[1]}"

    def stop(self) -> None:
        self.proxy.shutdown()
        self.proxy.server_close()
        self.moto.stop()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self) -> dict[str, str]:
        """The standard configuration a client on this machine would have (no credential reaches preshard)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
            "PRESHARD_OBJECT_BACKOFF_S": "0.01",
        }

    # -- direct access (boto3, straight to moto: not logged)

    def client(self):
        host, port = self.upstream
        return boto3.client(
            "s3",
            endpoint_url=f"http://{host}:{port}",
            aws_access_key_id="testing",
            aws_secret_access_key="testing-secret",
            region_name="us-east-1",
        )

    def bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self.client().put_object(Bucket=bucket, Key=key, Body=data)

    def get(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        found = self.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
        return sorted(o["Key"] for o in found)

    # -- faults and the log

    def fail(self, kind: str, suffix: str, times: int = 1) -> None:
        with self._lock:
            self.faults.append(Fault(kind, suffix, times))

    def take_fault(self, method: str, key: str) -> str | None:
        if method != "GET":
            return None
        with self._lock:
            for fault in self.faults:
                if fault.times > 0 and key.endswith(fault.suffix):
                    fault.times -= 1
                    return fault.kind
        return None

    def record(self, request: Request) -> None:
        with self._lock:
            self.log.append(request)

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()

    def gets(self, client: str | None = None, suffix: str = "") -> list[Request]:
        return [
            r
            for r in list(self.log)
            if r.method == "GET" and (client is None or r.client == client) and r.key.endswith(suffix) and r.key
        ]

    def bytes_sent(self, client: str | None = None, suffix: str = "") -> int:
        return sum(r.sent for r in self.gets(client, suffix) if r.status in (200, 206))


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up (a cut answer, a timeout it retries): its own side reports it


def _handler(server: S3Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def _forward(self) -> None:
            path = self.path
            key = path.split("?", 1)[0].lstrip("/")
            key = key.split("/", 1)[1] if "/" in key else ""
            match = APP.search(self.headers.get("User-Agent", ""))
            client = match.group(1) if match else None
            fault = server.take_fault(self.command, key)
            if fault == "slowdown":
                self._drain()
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOWDOWN)))
                self.end_headers()
                self.wfile.write(SLOWDOWN)
                server.record(Request(self.command, key, self.headers.get("Range"), 503, 0, client))
                return
            if fault == "slow":
                time.sleep(0.2)
            body = self._drain()
            headers = {
                k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection", "transfer-encoding")
            }
            host, port = server.upstream
            conn = http.client.HTTPConnection(host, port, timeout=60)
            conn.request(self.command, path, body=body, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
            conn.close()
            self.send_response(answer.status)
            for k, v in answer.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                    self.send_header(k, v)
            length = answer.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length if length is not None else str(len(data)))
            if fault == "cut" and self.command == "GET" and len(data) > 1:
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self.close_connection = True
                server.record(Request(self.command, key, self.headers.get("Range"), -1, len(data) // 2, client))
                return
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            sent = len(data) if self.command != "HEAD" else 0
            server.record(Request(self.command, key, self.headers.get("Range"), answer.status, sent, client))

        def _drain(self) -> bytes | None:
            length = self.headers.get("Content-Length")
            if length is not None:
                return self.rfile.read(int(length))
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                parts = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass
                        break
                    parts.append(self.rfile.read(size))
                    self.rfile.readline()
                return b"".join(parts)
            return None

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward  # noqa: N815

    return Handler
