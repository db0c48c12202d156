"""The live Pareto page: ``python -m search dashboard DIR [DIR...]``.

A stdlib ``ThreadingHTTPServer`` serves two things:

    GET /           one self-contained HTML page (CSS and JS inline; it fetches nothing but the
                    JSON below, so it works with no network)
    GET /api/data   the studies' rows as compact, columnar JSON, read from the Parquet files at
                    request time; an ETag built from the files' (mtime, size) answers the page's
                    2-second polls with 304 while nothing changed, so a finished 10,000-trial
                    study costs one ``stat`` per poll
    GET /api/importance  the knobs' importance per study, family and objective
                    (:func:`search.results.importance.knob_importance`: fANOVA on the journal),
                    recomputed only when a study's ``optuna.journal`` changed (once per trial
                    sampled or finished, not per epoch as trials.parquet), with its own ETag

The page itself lives beside this module in ``static/`` (``pareto.html``, ``pareto.css``,
``pareto.js``), package data found through :mod:`importlib.resources` (so an installed copy has
it too); :func:`render_page` inlines them, and :mod:`search.views.report` reuses it with the
data embedded instead of fetched.

The server is read-only and binds 127.0.0.1 unless told otherwise: study folders hold configs
and paths, and the page has no login. Another address needs ``allow_remote=True``
(``--allow-remote``). On loopback it also refuses requests whose Host header is not a loopback
name, so a web page the user visits cannot read the data through DNS rebinding.
"""

from __future__ import annotations

import datetime as dt
import http.server
import importlib.resources
import json
import math
import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow as pa

from search.hosts import check_bind_host, is_loopback_host
from search.results.importance import VIEW_MAX_TRIALS, by_family, knob_importance
from search.results.location import JOURNAL_FILE
from search.results.front import compute_front
from search.results.query import read_experiment_json
from search.results.store import TRIAL_COLUMNS, read_table
from trainers.errors import ConfigError

__all__ = [
    "STATIC_DIR",
    "study_payload",
    "studies_payload",
    "importance_payload",
    "render_page",
    "make_server",
    "serve_dashboard",
]

# The page's files: package data of this package (pyproject's [tool.setuptools.package-data]).
STATIC_DIR = importlib.resources.files(__package__) / "static"

# Result columns the page shows (knobs are added per study); the rest of trials.parquet
# (device strings, commits, timestamps) stays out of the JSON to keep it small at 10,000 rows.
PAGE_COLUMNS = (
    "trial_id", "model", "family", "state", "stop_reason", "error", "rejected_by", "epochs_run", "epochs_budget",
    "val_acc", "val_loss", "final_val_acc", "throughput", "params", "flops", "duration_s", "ended_at",
    "val_acc_low", "val_acc_high", "throughput_low", "throughput_high", "tied_with",  # error bars, ties
    "seed", "replicate_of", "seeds",  # confirmation replicates (a front member's seeds)
    "test_acc", "test_acc_low", "test_acc_high",  # the front's held-out score (search.study.heldout)
)
# Text columns with few distinct values go as a dictionary plus codes: smaller and faster to parse.
DICT_COLUMNS = ("model", "family", "state", "stop_reason")
PROGRESS_PAGE_COLUMNS = ("finished", "state", "epochs_spent", "elapsed_s", "front_size", "hypervolume", "best_val_acc")


