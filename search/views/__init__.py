"""What a person reads: the command line (``cli``), the static report (``report``) and the live
Pareto page (``dashboard``)."""

from search.views.cli import main
from search.views.dashboard import make_server, serve_dashboard
from search.views.report import Report, write_report

__all__ = ["main", "make_server", "serve_dashboard", "Report", "write_report"]
