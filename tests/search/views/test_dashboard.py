"""The live Pareto page (``python -m search dashboard``) and the static report.

The page is tested in a real headless Chromium (Debian's ``chromium``), driven over the DevTools
protocol by ``dashboards/browser.py`` (standard library only): it must draw the fixture store's
points, show a trial written to trials.parquet afterwards without a reload, answer a click on a
point with the trial's config and export command, and fetch nothing but its own server. The
screenshots are kept (the pytest tmp folder, and copied to $LOCALITY_SEARCH_ARTIFACTS, default
<tmp>/locality-search-artifacts/) and their paths printed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import search
from dashboards.browser import Browser, BrowserError
from search.hosts import is_loopback_host
from search.results.store import ResultsStore
from search.views.cli import main
from tests.search.views.conftest import http_get as _get
from search.views.dashboard.server import make_server, render_page, studies_payload, study_payload
from search.views.report import write_report
from trainers.errors import ConfigError

SPACE = {
    "locality_strength": {"type": "uniform", "low": 0.1, "high": 3.0},
    "lr": {"type": "loguniform", "low": 1e-4, "high": 1e-2},
    "act": {"type": "choice", "values": ["gelu", "relu"]},
}
OBJECTIVES = [("val_acc", "max"), ("throughput", "max")]
# trial, family, state, val_acc, throughput
TRIALS = [
    ("a0", "convit", "COMPLETE", 0.91, 1000.0),   # front: most accurate
    ("a1", "convit", "COMPLETE", 0.86, 2600.0),   # front
    ("a2", "vit", "COMPLETE", 0.80, 2000.0),      # dominated by a1
    ("a3", "vit", "COMPLETE", 0.74, 3900.0),      # front: fastest
    ("a4", "convit", "PRUNED", 0.95, 4200.0),     # cut short: plotted hollow, never on the front
    ("a5", "vit", "FAILED", None, 2500.0),        # no accuracy: not plotted
    ("a6", "convit", "REJECTED", None, 900.0),    # never trained: not plotted
]


def _row(trial_id: str, family: str, state: str, acc: float | None, tput: float, k: int, now: dt.datetime) -> dict:
    return {
        "trial_id": trial_id, "trial_name": trial_id, "experiment": "fixture", "model": f"ls_{family}_nano",
        "family": family, "state": state, "stop_reason": {"COMPLETE": "max_epochs", "PRUNED": "scheduler",
                                                          "FAILED": "error", "REJECTED": "constraint"}[state],
        "error": "NonFiniteLossError: loss became nan" if state == "FAILED" else None,
        "epochs_run": {"COMPLETE": 4, "PRUNED": 2, "FAILED": 1, "REJECTED": 0}[state], "epochs_budget": 4,
        "val_acc": acc, "throughput": tput, "params": 100_000 + k, "flops": 2_000_000 + k,
        "started_at": now, "ended_at": now, "duration_s": 10.0 + k,
    }


def _config(k: int) -> dict:
    return {"locality_strength": 0.5 + 0.3 * k, "lr": 1e-3 * (1 + k), "act": "gelu" if k % 2 else "relu"}


def make_study(path: Path, *, name: str = "fixture", trials=TRIALS) -> ResultsStore:
    """A study folder written through the real store (as a run writes it); the store, to add more."""
    store = ResultsStore(path, space=SPACE, objectives=OBJECTIVES, reference=[0.0, 0.0])
    now = dt.datetime.now(dt.timezone.utc)
    for k, (trial_id, family, state, acc, tput) in enumerate(trials):
        store.add_trial(_row(trial_id, family, state, acc, tput, k, now), _config(k))
        store.add_progress(trial_id=trial_id, state=state, elapsed_s=10.0 * (k + 1), at=now)
    store.flush()
    meta = {
        "name": name, "objectives": [list(o) for o in OBJECTIVES], "reference_point": [0.0, 0.0],
        "created_at": now.isoformat(),
        "spec": {"name": name, "model": {"name": "ls_convit_nano", "args": {}, "space": {}}, "space": SPACE,
                 "budget": {"trials": 10, "max_epochs": 4}},
    }
    (path / "experiment.json").write_text(json.dumps(meta))
    return store


def _add_trial(store: ResultsStore, trial_id: str, acc: float, tput: float) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    store.add_trial(_row(trial_id, "gmm", "COMPLETE", acc, tput, 9, now), _config(9))
    store.add_progress(trial_id=trial_id, state="COMPLETE", elapsed_s=99.0, at=now)
    store.flush()  # atomic renames, as during a run


@pytest.fixture
def study(tmp_path) -> Path:
    make_study(tmp_path / "fixture")
    return tmp_path / "fixture"


# -- the JSON -----------------------------------------------------------------------------
def _decode(column):
    if isinstance(column, dict):
        return [None if c is None else column["dict"][c] for c in column["codes"]]
    return column


def test_payload_has_the_rows_the_front_and_the_progress(study):
    payload = study_payload(study)
    assert payload["error"] is None and payload["n"] == len(TRIALS)
    cols = {k: _decode(v) for k, v in payload["columns"].items()}
    assert cols["trial_id"] == [t[0] for t in TRIALS]
    assert cols["state"] == [t[2] for t in TRIALS]
    assert cols["val_acc"][5] is None  # null, not NaN: the JSON stays valid
    front_ids = [cols["trial_id"][i] for i in payload["front"]]
    assert front_ids == list(search.load(study).front()["trial_id"]) == ["a0", "a1", "a3"]
    assert [k["name"] for k in payload["knobs"]] == ["locality_strength", "lr", "act"]
    assert payload["knobs"][1]["log"] is True and payload["knobs"][2]["values"] == ["gelu", "relu"]
    assert payload["progress"]["finished"] == list(range(1, len(TRIALS) + 1))
    assert payload["progress"]["hypervolume"][-1] > 0
    json.dumps(payload, allow_nan=False)


def test_payload_of_a_folder_not_written_yet_says_what_it_waits_for(tmp_path):
    payload = studies_payload([tmp_path / "later"])["studies"][0]
    assert payload["n"] == 0 and "waiting for `python -m search run`" in payload["error"]


def test_page_is_self_contained():
    page = render_page()
    assert "/*{{" not in page and "{{TITLE}}" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", page, re.I)
    assert "import(" not in page


# -- the server ---------------------------------------------------------------------------
def test_server_serves_the_page_and_answers_polls_with_304_until_a_file_changes(study, serve):
    server = serve([study])
    status, headers, body = _get(server, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"api/data" in body
    status, headers, body = _get(server, "/api/data")
    assert status == 200
    etag = headers["ETag"]
    assert json.loads(body)["studies"][0]["n"] == len(TRIALS)
    assert _get(server, "/api/data", {"If-None-Match": etag})[0] == 304
    store = ResultsStore(study, space=SPACE, objectives=OBJECTIVES, reference=[0.0, 0.0])
    store.load_existing()
    _add_trial(store, "new1", 0.5, 100.0)
    status, headers, body = _get(server, "/api/data", {"If-None-Match": etag})
    assert status == 200 and headers["ETag"] != etag
    assert "new1" in json.loads(body)["studies"][0]["columns"]["trial_id"]
    assert _get(server, "/nope")[0] == 404


def test_server_answers_loopback_names_only(study, serve):
    # DNS rebinding: a page on evil.example resolved to 127.0.0.1 must not read the studies.
    server = serve([study])
    assert _get(server, "/api/data", {"Host": "evil.example:8050"})[0] == 403
    assert _get(server, "/api/data", {"Host": f"localhost:{server.server_address[1]}"})[0] == 200


def test_non_loopback_host_needs_the_flag(study, capsys):
    assert is_loopback_host("127.0.0.1") and is_loopback_host("localhost") and is_loopback_host("::1")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("192.168.1.10")
    with pytest.raises(ConfigError, match="--allow-remote"):
        make_server([study], host="0.0.0.0", port=0)
    assert main(["dashboard", str(study), "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-remote" in err and "0.0.0.0" in err
    server = make_server([study], host="0.0.0.0", port=0, allow_remote=True)  # with it, it binds
    server.server_close()


def test_run_refuses_a_non_loopback_ray_dashboard_without_the_flag(capsys, tmp_path):
    spec = Path(__file__).resolve().parents[3] / "spaces" / "synthetic_smoke.yaml"
    assert main(["run", str(spec), "--dashboard-host", "0.0.0.0", "--storage", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-remote-dashboard" in err
    assert not any(tmp_path.iterdir())  # refused before anything was written


# -- the report ---------------------------------------------------------------------------
def test_report_is_self_contained_and_holds_the_front(study, tmp_path):
    from PIL import Image

    report = write_report(study, out=tmp_path / "out" / "report.html")
    text = report.html.read_text()
    # nothing that a browser would fetch from a network
    assert not re.search(r"""<(script|img|link|iframe|source|video|audio)\b[^>]*(src|href)\s*=\s*["']?(https?:)?//""", text, re.I)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//", text, re.I)
    assert not re.search(r"@import", text)
    assert "data:image/png;base64," in text
    front = list(search.load(study).front()["trial_id"])
    table = text[text.index('class="front-table"'):text.index("</table>", text.index('class="front-table"'))]
    assert [t for t in front if f"<td>{t}</td>" in table] == front  # the front, as plain HTML
    assert "<td>a2</td>" not in table  # dominated: not in the front table
    assert "const EMBEDDED_DATA = null" not in text  # the interactive part has the data inline
    with Image.open(report.png) as png:
        assert png.format == "PNG" and png.size == (1600, 1000)
    assert report.trials == len(TRIALS) and report.front == len(front)
    assert oct(report.html.stat().st_mode & 0o444) != "0o0"  # readable: it is meant to be passed on