# -- data -------------------------------------------------------------------------------------
def _file_key(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return "-"
    return f"{st.st_mtime_ns}:{st.st_size}:{st.st_ino}"


def study_version(path: Path) -> str:
    """Changes whenever the files the page reads change (each is replaced by a rename)."""
    return "|".join(_file_key(path / name) for name in ("experiment.json", "trials.parquet", "progress.parquet"))


def _knobs(spec: Mapping[str, Any], columns: Sequence[str]) -> list[dict[str, Any]]:
    """The searched knobs, in spec order, with their ranges (the parallel-coordinates axes)."""
    knobs: dict[str, dict[str, Any]] = {}
    entries = [spec["model"]] if spec.get("model") else list(spec.get("models") or [])
    if len(entries) > 1:
        knobs["model"] = {"name": "model", "type": "choice", "values": [e.get("name") for e in entries], "models": None}
    for entry in entries:
        for key, param in (entry.get("space") or {}).items():
            knob = knobs.setdefault(key, {"name": key, **_range(param), "models": []})
            if knob["models"] is not None:
                knob["models"].append(entry.get("name"))
    for key, param in (spec.get("space") or {}).items():
        knobs[key] = {"name": key, **_range(param), "models": None}  # shared by every model
    present = set(columns)
    return [k for k in knobs.values() if k["name"] in present]


def _range(param: Mapping[str, Any]) -> dict[str, Any]:
    kind = param.get("type")
    if kind == "choice":
        return {"type": "choice", "values": list(param.get("values") or [])}
    return {"type": kind, "low": param.get("low"), "high": param.get("high"),
            "log": bool(param.get("log")) or kind == "loguniform"}


def _column_json(column: pa.ChunkedArray, name: str) -> Any:
    """One column as a JSON-ready list (NaN/inf -> null), or {"dict": [...], "codes": [...]}."""
    typ = column.type
    if pa.types.is_timestamp(typ):
        # Seconds since the epoch: the page only orders and formats them.
        values = column.cast(pa.int64()).to_numpy(zero_copy_only=False)
        valid = ~np.asarray(column.is_null())
        scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}[typ.unit]
        return [round(float(v) / scale, 3) if ok else None for v, ok in zip(values, valid)]
    if pa.types.is_floating(typ):
        array = column.to_numpy(zero_copy_only=False).astype(float)
        return [float(v) if math.isfinite(v) else None for v in array.tolist()]
    if name in DICT_COLUMNS or (pa.types.is_string(typ) and name not in ("trial_id", "error", "rejected_by")):
        encoded = column.dictionary_encode().combine_chunks()
        codes = encoded.indices.to_pylist()
        return {"dict": encoded.dictionary.to_pylist(), "codes": codes}
    return column.to_pylist()


def study_payload(path: str | os.PathLike, *, label: str | None = None) -> dict[str, Any]:
    """One study folder as the page's JSON: columns, front rows, progress, knobs.

    A folder a run has not written yet (or only partly) gives ``error`` and no rows, so the page
    can say what it waits for and keep polling."""
    path = Path(path)
    base: dict[str, Any] = {"label": label or path.name or str(path), "path": str(path), "version": study_version(path)}
    meta_file, trials_file = path / "experiment.json", path / "trials.parquet"
    if not meta_file.is_file() or not trials_file.is_file():
        missing = "experiment.json" if not meta_file.is_file() else "trials.parquet"
        return {**base, "error": f"{path}: no {missing} yet; waiting for `python -m search run` to write it", "n": 0}
    try:
        meta = read_experiment_json(meta_file)
        table = read_table(trials_file)
        progress_file = path / "progress.parquet"
        ptable = read_table(progress_file) if progress_file.is_file() else None
    except (OSError, ValueError, pa.ArrowException) as exc:  # a torn read cannot happen (atomic renames); a bad file can
        return {**base, "error": f"{path}: cannot read the study ({exc})", "n": 0}  # (ConfigError is a ValueError)
    spec = meta.get("spec") or {}
    objectives = [tuple(o) for o in meta.get("objectives") or []]
    knob_names = [c for c in table.column_names if c not in TRIAL_COLUMNS]
    knobs = _knobs(spec, knob_names + (["model"] if "model" in table.column_names else []))
    for name in knob_names:  # a knob the spec does not describe (edited experiment.json): infer
        if name not in {k["name"] for k in knobs}:
            numeric = pa.types.is_integer(table.schema.field(name).type) or pa.types.is_floating(table.schema.field(name).type)
            knobs.append({"name": name, "type": "uniform" if numeric else "choice", "models": None})
    shown = [c for c in PAGE_COLUMNS if c in table.column_names] + [k for k in knob_names if k not in PAGE_COLUMNS]
    columns = {name: _column_json(table.column(name), name) for name in shown}

    # The front: of configs, as search.load().front() (a confirmed config: its fresh seeds' estimate,
    # drawn at its search trial's row, whose objectives and intervals become the estimate's).
    n = table.num_rows
    front: list[int] = []
    if n and objectives and all(c in table.column_names for c, _ in objectives):
        index = {t: i for i, t in enumerate(table.column("trial_id").to_pylist())}
        candidates = compute_front(table.to_pandas(), objectives, dominated=True).to_dict("records")
        front = [index[m["trial_id"]] for m in candidates if m.get("dominated_by") is None]
        for m in candidates:  # those dominated within noise are off the front, but drawn at their means too
            if (m.get("seeds") or 1) > 1:
                for column in columns.keys() & {*(c for c, _ in objectives), "val_acc_low", "val_acc_high", "seeds", "test_acc", "test_acc_low",
                                                   "test_acc_high"}:
                    value = m.get(column)
                    columns[column][index[m["trial_id"]]] = value if value is None or math.isfinite(value) else None
    progress = None
    if ptable is not None:
        progress = {c: _column_json(ptable.column(c), c) for c in PROGRESS_PAGE_COLUMNS if c in ptable.column_names}
    budget = spec.get("budget") or {}
    return {
        **base,
        "error": None,
        "name": meta.get("name"),
        "objectives": [list(o) for o in objectives],
        "reference_point": meta.get("reference_point"),
        "created_at": meta.get("created_at"),
        "budget": {"trials": budget.get("trials"), "max_epochs": budget.get("max_epochs"),
                   "time_limit_s": budget.get("time_limit_s")},
        "knobs": knobs,
        "n": n,
        "columns": columns,
        "front": front,
        "progress": progress,
    }


