"""AWS's spot interruption notice: a thread on each node's local rank 0 polls the instance
metadata service (IMDSv2: a token by PUT, then GET spot/instance-action) and, on a notice, calls
the same `Preemption.notify` as the SIGTERM handler (`preemption.py`). `--spot-notice` picks the
endpoint (`spot_notice_url`).
"""

import json
import threading
import time
import urllib.request
from datetime import datetime

from chapters.ch24_cloud.preemption import Preemption
from common.log import log

IMDS_URL = "http://169.254.169.254"
TOKEN_TTL_S = 21600  # the longest session token IMDSv2 issues (6 h)


class SpotNoticePoller:
    """AWS's spot interruption notice, read from the instance metadata service the way AWS
    documents it (IMDSv2): `PUT {url}/latest/api/token` with the header
    `X-aws-ec2-metadata-token-ttl-seconds` gives a session token; `GET
    {url}/latest/meta-data/spot/instance-action` with the header `X-aws-ec2-metadata-token`
    answers 404 while no interruption is scheduled and `{"action": "terminate" | "stop" |
    "hibernate", "time": "<UTC>"}` about two minutes before it (hibernation: no two minutes).
    A thread polls every `interval_s` (AWS recommends 5 s) and, on a notice, calls the same
    `Preemption.notify` as the SIGTERM handler. A 401 (token expired) gets a new token.

    `imdsv2=False` polls IMDSv1-style, a plain GET without a token: what many scripts do, and
    what an instance that requires IMDSv2 answers with 401 every time (the negative control)."""

    def __init__(self, url: str, notice: Preemption, interval_s: float = 5.0,
                 timeout_s: float = 2.0, imdsv2: bool = True) -> None:
        self.url = url.rstrip("/")
        self.notice, self.interval_s, self.timeout_s, self.imdsv2 = notice, interval_s, timeout_s, imdsv2
        self.token: str | None = None
        self.token_expires = 0.0
        self.polls = 0  # GETs of instance-action answered (any status)
        self.seen: dict | None = None  # the notice's JSON, once seen
        self.errors: list[str] = []
        # never through HTTP(S)_PROXY: IMDS is link-local, a proxy cannot reach it (urlopen's
        # default opener sends every request to the proxy the environment names)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spot-notice", daemon=True)

    def _request(self, method: str, path: str, headers: dict) -> tuple[int, bytes]:
        import urllib.error
        req = urllib.request.Request(self.url + path, method=method, headers=headers,
                                     data=b"" if method == "PUT" else None)
        try:
            with self._opener.open(req, timeout=self.timeout_s) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, b""

    def _new_token(self) -> None:
        status, body = self._request("PUT", "/latest/api/token",
                                     {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
        if status != 200:
            raise OSError(f"token PUT answered {status}")
        self.token = body.decode()
        self.token_expires = time.monotonic() + TOKEN_TTL_S / 2  # renew well before it expires

    def poll_once(self) -> dict | None:
        """One look: the notice's JSON, or None (404: nothing scheduled)."""
        for attempt in (0, 1):
            headers = {}
            if self.imdsv2:
                if self.token is None or time.monotonic() > self.token_expires:
                    self._new_token()
                headers["X-aws-ec2-metadata-token"] = self.token
            status, body = self._request("GET", "/latest/meta-data/spot/instance-action", headers)
            self.polls += 1
            if status == 404:
                return None
            if status == 200:
                found = json.loads(body)
                if not isinstance(found, dict):
                    raise ValueError(f"instance-action answered {body[:60]!r}, not an object")
                return found
            if status == 401 and self.imdsv2 and attempt == 0:
                self.token = None  # expired or revoked: one new token, then try again
                continue
            raise OSError(f"instance-action GET answered {status}")
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:  # any error, not only the expected ones: a dead thread would hear nothing
                found = self.poll_once()
                if found is not None:
                    self._notify(found)
                    return
            except Exception as e:  # unreachable, refused, 401, a malformed answer ...
                self._failed(e)
            self._stop.wait(self.interval_s)

    def _notify(self, found: dict) -> None:
        self.seen = found
        when = found.get("time")
        try:
            stamp = datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
        except (AttributeError, ValueError):
            stamp = None  # no usable time: the deadline is --grace-s after the notice
        self.notice.notify(f"spot notice: {found.get('action')} at {when}", stamp)

    def _failed(self, e: Exception) -> None:
        """Log a failed poll (each new kind of failure once, then a count) and keep polling."""
        what = f"{type(e).__name__}: {e}"
        if what not in self.errors:
            log.warning("spot notice: %s: %s", self.url, what[:120])
            log.warning("  (poll %d failed; still polling every %g s)", len(self.errors) + 1,
                        self.interval_s)
        self.errors.append(what)

    def start(self) -> "SpotNoticePoller":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 1)


def looks_like_ec2(dmi: str = "/sys/devices/virtual/dmi/id") -> bool:
    """Does this machine say it is an EC2 instance? Nitro instances report "Amazon EC2" as
    the DMI system vendor; older Xen ones, "Xen" with a BIOS version ending in "amazon"."""
    from pathlib import Path
    read = lambda name: (Path(dmi, name).read_text().strip() if Path(dmi, name).is_file()  # noqa: E731
                         else "")
    return (read("sys_vendor") == "Amazon EC2" or read("board_vendor") == "Amazon EC2"
            or read("bios_version").lower().endswith("amazon"))


def spot_notice_url(option: str, dmi: str = "/sys/devices/virtual/dmi/id") -> str | None:
    """--spot-notice: '' off; 'aws' the real endpoint; 'auto' the real one on an EC2-looking
    machine, else off; anything else a URL (a test's fake endpoint)."""
    if option == "":
        return None
    if option == "aws":
        return IMDS_URL
    if option == "auto":
        return IMDS_URL if looks_like_ec2(dmi) else None
    return option