def test_report_draws_the_fronts_intervals_and_rings_its_ties(tmp_path):
    from PIL import Image

    from search.views.report import TIED_COLOR

    trials = [("b0", "convit", "COMPLETE", 0.91, 1000.0), ("b1", "convit", "COMPLETE", 0.905, 1050.0),
              ("b2", "vit", "COMPLETE", 0.80, 3000.0)]
    store = make_study(tmp_path / "s", trials=trials)
    now = dt.datetime.now(dt.timezone.utc)
    for k, (trial_id, family, state, acc, tput) in enumerate(trials):  # the same trials, now with intervals
        store.add_trial({**_row(trial_id, family, state, acc, tput, k, now), "val_acc_low": acc - 0.01,
                         "val_acc_high": acc + 0.01, "throughput_low": tput * 0.9, "throughput_high": tput * 1.1}, _config(k))
    store.flush()
    report = write_report(tmp_path / "s", out=tmp_path / "r.html")
    text = report.html.read_text()
    assert "val_acc 95%" in text and "throughput 95%" in text and "<td>0.9000-0.9200</td>" in text
    table = text[text.index('class="front-table"'):text.index("</table>", text.index('class="front-table"'))]
    assert "<td>b1</td>" in table and "<td>b0</td>" in table  # tied, both shown ...
    assert table.count("<td>b0</td>") == 2  # ... b1 lists b0 as tied with it (and b0 itself is a row)
    red = tuple(int(TIED_COLOR[i:i + 2], 16) for i in (1, 3, 5))
    with Image.open(report.png) as png:
        rgb = np.asarray(png.convert("RGB")).astype(int)
    near = (np.abs(rgb - np.array(red)).sum(axis=2) < 40).sum()
    assert near > 200  # the tied members' rings and the legend's