def _labels(paths: Sequence[Path]) -> list[str]:
    names = [p.name or str(p) for p in paths]
    return names if len(set(names)) == len(names) else [str(p) for p in paths]


def studies_payload(paths: Sequence[str | os.PathLike]) -> dict[str, Any]:
    folders = [Path(p) for p in paths]
    return {
        "generated_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "studies": [study_payload(p, label=label) for p, label in zip(folders, _labels(folders))],
    }


def importance_version(path: Path) -> str:
    """Changes whenever the importance may: the journal gets a record when a trial is sampled or
    told, not at every epoch (trials.parquet, which only adds the family names, is rewritten then)."""
    return "|".join(_file_key(path / name) for name in ("experiment.json", JOURNAL_FILE))


def _study_importance(path: Path, label: str) -> dict[str, Any]:
    base: dict[str, Any] = {"label": label, "path": str(path)}
    try:
        table = knob_importance(path, max_trials=VIEW_MAX_TRIALS)
    except ConfigError as exc:  # not a study yet, no journal, too many trials: the page says so
        return {**base, "error": str(exc), "families": []}
    families = []
    for group in by_family(table):
        shares = group.shares
        families.append({
            "family": group.family, "model": group.model, "complete_trials": group.complete_trials,
            "minimum": group.minimum, "warning": group.warning,
            "objectives": [] if shares is None else list(shares.columns),
            "knobs": [] if shares is None else list(shares.index),
            "shares": {} if shares is None else {o: [float(v) for v in shares[o]] for o in shares.columns},
        })
    return {**base, "error": None, "evaluator": "fanova", "families": families}


def importance_payload(paths: Sequence[str | os.PathLike]) -> dict[str, Any]:
    """The page's knob-importance JSON: per study, per family, each objective's shares of the knobs
    (most important for the first objective first), the COMPLETE trials they rest on, the warning."""
    folders = [Path(p) for p in paths]
    return {"studies": [_study_importance(p, label) for p, label in zip(folders, _labels(folders))]}


def json_for_script(data: Any) -> str:
    """JSON that is safe inside <script>: no '</script>' or '<!--' can end the element early."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


def render_page(*, data: Any | None = None, title: str = "locality-search: Pareto", static_html: str = "") -> str:
    """The page with its CSS and JS inline. ``data`` (a :func:`studies_payload`) embeds the rows
    and turns polling off (the static report); ``None`` makes the page poll ``api/data``.
    ``static_html`` goes above the interactive views (the report's summary, for readers without JS)."""
    try:
        html = (STATIC_DIR / "pareto.html").read_text()
        css = (STATIC_DIR / "pareto.css").read_text()
        js = (STATIC_DIR / "pareto.js").read_text()
    except OSError as exc:
        raise ConfigError(
            f"the Pareto page's files are missing ({getattr(exc, 'filename', None) or exc}); reinstall locality-search "
            "(pip install .), whose package search.views.dashboard holds them in static/"
        ) from None
    import html as html_lib
    import re

    parts = {
        "{{TITLE}}": html_lib.escape(title),
        "/*{{CSS}}*/": css,
        "<!--{{STATIC}}-->": static_html,
        "/*{{DATA}}*/null": "null" if data is None else json_for_script(data),
        "/*{{JS}}*/": js,
    }
    # One pass over the template: text substituted in (data, user strings) is never searched again.
    return re.sub("|".join(map(re.escape, parts)), lambda m: parts[m.group(0)], html)


# -- server -----------------------------------------------------------------------------------
class _Handler(http.server.BaseHTTPRequestHandler):
    server: _DashboardServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the page polls every 2 s
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, status: int, body: bytes, content_type: str, headers: Mapping[str, str] = {}) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Content-Type-Options", "nosniff")
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _host_ok(self) -> bool:
        if not self.server.loopback_only:
            return True
        host = (self.headers.get("Host") or "").strip()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return is_loopback_host(name) if name else False

    def _send_json(self, etag: str, body: bytes) -> None:
        """``body``, or 304 when the page already has this ETag's version."""
        if self.headers.get("If-None-Match") == etag:
            self.send_response(304)
            self.send_header("ETag", etag)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._send(200, body, "application/json", {"ETag": etag})

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        if not self._host_ok():
            self._send(403, b"forbidden: this dashboard answers on loopback names only\n", "text/plain; charset=utf-8")
            return
        route = self.path.split("?", 1)[0]
        if route in ("/", "/index.html"):
            self._send(200, self.server.page(), "text/html; charset=utf-8",
                       {"Content-Security-Policy": "default-src 'none'; connect-src 'self'; img-src 'self' data:; "
                        "style-src 'unsafe-inline'; script-src 'unsafe-inline'"})
        elif route == "/api/data":
            self._send_json(*self.server.data())
        elif route == "/api/importance":
            self._send_json(*self.server.importance())
        elif route == "/favicon.ico":
            self._send(204, b"", "image/x-icon")
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")


