"""The live Pareto page: its server (``server``) and the page itself (``static/``, package data)."""

from search.views.dashboard.server import (
    STATIC_DIR,
    make_server,
    render_page,
    serve_dashboard,
    studies_payload,
    study_payload,
)

__all__ = ["STATIC_DIR", "make_server", "render_page", "serve_dashboard", "studies_payload", "study_payload"]
