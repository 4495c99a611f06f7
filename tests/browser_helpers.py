"""A headless Chromium driven over the DevTools protocol on a pipe: open a page, run JS in it, screenshot it.

``--dump-dom`` shows a page once; a page the user acts on (pick a model, reload) needs a browser that stays
open. Chromium reads DevTools commands on fd 3 and answers on fd 4 (``--remote-debugging-pipe``), one JSON
message per NUL, so no port and no client library is needed.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import sys
import time

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
# moves the pipe ends (any numbers) onto fds 3 and 4, where Chromium looks for them, and becomes Chromium
ONTO_3_AND_4 = """import os, sys
r, w = os.dup(int(sys.argv[1])), os.dup(int(sys.argv[2]))
os.dup2(r, 3)
os.dup2(w, 4)
os.set_inheritable(3, True)  # dup2 onto itself (r was 3) keeps os.dup's close-on-exec
os.set_inheritable(4, True)
for fd in {int(sys.argv[1]), int(sys.argv[2]), r, w} - {3, 4}:
    os.close(fd)
os.execv(sys.argv[3], sys.argv[3:])
"""


class BrowserError(RuntimeError):
    """DevTools answered an error, or Chromium did not answer in time."""


class Browser:
    """One Chromium and one tab in it. ``with Browser(url) as b: b.js("document.title")``."""

    def __init__(self, url: str, width: int = 1280, height: int = 900, timeout: float = 30.0):
        self.timeout, self._n, self._buf = timeout, 0, b""
        to_chromium, self._out = os.pipe()
        self._in, from_chromium = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ONTO_3_AND_4, str(to_chromium), str(from_chromium), CHROMIUM, *FLAGS,
             f"--window-size={width},{height}", "--remote-debugging-pipe", "about:blank"],
            pass_fds=(to_chromium, from_chromium), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_chromium)
        os.close(from_chromium)
        try:
            target = self.send("Target.createTarget", url=url)["targetId"]
            self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        except BaseException:
            self.close()
            raise

    def send(self, method: str, session: str | None = None, **params) -> dict:
        """One DevTools command and its result (events in between are dropped)."""
        self._n += 1
        msg = {"id": self._n, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._out, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            while b"\0" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._in], [], [], left)[0]:
                    raise BrowserError(f"no answer to {method} within {self.timeout} s")
                chunk = os.read(self._in, 1 << 20)
                if not chunk:
                    raise BrowserError(f"chromium exited ({self.proc.poll()}) during {method}")
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._n:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error']}")
                return answer["result"]

    def js(self, expression: str):
        """The value of ``expression`` in the page (awaited when a promise, JSON-copied)."""
        r = self.send("Runtime.evaluate", self.session, expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise BrowserError(f"{expression!r} threw: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expression: str, timeout: float = 20.0):
        """Until ``expression`` is truthy in the page; its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.js(expression)
            except BrowserError:  # a page still loading, or reloading, has no such element yet
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{expression!r} still falsy after {timeout} s")
            time.sleep(0.1)

    def reload(self) -> None:
        self.send("Page.reload", self.session)

    def screenshot(self) -> bytes:
        """The tab's whole page as PNG bytes."""
        r = self.send("Page.captureScreenshot", self.session, format="png", captureBeyondViewport=True)
        return base64.b64decode(r["data"])

    def close(self) -> None:
        """Ask Chromium to quit (it takes its helper processes along); kill it if it does not."""
        try:
            self.timeout = 5.0
            self.send("Browser.close")
        except (BrowserError, OSError):
            pass
        finally:
            os.close(self._out)
            os.close(self._in)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