class _DashboardServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], *, paths: Sequence[Path], loopback_only: bool, verbose: bool) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, _Handler)
        self.paths = list(paths)
        self.loopback_only = loopback_only
        self.verbose = verbose
        # one lock and cached (ETag, JSON) per endpoint: a fANOVA fit must not hold up /api/data
        self._locks = {"data": threading.Lock(), "importance": threading.Lock()}
        self._cached: dict[str, tuple[str, bytes]] = {}
        self._page: bytes | None = None

    def page(self) -> bytes:
        if self._page is None:
            self._page = render_page().encode()
        return self._page

    def _json(self, kind: str, versions: Sequence[str], build: Any) -> tuple[str, bytes]:
        """(ETag, JSON) of ``build(paths)``, rebuilt only when ``versions`` changed."""
        etag = f'"{kind[0]}{abs(hash(tuple(versions)))}"'
        with self._locks[kind]:
            cached = self._cached.get(kind)
            if cached is None or cached[0] != etag:
                cached = self._cached[kind] = (etag, json.dumps(build(self.paths), separators=(",", ":"),
                                                                allow_nan=False).encode())
            return cached

    def data(self) -> tuple[str, bytes]:
        """(ETag, JSON) of the studies now; rebuilt only when a file changed."""
        return self._json("data", [study_version(p) for p in self.paths], studies_payload)

    def importance(self) -> tuple[str, bytes]:
        """(ETag, JSON) of the knobs' importance; recomputed only when a journal changed."""
        return self._json("importance", [importance_version(p) for p in self.paths], importance_payload)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else host
        return f"http://{shown}:{port}/"


def make_server(
    paths: Sequence[str | os.PathLike],
    *,
    host: str = "127.0.0.1",
    port: int = 8050,
    allow_remote: bool = False,
    verbose: bool = False,
) -> _DashboardServer:
    """A bound (not yet serving) dashboard server for ``paths``; ``port=0`` picks a free port.
    Call ``serve_forever()`` (in a thread, for tests) and ``shutdown()``/``server_close()``."""
    if not paths:
        raise ConfigError("dashboard: pass at least one study folder, e.g. results/convit_locality")
    check_bind_host(host, allow_remote=allow_remote, flag="--allow-remote", option="--host",
                    what="the dashboard (no login: every trial, config and path of the studies)")
    render_page()  # fail now, with the fix, if the page's files are missing
    try:
        return _DashboardServer((host, port), paths=[Path(p) for p in paths],
                                loopback_only=is_loopback_host(host), verbose=verbose)
    except OSError as exc:
        hint = f"; pick another with --port (or --port 0 for any free one)" if exc.errno in (98, 48) else ""
        raise ConfigError(f"dashboard: cannot listen on {host}:{port} ({exc.strerror or exc}){hint}") from None


def serve_dashboard(
    paths: Sequence[str | os.PathLike],
    *,
    host: str = "127.0.0.1",
    port: int = 8050,
    allow_remote: bool = False,
    out: TextIO | None = None,  # None: sys.stdout when called (not when imported)
) -> None:
    """Serve the Pareto page for ``paths`` until interrupted (Ctrl-C)."""
    server = make_server(paths, host=host, port=port, allow_remote=allow_remote)
    for path in server.paths:
        if not (path / "trials.parquet").is_file():
            print(f"note: {path} holds no study yet; the page shows it once `python -m search run` writes it",
                  file=out, flush=True)
    if not server.loopback_only:
        print(f"warning: serving on {host}, reachable from other machines, without a login", file=out, flush=True)
    print(f"Pareto dashboard for {', '.join(map(str, server.paths))}: {server.url}  (Ctrl-C stops it)", file=out, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
