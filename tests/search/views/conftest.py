"""What the views' tests share: a dashboard server on a free port, and a GET against it."""

from __future__ import annotations

import http.client
import threading

import pytest

from search.views.dashboard.server import make_server


def http_get(server, path: str, headers: dict | None = None, *, timeout: float = 10) -> tuple[int, dict, bytes]:
    """(status, headers, body) of ``GET path`` on ``server``."""
    host, port = server.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body


@pytest.fixture
def serve():
    """``serve(paths, **make_server kwargs)``: a running server (shut down after the test)."""
    servers = []

    def start(paths, **kwargs):
        server = make_server(paths, port=0, **kwargs)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
