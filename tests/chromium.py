"""Headless Chromium driven over the DevTools protocol, for tests that browse a real page (the MLflow UI).

Chromium talks on two pipes (`--remote-debugging-pipe`: it reads commands on fd 3 and answers on fd 4, one
JSON message per NUL-terminated chunk), so no extra package, port or websocket is needed. Only what the tests
use: open a page, evaluate JavaScript in it, wait for a condition, take a screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
]


class Chromium:
    """One headless browser with one page (a fresh profile in `profile`), `width` x `height` CSS pixels."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 800):
        to_chromium, self._commands = os.pipe()
        self._answers, from_chromium = os.pipe()

        def on_fds_3_and_4():  # in the child, before exec: the pipes where Chromium expects them
            read, write = os.dup(to_chromium), os.dup(from_chromium)
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
            pass_fds=(3, 4),
            preexec_fn=on_fds_3_and_4,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chromium)
        os.close(from_chromium)
        self._buffer, self._id, self._session = b"", 0, None
        page = next(t for t in self.send("Target.getTargets")["targetInfos"] if t["type"] == "page")
        attached = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)
        self._session = attached["sessionId"]
        self.send("Page.enable")
        self.size(width, height)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, method: str, timeout: float = 60, **params) -> dict:
        """One DevTools command (to the page, once attached); its result, or RuntimeError with its error."""
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if self._session and not method.startswith("Target."):
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            for answer in self._read(deadline):
                if answer.get("id") == self._id:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer.get("result", {})

    def _read(self, deadline: float) -> list[dict]:
        """The messages that arrive next (events included), waiting until `deadline` for one."""
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer")
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed its pipe")
            self._buffer += chunk
        *messages, self._buffer = self._buffer.split(b"\0")
        return [json.loads(m) for m in messages]

    def size(self, width: int, height: int) -> None:
        """The page's viewport in CSS pixels (the page lays itself out again)."""
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.send("Emulation.setDeviceMetricsOverride", **metrics)

    def open(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"].get("exception", {}).get("description", result))
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120) -> object:
        """Poll a JavaScript expression until it is truthy (its value), or TimeoutError naming it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(f"(() => {{ try {{ return {expression}; }} catch (e) {{ return null; }} }})()")
            if value:
                return value
            time.sleep(0.5)
        raise TimeoutError(f"not true after {timeout:.0f} s: {expression}")

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", format="png")["data"]
        Path(path).write_bytes(base64.b64decode(data))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for fd in (self._commands, self._answers):
            os.close(fd)
