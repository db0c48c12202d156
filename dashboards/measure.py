"""Time the Pareto page and the report on a synthetic study (10,000 trials by default).

    ./with-deps python -m dashboards.measure [--trials 10000] [--repeats 3] [--out DIR]

Measured, not asserted (tests must not depend on a machine's speed):

- first render: in headless Chromium, ``performance.now()`` (ms since the navigation started)
  when the page has fetched the JSON, parsed it and drawn every view (``firstRenderMs``), and
  when that frame was on screen (``firstFrameMs``, two animation frames later); a fresh browser
  profile each time, so nothing is cached;
- the JSON endpoint: building the payload from the Parquet files (the server caches it until a
  file changes; a 2-second poll of an unchanged study is a 304);
- the report: ``write_report`` end to end (read, front, PNG, HTML).

Targets (issue 6): first render < 2 s, report < 5 s at 10,000 trials. Prints the numbers and
writes them, with the environment, to ``benchmarks/results/dashboard_render-<device>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks._env import write_result
from dashboards.browser import Browser, find_chromium
from dashboards.synthetic import synthetic_study
from search.views.dashboard.server import make_server, studies_payload
from search.views.report import write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="folder for the study, report and screenshot (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="ls-measure-"))
    study = synthetic_study(work / "synthetic", trials=args.trials)
    out: dict = {"trials": args.trials}

    payload_s = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        body = json.dumps(studies_payload([study]), separators=(",", ":"), allow_nan=False)
        payload_s.append(time.perf_counter() - t)
    out["json_build_s"] = statistics.median(payload_s)
    out["json_bytes"] = len(body)

    report_s = []
    for _ in range(args.repeats):
        report = write_report(study, out=work / "report.html")
        report_s.append(report.seconds)
    out["report_s"] = statistics.median(report_s)
    out["report_bytes"] = report.html.stat().st_size

    if find_chromium():
        server = make_server([study], port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        renders, frames, draws = [], [], []
        for k in range(args.repeats):
            with Browser(width=1400, height=1500) as browser:  # fresh profile: nothing cached
                browser.navigate(server.url)
                browser.wait_for("window.__dashboard && window.__dashboard.firstFrameMs", timeout=60)
                timing = browser.evaluate("({first: __dashboard.firstRenderMs, frame: __dashboard.firstFrameMs, draw: __dashboard.lastRenderMs})")
                renders.append(timing["first"])
                frames.append(timing["frame"])
                draws.append(timing["draw"])
                if k == 0:
                    browser.screenshot(work / "page-10k.png")
        server.shutdown()
        out.update(first_render_ms=statistics.median(renders), first_frame_ms=statistics.median(frames),
                   draw_ms=statistics.median(draws), first_render_all_ms=renders, chromium=find_chromium())
    else:
        out["first_render_ms"] = None

    for key, value in out.items():
        print(f"{key:>22}: {value}")
    print(f"{'files':>22}: {work}")
    print(f"wrote {write_result('dashboard_render', out)}")


if __name__ == "__main__":
    main()
