"""A stand-in for the EC2 instance metadata service (IMDS) on 127.0.0.1, for the tests and the
notebook: the part of it a spot job talks to, written from AWS's documentation (the EC2 user
guide's "Retrieve instance metadata" and "Spot Instance interruption notices" pages), not from
`spot_notice.SpotNoticePoller`, so that a poller that gets the protocol wrong is refused here.

What it serves, as IMDS does with IMDSv2 required (`HttpTokens=required`):
- `PUT /latest/api/token` with the header `X-aws-ec2-metadata-token-ttl-seconds: 1..21600`
  answers a new session token (text); a PUT without the header, or with a TTL out of range,
  gets 400 ("Missing or Invalid Parameters").
- `GET /latest/meta-data/spot/instance-action` with the header `X-aws-ec2-metadata-token: <a
  token that has not expired>` answers 404 while no interruption is scheduled, then
  `{"action": "terminate", "time": "<UTC, ISO 8601>"}` once `arm()` was called, after the
  first `notice_after` answered polls, or at the first poll at which `arm_when()` is true (a
  test's condition, such as "the run has logged a training step"). Without a valid token: 401 ("Unauthorized"; IMDSv1's
  plain GET is refused when IMDSv2 is required).
- Anything else: 404.

`broken_polls=k` answers the first k GETs of instance-action with a line that is not HTTP (what
a broken proxy or endpoint can send; `http.client` raises `BadStatusLine`, which is no OSError):
a poller must survive it.

Every request is logged (method, path, the two headers, the status returned) in `requests`.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeIMDS:
    """An IMDSv2 endpoint in a background thread: `with FakeIMDS(notice_after=3) as imds:`, then
    point the poller at `imds.url`."""

    def __init__(self, notice_after: int | None = None, action: str = "terminate",
                 notice_in_s: float = 120.0, max_ttl_s: float | None = None,
                 arm_when=None, broken_polls: int = 0) -> None:
        self.notice_after = notice_after  # answered polls before the notice appears (None: arm())
        self.arm_when = arm_when  # or: arm at the first valid poll at which this returns True
        self.broken_polls = broken_polls  # GETs answered with a line that is not HTTP
        self.armed_after_polls: int | None = None  # valid polls answered 404 before the notice
        self.action = action
        self.notice_in_s = notice_in_s  # the notice's "time": this long after it appears
        self.max_ttl_s = max_ttl_s  # expire tokens sooner than asked (to test a refresh)
        self.requests: list[dict] = []
        self.tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self.polls = 0  # polls answered with a valid token
        self.notice: dict | None = None
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def arm(self) -> None:
        """Schedule the interruption now: the next valid poll gets the notice."""
        with self._lock:
            self._arm()

    def _arm(self) -> None:  # with the lock held
        if self.notice is None:
            when = datetime.now(timezone.utc) + timedelta(seconds=self.notice_in_s)
            self.notice = {"action": self.action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
            self.armed_after_polls = self.polls

    def expire_tokens(self) -> None:
        """Every token issued so far expires now (what IMDS does when a token's TTL is over)."""
        with self._lock:
            self.tokens = dict.fromkeys(self.tokens, 0.0)

    def statuses(self, method: str, path: str) -> list[int]:
        return [r["status"] for r in self.requests if r["method"] == method and r["path"] == path]

    def __enter__(self) -> FakeIMDS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def _answer(self, method: str, path: str, headers) -> tuple[int, bytes]:
        ttl = headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        token = headers.get("X-aws-ec2-metadata-token")
        with self._lock:
            if method == "PUT" and path == "/latest/api/token":
                try:
                    seconds = int(ttl)
                except (TypeError, ValueError):
                    return 400, b""
                if not 1 <= seconds <= 21600:
                    return 400, b""
                if self.max_ttl_s is not None:
                    seconds = min(seconds, self.max_ttl_s)
                new = secrets.token_urlsafe(32)
                self.tokens[new] = time.monotonic() + seconds
                return 200, new.encode()
            if method == "GET" and path == "/latest/meta-data/spot/instance-action":
                if token is None or self.tokens.get(token, 0.0) < time.monotonic():
                    return 401, b""
                if self.notice is None and (
                        (self.notice_after is not None and self.polls >= self.notice_after)
                        or (self.arm_when is not None and self.arm_when())):
                    self._arm()
                self.polls += 1
                if self.notice is None:
                    return 404, b""
                return 200, json.dumps(self.notice).encode()
            return 404, b""

    def _handler_class(self):
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                if method == "GET" and self.path.endswith("/spot/instance-action"):
                    with imds._lock:
                        broken = imds.broken_polls > 0
                        imds.broken_polls -= broken
                    if broken:
                        imds.requests.append({"method": method, "path": self.path,
                                              "status": "not HTTP", "ttl": None, "token": None})
                        self.wfile.write(b"garbage\r\n\r\n")
                        self.close_connection = True
                        return
                status, body = imds._answer(method, self.path, self.headers)
                imds.requests.append({
                    "method": method, "path": self.path, "status": status,
                    "ttl": self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"),
                    "token": self.headers.get("X-aws-ec2-metadata-token")})
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._serve("GET")

            def do_PUT(self) -> None:  # noqa: N802
                self._serve("PUT")

            def log_message(self, *args) -> None:  # no access log on the console
                pass

        return Handler
