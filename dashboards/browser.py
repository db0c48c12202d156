"""Drive a headless Chromium over the DevTools protocol, with the standard library only.

For the page's tests and timings: start Debian's ``chromium`` with ``--remote-debugging-port``,
talk to its page target over a WebSocket (a minimal RFC 6455 client: text frames, masking,
fragments, ping) and call protocol methods (``Page.navigate``, ``Runtime.evaluate``,
``Page.captureScreenshot``, ...). No Python package beyond the standard library, so the tests
need nothing a fresh machine lacks except Chromium itself (``with-deps`` installs it).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["find_chromium", "Browser", "BrowserError"]

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class BrowserError(RuntimeError):
    pass


def find_chromium() -> str | None:
    """The Chromium binary: $CHROMIUM, else the first of CANDIDATES on PATH."""
    env = os.environ.get("CHROMIUM")
    if env:
        return env if Path(env).exists() or shutil.which(env) else None
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class _WebSocket:
    """Just enough of a WebSocket client for the DevTools protocol on localhost."""

    def __init__(self, url: str, *, timeout: float) -> None:
        match = re.match(r"ws://([^/:]+):(\d+)(/.*)", url)
        if not match:
            raise BrowserError(f"unexpected DevTools URL {url!r}")
        host, port, path = match.group(1), int(match.group(2)), match.group(3)
        self.sock = socket.create_connection((host, port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise BrowserError("DevTools closed the connection during the handshake")
            head += chunk
        status = head.split(b"\r\n", 1)[0]
        if b" 101 " not in status:
            raise BrowserError(f"DevTools refused the WebSocket: {status.decode(errors='replace')}")
        self.buffer = head.split(b"\r\n\r\n", 1)[1]

    def _read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buffer)))
            if not chunk:
                raise BrowserError("DevTools closed the connection")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def _send_frame(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        n = len(payload)
        header = bytes([0x80 | opcode])
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack(">H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack(">Q", n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload)) if n < 4096 else _mask_fast(payload, mask)
        self.sock.sendall(header + mask + masked)

    def send(self, text: str) -> None:
        self._send_frame(0x1, text.encode())

    def recv(self) -> str:
        parts: list[bytes] = []
        while True:
            b0, b1 = self._read(2)
            opcode, n = b0 & 0x0F, b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            mask = self._read(4) if b1 & 0x80 else None
            payload = self._read(n)
            if mask:
                payload = _mask_fast(payload, mask)
            if opcode == 0x9:  # ping
                self._send_frame(0xA, payload)
                continue
            if opcode == 0x8:
                raise BrowserError("DevTools closed the WebSocket")
            if opcode in (0x1, 0x2, 0x0):
                parts.append(payload)
                if b0 & 0x80:
                    return b"".join(parts).decode()

    def close(self) -> None:
        try:
            self._send_frame(0x8, b"")
        except OSError:
            pass
        self.sock.close()


def _mask_fast(payload: bytes, mask: bytes) -> bytes:
    n = len(payload)
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")


class Browser:
    """A headless Chromium with one page; ``with Browser() as b: b.navigate(url)``."""

    def __init__(self, *, binary: str | None = None, width: int = 1400, height: int = 1900, timeout: float = 30.0) -> None:
        self.binary = binary or find_chromium()
        if not self.binary:
            raise BrowserError("no chromium found; install Debian's chromium (apt-get install chromium) or set $CHROMIUM")
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="ls-chromium-")
        args = [
            self.binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
            "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
            "--disable-default-apps", "--mute-audio", "--hide-scrollbars", "--disable-dev-shm-usage",
            f"--window-size={width},{height}", f"--user-data-dir={self.profile}", "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1", "about:blank",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        try:
            port = self._devtools_port()
            page = self._page_target(port)
            self.ws = _WebSocket(page["webSocketDebuggerUrl"], timeout=timeout)
        except Exception:
            self.close()
            raise

    def _devtools_port(self) -> int:
        # Chromium writes the port it picked to DevToolsActivePort in the profile folder.
        deadline = time.monotonic() + self.timeout
        port_file = Path(self.profile) / "DevToolsActivePort"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read() if self.process.stderr else ""
                raise BrowserError(f"chromium exited with code {self.process.returncode}: {err.strip()[-500:]}")
            if port_file.is_file():
                text = port_file.read_text().split()
                if text:
                    return int(text[0])
            time.sleep(0.05)
        raise BrowserError("chromium did not open its DevTools port in time")

    def _page_target(self, port: int) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as resp:
                    targets = json.load(resp)
                pages = [t for t in targets if t.get("type") == "page"]
                if pages:
                    return pages[0]
            except OSError:
                pass
            time.sleep(0.1)
        raise BrowserError("chromium has no page target")

    # -- protocol -------------------------------------------------------------------------
    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        ident = self._next_id
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            message = json.loads(self.ws.recv())
            if message.get("id") == ident:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)
        raise BrowserError(f"{method}: no answer in {self.timeout} s")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"JS error in {expression!r}: {result['exceptionDetails'].get('exception', {}).get('description')}")
        return result.get("result", {}).get("value")

    def navigate(self, url: str) -> str:
        """Load ``url``; the navigation's loader id (``requests()`` filters on it)."""
        self.call("Page.enable")
        return self.call("Page.navigate", url=url).get("loaderId", "")

    def requests(self, loader_id: str) -> list[str]:
        """URLs the page of navigation ``loader_id`` asked for so far (needs ``Network.enable``)."""
        self.call("Runtime.evaluate", expression="1")  # collect the events that arrived meanwhile
        return [e["params"]["request"]["url"] for e in self.events
                if e.get("method") == "Network.requestWillBeSent" and e["params"].get("loaderId") == loader_id]

    def wait_for(self, expression: str, *, timeout: float = 15.0, interval: float = 0.05) -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except BrowserError:
                value = None  # the page is still loading
            if value:
                return value
            time.sleep(interval)
        raise BrowserError(f"timed out after {timeout} s waiting for {expression!r} (last value {value!r})")

    def screenshot(self, path: str | os.PathLike) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