def test_report_cli(study, tmp_path, capsys):
    assert main(["report", str(study), "--out", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "r.html" in out and "r-front.png" in out and (tmp_path / "r-front.png").is_file()
    assert main(["report", str(tmp_path / "missing")]) == 2


# -- in a real browser --------------------------------------------------------------------
def _artifact(path: Path, request) -> Path:
    folder = Path(os.environ.get("LOCALITY_SEARCH_ARTIFACTS", Path(tempfile.gettempdir()) / "locality-search-artifacts"))
    folder.mkdir(parents=True, exist_ok=True)
    kept = folder / path.name
    shutil.copyfile(path, kept)
    request.node.user_properties.append(("screenshot", str(kept)))
    print(f"screenshot: {kept}")
    return kept


@pytest.fixture(scope="module")
def browser():
    try:
        b = Browser(width=1400, height=1500)
    except BrowserError as exc:
        pytest.skip(f"chromium would not start here: {exc}")
    b.call("Network.enable")
    yield b
    b.close()


@pytest.mark.chromium
def test_page_draws_the_store_updates_live_and_shows_a_clicked_trial(tmp_path, serve, browser, request):
    store = make_study(tmp_path / "fixture")
    make_study(tmp_path / "other", name="other", trials=[("b0", "gmm", "COMPLETE", 0.88, 3000.0),
                                                          ("b1", "gmm", "COMPLETE", 0.70, 4500.0)])
    server = serve([tmp_path / "fixture", tmp_path / "other"])
    loader = browser.navigate(server.url + "?poll=200")
    browser.wait_for("window.__dashboard && window.__dashboard.renders >= 1")
    # unchanged files: the polls get 304 and nothing is redrawn
    browser.wait_for("__dashboard.polls >= 4")
    assert browser.evaluate("__dashboard.renders") == 1
    plotted = set(browser.evaluate("__dashboard.plottedIds()"))
    # every trial with both values: COMPLETE and the cut-short PRUNED one; not FAILED/REJECTED
    assert plotted == {"a0", "a1", "a2", "a3", "a4", "b0", "b1"}
    assert set(browser.evaluate("__dashboard.frontIds()")) == {"a0", "a1", "a3", "b0", "b1"}
    legend = browser.evaluate("document.getElementById('legend').textContent")
    assert "fixture front" in legend and "other front" in legend  # two folders: two fronts compared
    assert browser.evaluate("__dashboard.rows") == len(TRIALS) + 2

    # a new trial, written atomically by the store as during a run, appears without a reload
    browser.evaluate("window.__sameDocument = true")
    _add_trial(store, "live1", 0.97, 4800.0)
    browser.wait_for("__dashboard.plottedIds().includes('live1')", timeout=15)
    assert browser.evaluate("window.__sameDocument === true")  # no reload happened
    assert browser.evaluate("__dashboard.frontIds().includes('live1')")  # it beats a1 and a3

    # a click on a point shows its config and the command that exports it
    x, y = browser.evaluate("__dashboard.pointPosition('a1')")
    for kind in ("mousePressed", "mouseReleased"):
        browser.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
    command = browser.wait_for("document.getElementById('export-cmd') && document.getElementById('export-cmd').textContent")
    assert "--where \"trial_id=='a1'\" --export best.yaml" in command and str(tmp_path / "fixture") in command
    details = browser.evaluate("document.getElementById('details').textContent")
    assert "locality_strength" in details and "COMPLETE" in details

    # sorting: a click on the val_acc header flips the order
    browser.evaluate("document.querySelector('#trials th[data-key=val_acc]').click()")
    first = browser.evaluate("document.querySelector('#trials tbody tr.row td.mono').textContent")
    assert first == "b1"  # ascending now: the least accurate first (0.70)

    shot = browser.screenshot(tmp_path / "dashboard-live.png")
    assert shot.stat().st_size > 10_000
    _artifact(shot, request)
    # the page fetched nothing but its own server (no CDN, fonts or analytics)
    urls = browser.requests(loader)
    assert urls and all(u.startswith(server.url) for u in urls), urls


@pytest.mark.chromium
def test_report_opens_offline_in_the_browser(tmp_path, browser, request):
    make_study(tmp_path / "fixture")
    report = write_report(tmp_path / "fixture", out=tmp_path / "report.html")
    loader = browser.navigate(report.html.as_uri())
    browser.wait_for("window.__dashboard && window.__dashboard.renders >= 1")
    assert set(browser.evaluate("__dashboard.frontIds()")) == {"a0", "a1", "a3"}
    assert browser.evaluate("document.getElementById('live').textContent").startswith("static report")
    time.sleep(0.3)
    urls = browser.requests(loader)
    assert urls and all(u.startswith(("file:", "data:")) for u in urls), [u[:80] for u in urls]
    _artifact(browser.screenshot(tmp_path / "report-page.png"), request)


def test_ray_dashboard_warning_unless_token_auth(monkeypatch):
    import io

    import search.study.cluster as cluster

    def notes(host: str, token: bool) -> str:
        monkeypatch.setattr(cluster, "ray_token_auth_enabled", lambda: token)
        out = io.StringIO()
        cluster.dashboard_notes(host, f"{host}:8265", out)
        return out.getvalue()

    assert "WITHOUT authentication" in notes("0.0.0.0", token=False)
    assert notes("127.0.0.1", token=False) == ""
    assert "ray get-auth-token" in notes("0.0.0.0", token=True) and "WITHOUT" not in notes("0.0.0.0", token=True)
    with pytest.raises(ConfigError, match="--address"):
        cluster.check_dashboard_host("0.0.0.0", allow_remote=True, address="10.0.0.5:6379")
    cluster.check_dashboard_host("0.0.0.0", allow_remote=True, address=None)  # allowed with the flag
