// The Pareto page: plain JS, no library, no network access but the page's own api/data.
// Canvas for everything with many marks (10,000 trials draw in tens of milliseconds; SVG with
// 10,000 nodes would not), HTML for text. One `render()` redraws every view from `S`.
"use strict";
(function () {
  // How often the page asks for new data; `?poll=MS` (200 at least) changes it, e.g. for tests.
  const POLL_MS = Math.max(200, Number(new URLSearchParams(location.search).get("poll")) || 2000);
  // Tableau 10: distinguishable, colour-blind-aware; a family keeps its colour for the session.
  const FAMILY_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
  const STUDY_SHAPES = ["circle", "square", "triangle", "diamond", "star"];
  const STUDY_SYMBOLS = { circle: "\u25CF", square: "\u25A0", triangle: "\u25B2", diamond: "\u25C6", star: "\u2605" };
  const STUDY_LINES = ["#1f2328", "#8250df", "#0969da", "#bc4c00", "#1a7f37"];
  const DIMMED = "#d0d7de";
  const TIED_COLOR = "#d1242f";  // the ring of a front member tied with another (search/results/intervals.py)
  const CUT_SHORT = new Set(["PRUNED", "FAILED"]);
  const COLUMN_LABELS = {
    val_acc: "val_acc", throughput: "throughput (img/s)", val_loss: "val_loss", final_val_acc: "final_val_acc",
    params: "params", flops: "FLOPs", epochs_run: "epochs run", duration_s: "duration (s)",
  };
  const RESULT_NUMERIC = ["val_acc", "throughput", "val_loss", "final_val_acc", "params", "flops", "epochs_run", "duration_s"];
  const $ = (id) => document.getElementById(id);

  const S = {
    studies: [],          // decoded studies (see decodeStudy)
    familyColor: new Map(),
    selected: null,       // {label, id}: survives refreshes
    brushes: new Map(),   // axis key -> [lo, hi] in axis units 0 (bottom) .. 1 (top)
    sort: { key: "val_acc", dir: -1 },
    xKey: null, yKey: null,
    etag: null, lastOk: null, failingSince: null,
    importanceEtag: null, importance: null,  // api/importance: fetched after new data, its own ETag
    static: EMBEDDED_DATA !== null,
    generatedAt: null,
    scatterPts: null,     // hit-testing: {x, y, s, i} typed arrays
    tableRows: [],        // [s, i] pairs in table order
    parallel: null,       // geometry of the last parallel-coordinates draw
  };
  const hook = (window.__dashboard = {
    importanceRenders: 0,
    renders: 0, firstRenderMs: null, firstFrameMs: null, lastRenderMs: null, points: 0, rows: 0, polls: 0,
    ids: () => S.studies.flatMap((st) => st.cols.trial_id || []),
    plottedIds: () => (S.scatterPts ? Array.from(S.scatterPts.s, (s, k) => S.studies[s].cols.trial_id[S.scatterPts.i[k]]) : []),
    frontIds: () => S.studies.flatMap((st) => (st.raw.front || []).map((i) => st.cols.trial_id[i])),
    // Page coordinates of a trial's point on the scatter (tests click there like a user would).
    pointPosition: (id) => {
      const P = S.scatterPts; if (!P) return null;
      const r = $("scatter").getBoundingClientRect();
      for (let k = 0; k < P.x.length; k++) if (S.studies[P.s[k]].cols.trial_id[P.i[k]] === id) return [r.left + P.x[k], r.top + P.y[k]];
      return null;
    },
  });

  // -- formatting -------------------------------------------------------------------------
  function esc(v) {
    return String(v).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }
  function fmtNum(v, key) {
    if (v === null || v === undefined || v === "") return "";
    if (typeof v !== "number") return String(v);
    if (key === "throughput") return Math.round(v).toLocaleString("en-US");
    if (key === "params" || key === "flops") return v >= 1e9 ? (v / 1e9).toFixed(2) + "G" : (v / 1e6).toFixed(2) + "M";
    if (key === "val_acc" || key === "final_val_acc" || key === "val_loss" || key === "test_acc") return v.toFixed(4);
    if (key === "duration_s" || key === "elapsed_s") return fmtDuration(v);
    if (Number.isInteger(v)) return String(v);
    return Math.abs(v) >= 1e4 || Math.abs(v) < 1e-3 ? v.toExponential(2) : String(Number(v.toPrecision(3)));
  }
  function fmtDuration(s) {
    if (s === null || s === undefined) return "";
    s = Math.round(s);
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
    return (h ? h + ":" + String(m).padStart(2, "0") : String(m)) + ":" + String(sec).padStart(2, "0");
  }
  function fmtTick(v, span, step) {
    const a = Math.abs(v);
    if (a >= 1e6) return (v / 1e6).toPrecision(3).replace(/\.?0+$/, "") + "M";
    if (a >= 1e4) return Math.round(v).toLocaleString("en-US");
    if (step) { // as many decimals as the tick step has: 0, 2, 4 or 0.05, 0.10
      let d = 0;
      while (d < 6 && Math.abs(Math.round(step * 10 ** d) - step * 10 ** d) > 1e-6 * 10 ** d) d++;
      return v.toFixed(d);
    }
    const digits = Math.max(0, -Math.floor(Math.log10(span || 1)) + 1);
    return v.toFixed(Math.min(digits, 6));
  }
  function label(key) { return COLUMN_LABELS[key] || key; }
  function shellQuote(s) { return /^[\w@%+=:,./-]+$/.test(s) ? s : "'" + s.replace(/'/g, "'\"'\"'") + "'"; }

  // -- data -------------------------------------------------------------------------------
  function decodeColumn(c) {
    if (c && !Array.isArray(c) && c.dict) { const d = c.dict; return c.codes.map((k) => (k === null ? null : d[k])); }
    return c;
  }
  function decodeStudy(raw, index) {
    const st = { raw, index, label: raw.label, n: raw.n || 0, cols: {}, knobs: raw.knobs || [], objectives: raw.objectives || [] };
    for (const [k, v] of Object.entries(raw.columns || {})) st.cols[k] = decodeColumn(v);
    st.onFront = new Uint8Array(st.n);
    for (const r of raw.front || []) st.onFront[r] = 1;
    st.progress = raw.progress ? Object.fromEntries(Object.entries(raw.progress).map(([k, v]) => [k, decodeColumn(v)])) : null;
    st.shape = STUDY_SHAPES[index % STUDY_SHAPES.length];
    st.line = STUDY_LINES[index % STUDY_LINES.length];
    return st;
  }
  const val = (st, key, i) => { const c = st.cols[key]; return c ? c[i] : null; };
  const famColor = (f) => S.familyColor.get(f) || "#6e7781";

  function ingest(data) {
    S.generatedAt = data.generated_at;
    S.studies = (data.studies || []).map(decodeStudy);
    // Families get colours in name order (as in the report's PNG); one that appears later takes
    // the next free colour, so no point changes colour while the page is open.
    const fams = new Set();
    for (const st of S.studies) for (const f of st.cols.family || []) if (f !== null) fams.add(f);
    for (const f of [...fams].sort()) if (!S.familyColor.has(f)) S.familyColor.set(f, FAMILY_COLORS[S.familyColor.size % FAMILY_COLORS.length]);
    setupAxisChoices();
    render();
  }

  function numericKeys() {
    const keys = [];
    const has = (k) => S.studies.some((st) => (st.cols[k] || []).some((v) => typeof v === "number"));
    for (const k of RESULT_NUMERIC) if (has(k)) keys.push(k);
    for (const st of S.studies) for (const kn of st.knobs) if (kn.type !== "choice" && !keys.includes(kn.name) && has(kn.name)) keys.push(kn.name);
    return keys;
  }
  function setupAxisChoices() {
    const first = S.studies.find((st) => st.objectives.length) || { objectives: [["val_acc", "max"], ["throughput", "max"]] };
    const objs = first.objectives.map((o) => o[0]);
    if (S.yKey === null) S.yKey = objs[0] || "val_acc";
    if (S.xKey === null) S.xKey = objs[1] || "throughput";
    const keys = numericKeys();
    for (const k of [S.xKey, S.yKey]) if (!keys.includes(k)) keys.unshift(k);
    for (const [id, cur] of [["x-axis", S.xKey], ["y-axis", S.yKey]]) {
      const sel = $(id);
      const want = keys.join("|");
      if (sel.dataset.keys !== want) {
        sel.innerHTML = keys.map((k) => `<option value="${esc(k)}">${esc(label(k))}</option>`).join("");
        sel.dataset.keys = want;
      }
      sel.value = cur;
    }
    const states = new Set();
    for (const st of S.studies) for (const v of st.cols.state || []) states.add(v);
    const sf = $("state-filter"), want = [...states].sort().join("|");
    if (sf.dataset.keys !== want) {
      const cur = sf.value;
      sf.innerHTML = '<option value="">all</option>' + [...states].sort().map((v) => `<option>${esc(v)}</option>`).join("");
      sf.dataset.keys = want; sf.value = states.has(cur) ? cur : "";
    }
  }

  // Brushes from the parallel coordinates filter every view.
  function passes(st, i) {
    for (const [key, [lo, hi]] of S.brushes) {
      const ax = S.parallel && S.parallel.axes.find((a) => a.key === key);
      if (!ax) continue;
      const t = ax.t(val(st, key, i));
      if (t === null || t === NA || t < lo || t > hi) return false;
    }
    return true;
  }
  function selectedRow() {
    if (!S.selected) return null;
    const s = S.studies.findIndex((st) => st.label === S.selected.label);
    if (s < 0) return null;
    const i = (S.studies[s].cols.trial_id || []).indexOf(S.selected.id);
    return i < 0 ? null : [s, i];
  }
  function select(s, i, from) {
    S.selected = s === null ? null : { label: S.studies[s].label, id: S.studies[s].cols.trial_id[i] };
    renderScatter(); renderParallel(); renderDetails(); renderTable(from !== "table");
  }

  // -- scales -----------------------------------------------------------------------------
  function niceTicks(lo, hi, n) {
    const span = hi - lo;
    if (!(span > 0)) return [lo];
    let step = Math.pow(10, Math.floor(Math.log10(span / n)));
    const err = (n / span) * step;
    if (err <= 0.15) step *= 10; else if (err <= 0.35) step *= 5; else if (err <= 0.75) step *= 2;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }
  function logTicks(lo, hi) {
    const out = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++)
      for (const m of [1, 2, 5]) { const v = m * Math.pow(10, e); if (v >= lo && v <= hi) out.push(v); }
    return out.length >= 2 ? out : [lo, hi];
  }
  function scale(lo, hi, a, b, log) {
    if (log) { lo = Math.max(lo, 1e-300); hi = Math.max(hi, lo * 1.0001); }
    const f = log ? Math.log10 : (v) => v;
    let l = f(lo), h = f(hi);
    if (!(h > l)) { const pad = Math.abs(l) * 0.05 || 0.5; l -= pad; h += pad; lo = log ? Math.pow(10, l) : l; hi = log ? Math.pow(10, h) : h; }
    const s = (v) => a + ((f(v) - l) / (h - l)) * (b - a);
    s.ticks = (n) => (log ? logTicks(lo, hi) : niceTicks(lo, hi, n));
    s.lo = lo; s.hi = hi; s.log = log;
    return s;
  }
  function extent(values, log) {
    let lo = Infinity, hi = -Infinity;
    for (const v of values) if (typeof v === "number" && isFinite(v) && (!log || v > 0)) { if (v < lo) lo = v; if (v > hi) hi = v; }
    return lo <= hi ? [lo, hi] : null;
  }
  function canvas(cv) {
    const dpr = window.devicePixelRatio || 1, w = cv.clientWidth, h = cv.clientHeight;
    if (cv.width !== Math.round(w * dpr) || cv.height !== Math.round(h * dpr)) { cv.width = Math.round(w * dpr); cv.height = Math.round(h * dpr); }
    const ctx = cv.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    ctx.font = "11px system-ui, sans-serif";
    return { ctx, w, h };
  }
  function message(ctx, w, h, text) {
    ctx.fillStyle = "#59636e"; ctx.font = "13px system-ui, sans-serif"; ctx.textAlign = "center";
    ctx.fillText(text, w / 2, h / 2); ctx.textAlign = "left";
  }
  function marker(ctx, shape, x, y, r) {
    switch (shape) {
      case "square": ctx.rect(x - r * 0.85, y - r * 0.85, r * 1.7, r * 1.7); break;
      case "triangle": ctx.moveTo(x, y - r * 1.1); ctx.lineTo(x + r, y + r * 0.75); ctx.lineTo(x - r, y + r * 0.75); ctx.closePath(); break;
      case "diamond": ctx.moveTo(x, y - r * 1.2); ctx.lineTo(x + r, y); ctx.lineTo(x, y + r * 1.2); ctx.lineTo(x - r, y); ctx.closePath(); break;
      case "star": for (let k = 0; k < 10; k++) { const a = -Math.PI / 2 + (k * Math.PI) / 5, rr = k % 2 ? r * 0.5 : r * 1.2; k ? ctx.lineTo(x + rr * Math.cos(a), y + rr * Math.sin(a)) : ctx.moveTo(x + rr * Math.cos(a), y + rr * Math.sin(a)); } ctx.closePath(); break;
      default: ctx.moveTo(x + r, y); ctx.arc(x, y, r, 0, 2 * Math.PI);
    }
  }
  function axes(ctx, sx, sy, box, xKey, yKey) {
    const { l, r, t, b } = box;
    ctx.strokeStyle = "#eef1f4"; ctx.fillStyle = "#59636e"; ctx.lineWidth = 1;
    ctx.textAlign = "center"; ctx.textBaseline = "top";
    const xt = sx.ticks(Math.max(2, Math.floor((r - l) / 90)));
    const cw = ctx.canvas.clientWidth, xstep = sx.log || xt.length < 2 ? 0 : xt[1] - xt[0];
    for (const v of xt) {
      const x = Math.round(sx(v)) + 0.5, text = fmtTick(v, sx.hi - sx.lo, xstep), half = ctx.measureText(text).width / 2;
      ctx.beginPath(); ctx.moveTo(x, t); ctx.lineTo(x, b); ctx.stroke();
      ctx.fillText(text, Math.min(x, cw - half - 1), b + 4);
    }
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    const yt = sy.ticks(Math.max(2, Math.floor((b - t) / 50))), ystep = sy.log || yt.length < 2 ? 0 : yt[1] - yt[0];
    for (const v of yt) { const y = Math.round(sy(v)) + 0.5; ctx.beginPath(); ctx.moveTo(l, y); ctx.lineTo(r, y); ctx.stroke(); ctx.fillText(fmtTick(v, sy.hi - sy.lo, ystep), l - 5, y); }
    ctx.strokeStyle = "#8c959f"; ctx.beginPath(); ctx.moveTo(l + 0.5, t); ctx.lineTo(l + 0.5, b + 0.5); ctx.lineTo(r, b + 0.5); ctx.stroke();
    ctx.fillStyle = "#1f2328"; ctx.font = "12px system-ui, sans-serif";
    ctx.textAlign = "center"; ctx.textBaseline = "bottom"; ctx.fillText(xKey, (l + r) / 2, b + 36);
    ctx.save(); ctx.translate(14, (t + b) / 2); ctx.rotate(-Math.PI / 2); ctx.textBaseline = "middle"; ctx.fillText(yKey, 0, 0); ctx.restore();
    ctx.textAlign = "left"; ctx.textBaseline = "alphabetic"; ctx.font = "11px system-ui, sans-serif";
  }
  function modeOf(key) {
    for (const st of S.studies) for (const [c, m] of st.objectives) if (c === key) return m;
    return null;
  }
  function axisTitle(key) {
    const m = modeOf(key);
    return label(key) + (m === "max" ? "  (higher is better)" : m === "min" ? "  (lower is better)" : "");
  }

  // -- scatter ----------------------------------------------------------------------------
  function renderScatter() {
    const cv = $("scatter"), { ctx, w, h } = canvas(cv);
    const xKey = S.xKey, yKey = S.yKey, logX = $("log-x").checked, showCut = $("show-cut").checked;
    $("scatter-title").textContent = `${label(yKey)} vs ${label(xKey)}`;
    const box = { l: 62, r: w - 14, t: 10, b: h - 42 };
    const xs = [], ys = [], ss = [], is = [];
    let rejected = 0, hiddenCut = 0, missing = 0;
    S.studies.forEach((st, s) => {
      const state = st.cols.state || [];
      for (let i = 0; i < st.n; i++) {
        const x = val(st, xKey, i), y = val(st, yKey, i);
        if (state[i] === "REJECTED") { rejected++; continue; }
        if (typeof x !== "number" || typeof y !== "number" || (logX && x <= 0)) { missing++; continue; }
        if (!showCut && CUT_SHORT.has(state[i])) { hiddenCut++; continue; }
        xs.push(x); ys.push(y); ss.push(s); is.push(i);
      }
    });
    S.scatterPts = null;
    hook.points = xs.length;
    renderLegend(rejected, hiddenCut, missing);
    if (!xs.length) { message(ctx, w, h, S.studies.some((st) => st.n) ? "no trial has both values yet" : "waiting for the first finished trial…"); return; }
    const ex = extent(xs, logX), ey = extent(ys, false);
    const padX = logX ? 0 : (ex[1] - ex[0]) * 0.04 || Math.abs(ex[0]) * 0.05 || 1, padY = (ey[1] - ey[0]) * 0.06 || Math.abs(ey[0]) * 0.05 || 0.01;
    const sx = logX ? scale(ex[0] / 1.08, ex[1] * 1.08, box.l, box.r, true) : scale(ex[0] - padX, ex[1] + padX, box.l, box.r, false);
    const sy = scale(ey[0] - padY, ey[1] + padY, box.b, box.t, false);
    axes(ctx, sx, sy, box, axisTitle(xKey), axisTitle(yKey));
    const n = xs.length;
    const px = new Float32Array(n), py = new Float32Array(n), ps = new Int32Array(n), pi = new Int32Array(n);
    for (let k = 0; k < n; k++) { px[k] = sx(xs[k]); py[k] = sy(ys[k]); ps[k] = ss[k]; pi[k] = is[k]; }
    S.scatterPts = { x: px, y: py, s: ps, i: pi };
    const r = n > 3000 ? 2.2 : n > 500 ? 3 : 4;
    // Batches by (study shape, colour, kind): one fill or stroke per batch keeps 10,000 points fast.
    const groups = new Map();
    const add = (key, k) => { let g = groups.get(key); if (!g) groups.set(key, (g = [])); g.push(k); };
    const filtering = S.brushes.size > 0;
    for (let k = 0; k < n; k++) {
      const st = S.studies[ps[k]], i = pi[k], state = st.cols.state[i];
      const kind = filtering && !passes(st, i) ? "dim" : CUT_SHORT.has(state) ? "cut" : "done";
      add(`${kind}|${st.shape}|${kind === "dim" ? DIMMED : famColor(val(st, "family", i))}`, k);
    }
    const order = ["dim", "cut", "done"];
    for (const kind of order) for (const [key, ks] of groups) {
      const [kd, shape, color] = key.split("|");
      if (kd !== kind) continue;
      ctx.beginPath();
      for (const k of ks) marker(ctx, shape, px[k], py[k], kind === "cut" ? r * 0.9 : r);
      if (kind === "cut") { ctx.globalAlpha = 0.7; ctx.strokeStyle = color; ctx.lineWidth = 1.2; ctx.stroke(); }
      else { ctx.globalAlpha = kind === "dim" ? 0.6 : 0.8; ctx.fillStyle = color; ctx.fill(); }
      ctx.globalAlpha = 1;
    }
    // Each study's front: a staircase (the boundary of what it dominates) when the axes are its two objectives.
    S.studies.forEach((st, s) => {
      const objs = st.objectives.map((o) => o[0]);
      const front = (st.raw.front || []).filter((i) => typeof val(st, xKey, i) === "number" && typeof val(st, yKey, i) === "number" && (!logX || val(st, xKey, i) > 0));
      if (!front.length) return;
      if (objs.length === 2 && objs.includes(xKey) && objs.includes(yKey)) {
        const sgx = modeOf(xKey) === "min" ? -1 : 1, sgy = modeOf(yKey) === "min" ? -1 : 1;
        const pts = front.map((i) => [val(st, xKey, i), val(st, yKey, i)]).sort((a, b) => sgx * a[0] - sgx * b[0]);
        ctx.beginPath(); ctx.strokeStyle = st.line; ctx.lineWidth = 1.5; ctx.globalAlpha = 0.85;
        if (S.studies.length > 1) ctx.setLineDash([6, 3 * s]);
        // The boundary of the region the front dominates: in from the x-worst edge at the best-y
        // trial's height, down and across from trial to trial, then to the y-worst edge.
        ctx.moveTo(sgx > 0 ? box.l : box.r, sy(pts[0][1]));
        ctx.lineTo(sx(pts[0][0]), sy(pts[0][1]));
        for (let k = 1; k < pts.length; k++) { ctx.lineTo(sx(pts[k - 1][0]), sy(pts[k][1])); ctx.lineTo(sx(pts[k][0]), sy(pts[k][1])); }
        ctx.lineTo(sx(pts[pts.length - 1][0]), sgy > 0 ? box.b : box.t);
        ctx.stroke(); ctx.setLineDash([]); ctx.globalAlpha = 1;
      }
      // each member's 95% intervals (val_acc_low/high, throughput_low/high) as error bars, under the markers
      const bound = (key, end, i) => { const v = val(st, `${key}_${end}`, i); return typeof v === "number" && (!logX || key !== xKey || v > 0) ? v : null; };
      ctx.strokeStyle = "#8c959f"; ctx.lineWidth = 1;
      for (const i of front) {
        const x = sx(val(st, xKey, i)), y = sy(val(st, yKey, i));
        const [xl, xh, yl, yh] = [bound(xKey, "low", i), bound(xKey, "high", i), bound(yKey, "low", i), bound(yKey, "high", i)];
        ctx.beginPath();
        if (xl !== null && xh !== null) { ctx.moveTo(sx(xl), y); ctx.lineTo(sx(xh), y); for (const e of [xl, xh]) { ctx.moveTo(sx(e), y - 4); ctx.lineTo(sx(e), y + 4); } }
        if (yl !== null && yh !== null) { ctx.moveTo(x, sy(yl)); ctx.lineTo(x, sy(yh)); for (const e of [yl, yh]) { ctx.moveTo(x - 4, sy(e)); ctx.lineTo(x + 4, sy(e)); } }
        ctx.stroke();
      }
      for (const i of front) {
        const tied = typeof val(st, "tied_with", i) === "string" && val(st, "tied_with", i) !== "";
        ctx.beginPath(); marker(ctx, st.shape, sx(val(st, xKey, i)), sy(val(st, yKey, i)), r + 2.5);
        ctx.fillStyle = famColor(val(st, "family", i)); ctx.fill();
        ctx.lineWidth = tied ? 2.4 : 1.6; ctx.strokeStyle = tied ? TIED_COLOR : st.line; ctx.stroke();
      }
    });
    const sel = selectedRow();
    if (sel) {
      const st = S.studies[sel[0]], x = val(st, xKey, sel[1]), y = val(st, yKey, sel[1]);
      if (typeof x === "number" && typeof y === "number" && (!logX || x > 0)) {
        const cx = sx(x), cy = sy(y);
        ctx.strokeStyle = "#0969da"; ctx.lineWidth = 2; ctx.beginPath(); ctx.arc(cx, cy, r + 7, 0, 2 * Math.PI); ctx.stroke();
        ctx.setLineDash([3, 3]); ctx.lineWidth = 1; ctx.beginPath(); ctx.moveTo(cx, box.b); ctx.lineTo(cx, cy + r + 7); ctx.moveTo(box.l, cy); ctx.lineTo(cx - r - 7, cy); ctx.stroke(); ctx.setLineDash([]);
      }
    }
  }
  function nearestPoint(mx, my, radius) {
    const P = S.scatterPts;
    if (!P) return -1;
    let best = -1, bd = radius * radius;
    for (let k = 0; k < P.x.length; k++) {
      const dx = P.x[k] - mx, dy = P.y[k] - my, d = dx * dx + dy * dy;
      // ties go to front trials, which are drawn on top
      if (d < bd || (d === bd && best >= 0 && S.studies[P.s[k]].onFront[P.i[k]])) { bd = d; best = k; }
    }
    return best;
  }
  function renderLegend(rejected, hiddenCut, missing) {
    const parts = [];
    for (const [f, c] of S.familyColor) parts.push(`<span><span class="sw" style="background:${c}"></span>${esc(f)}</span>`);
    parts.push(`<span><span class="sw hollow" style="border-color:#6e7781"></span>cut short (PRUNED / FAILED)</span>`);
    if (S.studies.length > 1) {
      for (const st of S.studies) parts.push(`<span><span class="sym" style="color:${st.line}">${STUDY_SYMBOLS[st.shape]}</span> <span class="line" style="border-color:${st.line}"></span>${esc(st.label)} front</span>`);
    } else parts.push(`<span><span class="line"></span>Pareto front (COMPLETE trials only; bars: 95% intervals)</span>`);
    parts.push(`<span><span class="sym" style="color:${TIED_COLOR}">\u25CB</span> tied on the front: intervals overlap on every objective</span>`);
    const notes = [];
    if (rejected) notes.push(`${rejected} REJECTED (never trained)`);
    if (hiddenCut) notes.push(`${hiddenCut} cut short`);
    if (missing) notes.push(`${missing} without both values`);
    if (notes.length) parts.push(`<span>not plotted: ${notes.join(", ")}</span>`);
    $("legend").innerHTML = parts.join("");
  }

  // -- hypervolume ------------------------------------------------------------------------
  function renderHV() {
    const cv = $("hv"), { ctx, w, h } = canvas(cv);
    const xKey = $("hv-x").value;
    const series = S.studies.filter((st) => st.progress && st.progress.hypervolume && st.progress.hypervolume.some((v) => typeof v === "number"));
    const refs = S.studies.map((st) => JSON.stringify(st.raw.reference_point));
    let note = "";
    if (!series.length) {
      const old = S.studies.some((st) => st.n && !st.progress);
      message(ctx, w, h, old ? "no progress.parquet in this study (written by newer runs)" : S.studies.some((st) => st.progress && st.progress.finished && st.progress.finished.length) ? "no hypervolume: the spec gives no reference point" : "waiting for the first finished trial…");
      $("hv-note").textContent = "";
      return;
    }
    if (S.studies.length > 1 && new Set(refs).size > 1) note = "The studies' reference points differ, so their hypervolumes are not comparable (python -m search compare uses a shared one). ";
    const first = series[0].raw.reference_point;
    note += first ? `Reference point ${series[0].objectives.map((o, k) => `${o[0]} ${fmtNum(first[k], o[0])}`).join(", ")}.` : "";
    $("hv-note").textContent = note;
    const allX = [], allY = [];
    for (const st of series) { allX.push(...st.progress[xKey]); allY.push(...st.progress.hypervolume); }
    const ex = extent(allX, false) || [0, 1], ey = extent(allY, false) || [0, 1];
    const box = { l: 62, r: w - 12, t: 8, b: h - 40 };
    const sx = scale(Math.min(0, ex[0]), ex[1] || 1, box.l, box.r, false), sy = scale(0, ey[1] * 1.08 || 1, box.b, box.t, false);
    axes(ctx, sx, sy, box, { finished: "trials finished", epochs_spent: "epochs spent", elapsed_s: "elapsed (s)" }[xKey], "hypervolume");
    for (const st of series) {
      const xs = st.progress[xKey], ys = st.progress.hypervolume;
      ctx.beginPath(); ctx.strokeStyle = S.studies.length > 1 ? st.line : "#0969da"; ctx.lineWidth = 1.8;
      let started = false, lastY = null;
      for (let k = 0; k < xs.length; k++) {
        if (typeof xs[k] !== "number" || typeof ys[k] !== "number") continue;
        const x = sx(xs[k]), y = sy(ys[k]);
        if (!started) { ctx.moveTo(x, y); started = true; } else { ctx.lineTo(x, lastY); ctx.lineTo(x, y); }
        lastY = y;
      }
      ctx.stroke();
      const last = ys.length - 1;
      if (typeof ys[last] === "number") { ctx.fillStyle = ctx.strokeStyle; ctx.fillText(fmtTick(ys[last], ey[1]), Math.min(sx(xs[last]) + 4, box.r - 40), sy(ys[last]) - 4); }
    }
  }

  // -- parallel coordinates ---------------------------------------------------------------
  const NA = -1, NA_GAP = 18;
  function parallelAxes(w, h) {
    const top = 42, bottom = h - 26 - NA_GAP, keys = [];
    const knobs = new Map();
    for (const st of S.studies) for (const kn of st.knobs) {
      const k = knobs.get(kn.name);
      if (!k) knobs.set(kn.name, { ...kn, values: kn.values ? [...kn.values] : null });
      else if (kn.type !== "choice" && k.type !== "choice") { k.low = Math.min(k.low ?? Infinity, kn.low ?? Infinity); k.high = Math.max(k.high ?? -Infinity, kn.high ?? -Infinity); }
    }
    for (const kn of knobs.values()) keys.push({ key: kn.name, knob: kn });
    const objs = [];
    for (const st of S.studies) for (const [c] of st.objectives) if (!objs.includes(c)) objs.push(c);
    for (const c of objs) if (!knobs.has(c)) keys.push({ key: c, knob: null, objective: true });
    const n = keys.length, left = 70, right = w - 70;
    const axes = keys.map((a, k) => {
      const x = n === 1 ? (left + right) / 2 : left + ((right - left) * k) / (n - 1);
      const values = S.studies.flatMap((st) => st.cols[a.key] || []);
      let t, ticks = [], cats = null;
      const numeric = a.knob ? a.knob.type !== "choice" : true;
      if (numeric && values.some((v) => typeof v === "number")) {
        const log = !!(a.knob && a.knob.log);
        const ex = extent(values, log) || [0, 1];
        const lo = a.knob && typeof a.knob.low === "number" ? Math.min(a.knob.low, ex[0]) : ex[0];
        const hi = a.knob && typeof a.knob.high === "number" ? Math.max(a.knob.high, ex[1]) : ex[1];
        const s = scale(lo, hi, 0, 1, log && lo > 0);
        t = (v) => (typeof v === "number" && (!s.log || v > 0) ? Math.min(1, Math.max(0, s(v))) : null);
        const tick = (v) => (a.knob && a.knob.type === "int" ? String(Math.round(v)) : fmtTick(v, s.hi - s.lo));
        ticks = [[0, tick(s.lo)], [1, tick(s.hi)]];
      } else {
        cats = (a.knob && a.knob.values ? a.knob.values.map(String) : []);
        for (const v of values) if (v !== null && v !== undefined && !cats.includes(String(v))) cats.push(String(v));
        const K = Math.max(cats.length, 1);
        t = (v) => { if (v === null || v === undefined) return null; const c = cats.indexOf(String(v)); return c < 0 ? null : K === 1 ? 0.5 : c / (K - 1); };
        ticks = cats.length <= 10 ? cats.map((c, k) => [K === 1 ? 0.5 : k / (K - 1), c]) : [[0, cats[0]], [1, cats[K - 1]]];
      }
      // A knob another model owns is null in this trial's row (conditional space): such values
      // go to an "n/a" slot under the axis, so every trial stays one unbroken line.
      const hasNull = S.studies.some((st) => st.n && (!st.cols[a.key] || st.cols[a.key].some((v) => v === null || v === undefined)));
      return { ...a, x, t: hasNull ? (v) => { const r = t(v); return r === null ? NA : r; } : t, ticks, cats, hasNull,
        y: (tt) => (tt === NA ? bottom + NA_GAP : bottom - tt * (bottom - top)) };
    });
    return { axes, top, bottom };
  }
  function renderParallel() {
    const cv = $("parallel"), { ctx, w, h } = canvas(cv);
    const total = S.studies.reduce((a, st) => a + st.n, 0);
    if (!total) { S.parallel = null; message(ctx, w, h, "waiting for the first finished trial…"); return; }
    const P = parallelAxes(w, h);
    S.parallel = P;
    const { axes: AX } = P;
    const alpha = total > 3000 ? 0.1 : total > 500 ? 0.22 : 0.45;
    const trace = (st, i) => {
      let pen = false;
      for (const ax of AX) {
        const t = ax.t(val(st, ax.key, i));
        if (t === null) { pen = false; continue; }
        const y = ax.y(t);
        if (pen) ctx.lineTo(ax.x, y); else { ctx.moveTo(ax.x, y); pen = true; }
      }
    };
    // Batched like the scatter: dimmed (filtered out), cut short, finished, front, selected.
    const groups = new Map();
    const filtering = S.brushes.size > 0;
    S.studies.forEach((st, s) => {
      for (let i = 0; i < st.n; i++) {
        const state = st.cols.state[i];
        const kind = filtering && !passes(st, i) ? 0 : st.onFront[i] ? 3 : CUT_SHORT.has(state) || state === "REJECTED" ? 1 : 2;
        const key = kind + "|" + (kind === 0 ? DIMMED : famColor(val(st, "family", i)));
        let g = groups.get(key); if (!g) groups.set(key, (g = [])); g.push([s, i]);
      }
    });
    for (const kind of ["0", "1", "2", "3"]) for (const [key, rows] of groups) {
      const [kd, color] = key.split("|");
      if (kd !== kind) continue;
      ctx.beginPath();
      for (const [s, i] of rows) trace(S.studies[s], i);
      ctx.strokeStyle = color;
      ctx.lineWidth = kind === "3" ? 2.2 : 1;
      ctx.globalAlpha = kind === "3" ? 0.95 : kind === "0" ? 0.35 : kind === "1" ? alpha * 0.6 : alpha;
      ctx.stroke();
    }
    ctx.globalAlpha = 1;
    const sel = selectedRow();
    if (sel) { ctx.beginPath(); trace(S.studies[sel[0]], sel[1]); ctx.strokeStyle = "#0969da"; ctx.lineWidth = 3; ctx.stroke(); }
    // axes, labels, brushes. Many knobs make the axes close: names then alternate between two
    // rows, and every text is cut (with an ellipsis) to the room it has.
    const spacing = AX.length > 1 ? AX[1].x - AX[0].x : w;
    const title = (ax) => { const m = modeOf(ax.key); return ax.key + (ax.knob && ax.knob.log ? " (log)" : "") + (m ? (m === "max" ? " \u2191" : " \u2193") : ""); };
    ctx.font = "600 11px system-ui, sans-serif";
    const twoRows = AX.some((ax) => ctx.measureText(title(ax)).width > spacing - 8);
    const fit = (text, room) => {
      if (ctx.measureText(text).width <= room) return text;
      while (text.length > 1 && ctx.measureText(text + "\u2026").width > room) text = text.slice(0, -1);
      return text + "\u2026";
    };
    AX.forEach((ax, k) => {
      ctx.strokeStyle = "#57606a"; ctx.lineWidth = 1; ctx.beginPath(); ctx.moveTo(ax.x + 0.5, P.top); ctx.lineTo(ax.x + 0.5, P.bottom); ctx.stroke();
      const b = S.brushes.get(ax.key);
      if (b) { ctx.fillStyle = "rgba(9,105,218,0.18)"; ctx.strokeStyle = "#0969da"; const y1 = ax.y(b[1]), y0 = ax.y(b[0]); ctx.fillRect(ax.x - 8, y1, 16, y0 - y1); ctx.strokeRect(ax.x - 8 + 0.5, y1 + 0.5, 16, y0 - y1); }
      ctx.fillStyle = "#1f2328"; ctx.textAlign = "center"; ctx.font = "600 11px system-ui, sans-serif";
      const row = twoRows && k % 2 === 0 ? P.top - 26 : P.top - 12;
      const name = fit(title(ax), (twoRows ? 2 * spacing : spacing) - 8), half = ctx.measureText(name).width / 2;
      ctx.fillText(name, Math.min(Math.max(ax.x, half + 2), w - half - 2), row);
      ctx.font = "11px system-ui, sans-serif"; ctx.fillStyle = "#59636e";
      if (ax.hasNull) { ctx.fillText("n/a", ax.x, P.bottom + NA_GAP + 13); ctx.beginPath(); ctx.arc(ax.x, P.bottom + NA_GAP, 2.5, 0, 2 * Math.PI); ctx.fill(); }
      ctx.textAlign = "left"; ctx.textBaseline = "middle";
      for (const [tt, full] of ax.ticks) {
        const y = ax.y(tt), text = k === AX.length - 1 ? full : fit(full, spacing - 14);
        ctx.fillStyle = "rgba(255,255,255,0.85)"; const tw = ctx.measureText(text).width; ctx.fillRect(ax.x + 4, y - 6, tw + 2, 12);
        ctx.fillStyle = "#59636e"; ctx.fillText(text, ax.x + 5, y);
      }
      ctx.textBaseline = "alphabetic";
    });
    ctx.textAlign = "left";
    const shown = filtering ? S.studies.reduce((a, st) => { for (let i = 0; i < st.n; i++) if (passes(st, i)) a++; return a; }, 0) : total;
    $("filter-note").textContent = filtering ? `${shown.toLocaleString("en-US")} of ${total.toLocaleString("en-US")} trials pass the filters` : "";
    $("clear-brush").hidden = !filtering;
  }
  function parallelHit(mx, my) {
    // The trial whose line passes closest to (mx, my), between the two axes around mx.
    const P = S.parallel;
    if (!P) return null;
    const AX = P.axes;
    let k = 0;
    while (k < AX.length - 1 && AX[k + 1].x < mx) k++;
    const a = AX[k], b = AX[Math.min(k + 1, AX.length - 1)];
    const f = b.x === a.x ? 0 : Math.min(1, Math.max(0, (mx - a.x) / (b.x - a.x)));
    let best = null, bd = 6;
    S.studies.forEach((st, s) => {
      for (let i = 0; i < st.n; i++) {
        if (S.brushes.size && !passes(st, i)) continue;
        const ta = a.t(val(st, a.key, i)), tb = b.t(val(st, b.key, i));
        if (ta === null || tb === null) continue;
        const d = Math.abs(a.y(ta) + (b.y(tb) - a.y(ta)) * f - my);
        if (d < bd || (d === bd && st.onFront[i])) { bd = d; best = [s, i]; }
      }
    });
    return best;
  }

  // -- details ----------------------------------------------------------------------------
  function renderDetails() {
    const el = $("details"), sel = selectedRow();
    if (!sel) { el.innerHTML = '<p class="hint">Click a point, a line or a table row to see its config and the command that exports it.</p>'; return; }
    const [s, i] = sel, st = S.studies[s];
    const v = (k) => val(st, k, i);
    const table = (pairs) => "<table>" + pairs.map(([k, text]) => `<tr><td>${esc(k)}</td><td>${text}</td></tr>`).join("") + "</table>";
    const head = [];
    if (S.studies.length > 1) head.push(["study", esc(st.label)]);
    head.push(["trial", `<span class="mono">${esc(v("trial_id"))}</span>`]);
    head.push(["model", esc(v("model") || "") + (v("family") ? ` <span class="pill">${esc(v("family"))}</span>` : "")]);
    head.push(["state", `<span class="pill ${esc(v("state"))}">${esc(v("state"))}</span> ${esc(v("stop_reason") || "")}, ` +
      `${esc(v("epochs_run") ?? "?")} of ${esc(v("epochs_budget") ?? "?")} epochs` + (st.onFront[i] ? ' <span class="star">\u2605 on the front</span>' : "")]);
    for (const [c] of st.objectives) if (typeof v(c) === "number") head.push([label(c), esc(fmtNum(v(c), c))]);
    let html = table(head);
    // what the user came for first: the command that exports this trial
    const cmd = `python -m search pareto ${shellQuote(st.raw.path)} --where "trial_id=='${v("trial_id")}'" --export best.yaml\npython -m search train best.yaml`;
    if (v("state") === "COMPLETE") {
      html += (st.onFront[i] ? "" : '<p class="note">Not on the front (another COMPLETE trial beats it on every objective), but it can still be exported.</p>') +
        `<div class="cmd"><pre id="export-cmd">${esc(cmd)}</pre><button id="copy-cmd" type="button">copy</button></div>` +
        '<p class="note">Writes the full model and training config to best.yaml, then retrains it and tests it once.</p>';
    } else {
      const why = v("state") === "REJECTED" ? "it broke a constraint and was never trained"
        : v("state") === "FAILED" ? "it failed" : `it was cut short (${esc(v("stop_reason") || "")} after ${esc(v("epochs_run") ?? "?")} of ${esc(v("epochs_budget") ?? "?")} epochs), so its numbers are not comparable`;
      html += `<p class="note">Only COMPLETE trials can be exported: ${why}.</p>`;
    }
    const more = [];
    for (const k of ["val_acc", "throughput", "val_loss", "final_val_acc", "params", "flops", "duration_s"])
      if (typeof v(k) === "number" && !st.objectives.some(([c]) => c === k)) more.push([label(k), esc(fmtNum(v(k), k))]);
    if (v("error")) more.push(["error", `<span class="warn">${esc(v("error"))}</span>`]);
    if (v("rejected_by")) more.push(["rejected by", esc(v("rejected_by"))]);
    const knobs = st.knobs.filter((kn) => v(kn.name) !== null && v(kn.name) !== undefined);
    if (knobs.length) {
      html += `<div class="sub">config (searched knobs)</div>` +
        table(knobs.map((kn) => [kn.name, `<span class="mono">${esc(typeof v(kn.name) === "number" ? Number(v(kn.name).toPrecision(6)) : v(kn.name))}</span>`]));
    }
    if (more.length) html += `<div class="sub">measured</div>` + table(more);
    el.innerHTML = html;
    const btn = $("copy-cmd");
    if (btn) btn.onclick = () => {
      const text = $("export-cmd").textContent;
      const done = () => { btn.textContent = "copied"; setTimeout(() => (btn.textContent = "copy"), 1200); };
      if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).then(done, () => selectText($("export-cmd")));
      else selectText($("export-cmd"));
    };
  }
  function selectText(node) { const r = document.createRange(); r.selectNodeContents(node); const s = getSelection(); s.removeAllRanges(); s.addRange(r); }

  // -- table (virtual scrolling: only the visible rows are in the DOM) ---------------------
  const ROW_H = 23;
  function tableColumns() {
    const cols = [];
    if (S.studies.length > 1) cols.push({ key: "__study", title: "study" });
    cols.push({ key: "__front", title: "\u2605", tip: "on the Pareto front" });
    cols.push({ key: "trial_id", title: "trial", mono: true });
    cols.push({ key: "family", title: "family" });
    const models = new Set(); for (const st of S.studies) for (const m of st.cols.model || []) models.add(m);
    if (models.size > 1) cols.push({ key: "model", title: "model" });
    cols.push({ key: "state", title: "state" });
    for (const k of ["val_acc", "throughput", "params", "flops"]) cols.push({ key: k, title: label(k), num: true });
    // the front's held-out score (selected on validation, scored once on the test split)
    if (S.studies.some((st) => (st.cols.test_acc || []).some((v) => v !== null && v !== undefined)))
      cols.splice(cols.findIndex((c) => c.key === "val_acc") + 1, 0, { key: "test_acc", title: "test_acc", num: true, tip: "held-out: the selected epoch's weights scored once on the test split" });
    cols.push({ key: "epochs_run", title: "epochs", num: true });
    cols.push({ key: "stop_reason", title: "stop" });
    cols.push({ key: "duration_s", title: "time", num: true });
    const seen = new Set();
    for (const st of S.studies) for (const kn of st.knobs) if (kn.name !== "model" && !seen.has(kn.name)) { seen.add(kn.name); cols.push({ key: kn.name, title: kn.name, num: kn.type !== "choice" }); }
    if (S.studies.some((st) => (st.cols.error || []).some((e) => e))) cols.push({ key: "error", title: "error" });
    return cols;
  }
  function cellValue(st, s, i, key) {
    if (key === "__study") return st.label;
    if (key === "__front") return st.onFront[i] ? 1 : 0;
    return val(st, key, i);
  }
  function buildTableRows() {
    const stateFilter = $("state-filter").value, filtering = S.brushes.size > 0;
    const rows = [];
    S.studies.forEach((st, s) => {
      for (let i = 0; i < st.n; i++) {
        if (stateFilter && st.cols.state[i] !== stateFilter) continue;
        if (filtering && !passes(st, i)) continue;
        rows.push([s, i]);
      }
    });
    const { key, dir } = S.sort;
    const vals = rows.map(([s, i]) => cellValue(S.studies[s], s, i, key));
    const idx = rows.map((_, k) => k);
    idx.sort((a, b) => {
      const x = vals[a], y = vals[b];
      const xn = x === null || x === undefined, yn = y === null || y === undefined;
      if (xn || yn) return xn === yn ? a - b : xn ? 1 : -1; // nulls last, whichever direction
      if (x < y) return -dir; if (x > y) return dir; return a - b;
    });
    S.tableRows = idx.map((k) => rows[k]);
  }
  function renderTable(scrollToSelected) {
    const cols = tableColumns();
    S.tableCols = cols;
    $("trials").querySelector("thead").innerHTML = "<tr>" + cols.map((c) =>
      `<th data-key="${esc(c.key)}" class="${c.num ? "num" : ""}" title="${esc(c.tip || "sort by " + c.title)}">${esc(c.title)}${S.sort.key === c.key ? `<span class="arrow">${S.sort.dir > 0 ? " \u25B2" : " \u25BC"}</span>` : ""}</th>`).join("") + "</tr>";
    buildTableRows();
    const total = S.studies.reduce((a, st) => a + st.n, 0);
    $("table-title").textContent = `Trials (${S.tableRows.length.toLocaleString("en-US")}${S.tableRows.length !== total ? " of " + total.toLocaleString("en-US") : ""})`;
    hook.rows = S.tableRows.length;
    if (scrollToSelected) {
      const sel = selectedRow();
      if (sel) {
        const k = S.tableRows.findIndex(([s, i]) => s === sel[0] && i === sel[1]);
        const box = $("table-scroll");
        if (k >= 0 && (k * ROW_H < box.scrollTop || (k + 1) * ROW_H > box.scrollTop + box.clientHeight - 30)) box.scrollTop = Math.max(0, k * ROW_H - box.clientHeight / 3);
      }
    }
    renderTableBody();
  }
  function renderTableBody() {
    const box = $("table-scroll"), cols = S.tableCols, rows = S.tableRows;
    const first = Math.max(0, Math.floor(box.scrollTop / ROW_H) - 10);
    const last = Math.min(rows.length, first + Math.ceil((box.clientHeight || 400) / ROW_H) + 20);
    const sel = selectedRow();
    const out = [`<tr class="spacer"><td colspan="${cols.length}" style="height:${first * ROW_H}px"></td></tr>`];
    for (let k = first; k < last; k++) {
      const [s, i] = rows[k], st = S.studies[s];
      const cells = cols.map((c) => {
        const v = cellValue(st, s, i, c.key);
        if (c.key === "__front") return `<td class="star">${v ? "\u2605" : ""}</td>`;
        if (c.key === "state") return `<td><span class="pill ${esc(v)}">${esc(v)}</span></td>`;
        if (c.key === "epochs_run") return `<td class="num">${esc(v ?? "")}${val(st, "epochs_budget", i) ? "/" + esc(val(st, "epochs_budget", i)) : ""}</td>`;
        const text = typeof v === "number" ? fmtNum(v, c.key) : v === null || v === undefined ? "" : String(v);
        return `<td class="${c.num ? "num" : ""}${c.mono ? " mono" : ""}" title="${c.key === "error" ? esc(text) : ""}">${esc(text)}</td>`;
      });
      const isSel = sel && sel[0] === s && sel[1] === i;
      out.push(`<tr class="row${isSel ? " sel" : ""}" data-k="${k}">${cells.join("")}</tr>`);
    }
    out.push(`<tr class="spacer"><td colspan="${cols.length}" style="height:${(rows.length - last) * ROW_H}px"></td></tr>`);
    $("trials").querySelector("tbody").innerHTML = out.join("");
  }

  // -- header -----------------------------------------------------------------------------
  function renderHeader() {
    $("studies").innerHTML = S.studies.map((st) => {
      const sym = S.studies.length > 1 ? `<span class="sym" style="color:${st.line}">${STUDY_SYMBOLS[st.shape]}</span>` : "";
      if (st.raw.error) return `<div class="study">${sym}<span class="name">${esc(st.label)}</span><span class="err">${esc(st.raw.error)}</span></div>`;
      const counts = {};
      for (const v of st.cols.state || []) counts[v] = (counts[v] || 0) + 1;
      const budget = st.raw.budget && st.raw.budget.trials;
      const pills = ["COMPLETE", "PRUNED", "FAILED", "REJECTED"].filter((k) => counts[k]).map((k) => `<span class="pill ${k}">${counts[k]} ${k}</span>`).join(" ");
      let best = null;
      (st.cols.val_acc || []).forEach((v, i) => { if (st.cols.state[i] === "COMPLETE" && typeof v === "number" && (best === null || v > st.cols.val_acc[best])) best = i; });
      const hv = st.progress && st.progress.hypervolume ? st.progress.hypervolume[st.progress.hypervolume.length - 1] : null;
      // The files hold finished trials only; when the last one ended tells whether the run moves.
      const last = Math.max(...(st.cols.ended_at || []).filter((t) => typeof t === "number"));
      const lastText = isFinite(last) ? `last finished ${new Date(last * 1000).toLocaleTimeString()}` : "";
      return `<div class="study">${sym}<span class="name">${esc(st.label)}</span><span class="path">${esc(st.raw.path)}</span>` +
        `<span>${st.n.toLocaleString("en-US")}${budget ? " / " + budget.toLocaleString("en-US") : ""} trials finished</span>${pills}` +
        `<span>front: ${(st.raw.front || []).length}</span>` +
        (best !== null ? `<span>best val_acc ${fmtNum(st.cols.val_acc[best], "val_acc")}</span>` : "") +
        (typeof hv === "number" ? `<span>hypervolume ${fmtTick(hv, hv)}</span>` : "") +
        (lastText ? `<span class="path">${esc(lastText)}</span>` : "") + "</div>";
    }).join("");
  }
  function setLive() {
    const el = $("live");
    if (S.static) { el.className = "live static"; el.textContent = `static report, data of ${S.generatedAt || "?"}`; return; }
    const t = (d) => d.toLocaleTimeString();
    if (S.failingSince) { el.className = "live stale"; el.textContent = `server not answering since ${t(S.failingSince)}; retrying every ${POLL_MS / 1000} s (showing the last data)`; }
    else if (S.lastOk) { el.className = "live ok"; el.textContent = `live: checks the files every ${POLL_MS / 1000} s, last ${t(S.lastOk)}`; }
  }

  // -- knob importance (api/importance; the static report has it as HTML above instead) ----
  function renderImportance() {
    const data = S.importance; if (!data) return;
    const many = data.studies.length > 1;
    $("importance-panel").innerHTML = data.studies.map((st) => {
      const who = many ? `<b>${esc(st.label)}</b>: ` : "";
      if (st.error) return `<p class="note">${who}not available: ${esc(st.error)}</p>`;
      return st.families.map((f) => {
        const title = (f.model ? `family ${f.family} (${f.model}), ` : "") + `${f.complete_trials} COMPLETE trial${f.complete_trials === 1 ? "" : "s"}`;
        const warn = f.warning ? `<p class="note warn">${esc(f.warning)}</p>` : "";
        if (!f.knobs.length) return `<div class="fam"><h3>${who}${esc(title)}</h3>${warn}<p class="note">Fewer than 2 COMPLETE trials: nothing to compare.</p></div>`;
        const head = "<tr><th>knob</th>" + f.objectives.map((o) => `<th>${esc(o)}</th>`).join("") + "</tr>";
        const rows = f.knobs.map((k, r) => `<tr><td class="mono">${esc(k)}</td>` + f.objectives.map((o) => {
          const v = f.shares[o][r];
          return `<td><span class="bar" style="width:${Math.round(v * 80)}px"></span>${v.toFixed(3)}</td>`;
        }).join("") + "</tr>").join("");
        return `<div class="fam"><h3>${who}${esc(title)}</h3>${warn}<table class="importance-table">${head}${rows}</table></div>`;
      }).join("");
    }).join("");
    hook.importanceRenders += 1;
  }
  async function pollImportance() {
    try {
      const headers = S.importanceEtag ? { "If-None-Match": S.importanceEtag } : {};
      const resp = await fetch("api/importance", { headers, cache: "no-store" });
      if (resp.status === 200) { S.importanceEtag = resp.headers.get("ETag"); S.importance = await resp.json(); renderImportance(); }
    } catch (err) { /* the next new data asks again; the data's own poll reports a dead server */ }
  }

  // -- all --------------------------------------------------------------------------------
  function render() {
    const t0 = performance.now();
    // parallel first: the brushes' axis scales come from it
    renderHeader(); renderParallel(); renderScatter(); renderHV(); renderDetails(); renderTable(false);
    const t1 = performance.now();
    hook.renders += 1; hook.lastRenderMs = t1 - t0;
    if (hook.firstRenderMs === null && S.studies.length) {
      hook.firstRenderMs = t1; // ms since navigation start: page, data fetch, parse and drawing
      // ...and once the browser has put that frame on screen (two animation frames later)
      requestAnimationFrame(() => requestAnimationFrame(() => { hook.firstFrameMs = performance.now(); }));
    }
    document.documentElement.dataset.renders = String(hook.renders);
    const total = S.studies.reduce((a, st) => a + st.n, 0);
    $("footer").textContent = `${total.toLocaleString("en-US")} trial${total === 1 ? "" : "s"} in ${S.studies.length} stud${S.studies.length === 1 ? "y" : "ies"}; drawn in ${Math.round(t1 - t0)} ms. Objectives, states and the front are as in \`python -m search pareto\`; PRUNED/FAILED trials were stopped early and are never on the front.`;
  }
  async function poll() {
    hook.polls += 1;
    try {
      const headers = S.etag ? { "If-None-Match": S.etag } : {};
      const resp = await fetch("api/data", { headers, cache: "no-store" });
      // the importance after new data, and every 5th poll: the journal may change after the last Parquet write
      if (resp.status === 200) { S.etag = resp.headers.get("ETag"); ingest(await resp.json()); pollImportance(); }
      else if (hook.polls % 5 === 0) pollImportance();
      else if (resp.status !== 304) throw new Error("HTTP " + resp.status);
      S.lastOk = new Date(); S.failingSince = null;
    } catch (err) {
      if (!S.failingSince) S.failingSince = new Date();
    }
    setLive();
    setTimeout(poll, POLL_MS);
  }

  // -- events -----------------------------------------------------------------------------
  function pos(ev, el) { const r = el.getBoundingClientRect(); return [ev.clientX - r.left, ev.clientY - r.top]; }
  $("scatter").addEventListener("mousemove", (ev) => {
    const [mx, my] = pos(ev, ev.target), k = nearestPoint(mx, my, 10), tip = $("tooltip");
    if (k < 0) { tip.hidden = true; return; }
    const st = S.studies[S.scatterPts.s[k]], i = S.scatterPts.i[k];
    tip.innerHTML = `<b>${esc(val(st, "trial_id", i))}</b> ${esc(val(st, "family", i) || "")} ${esc(val(st, "state", i))}${st.onFront[i] ? " \u2605" : ""}<br>` +
      `${esc(label(S.yKey))} ${esc(fmtNum(val(st, S.yKey, i), S.yKey))}, ${esc(label(S.xKey))} ${esc(fmtNum(val(st, S.xKey, i), S.xKey))}` + (S.studies.length > 1 ? `<br>${esc(st.label)}` : "");
    tip.hidden = false;
    const w = ev.target.clientWidth;
    tip.style.left = Math.min(mx + 12, w - tip.offsetWidth - 4) + "px"; tip.style.top = my + 12 + "px";
  });
  $("scatter").addEventListener("mouseleave", () => ($("tooltip").hidden = true));
  $("scatter").addEventListener("click", (ev) => {
    const [mx, my] = pos(ev, ev.target), k = nearestPoint(mx, my, 12);
    if (k >= 0) select(S.scatterPts.s[k], S.scatterPts.i[k]); else select(null);
  });
  for (const id of ["x-axis", "y-axis"]) $(id).addEventListener("change", () => { S.xKey = $("x-axis").value; S.yKey = $("y-axis").value; renderScatter(); });
  $("log-x").addEventListener("change", renderScatter);
  $("show-cut").addEventListener("change", renderScatter);
  $("hv-x").addEventListener("change", renderHV);
  $("state-filter").addEventListener("change", () => renderTable(false));
  $("clear-brush").addEventListener("click", () => { S.brushes.clear(); render(); });
  $("table-scroll").addEventListener("scroll", () => requestAnimationFrame(renderTableBody));
  $("trials").querySelector("thead").addEventListener("click", (ev) => {
    const th = ev.target.closest("th"); if (!th) return;
    const key = th.dataset.key;
    S.sort = S.sort.key === key ? { key, dir: -S.sort.dir } : { key, dir: ["trial_id", "family", "model", "state", "stop_reason", "__study", "error"].includes(key) ? 1 : -1 };
    renderTable(false);
  });
  $("trials").querySelector("tbody").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr.row"); if (!tr) return;
    const [s, i] = S.tableRows[Number(tr.dataset.k)];
    select(s, i, "table");
  });
  // Parallel coordinates: drag along an axis to brush, click an axis to clear it, click a line to select.
  let drag = null;
  $("parallel").addEventListener("mousedown", (ev) => {
    if (!S.parallel) return;
    const [mx, my] = pos(ev, ev.target);
    const ax = S.parallel.axes.find((a) => Math.abs(a.x - mx) <= 12 && my >= S.parallel.top - 6 && my <= S.parallel.bottom + 6);
    drag = { ax, x: mx, y: my, moved: false, before: ax ? S.brushes.get(ax.key) : null };
    ev.preventDefault();
  });
  window.addEventListener("mousemove", (ev) => {
    if (!drag || !drag.ax) return;
    const [, my] = pos(ev, $("parallel"));
    if (Math.abs(my - drag.y) < 3 && !drag.moved) return;
    drag.moved = true;
    const P = S.parallel, tOf = (y) => Math.min(1, Math.max(0, (P.bottom - y) / (P.bottom - P.top)));
    const a = tOf(drag.y), b = tOf(my);
    S.brushes.set(drag.ax.key, [Math.min(a, b), Math.max(a, b)]);
    renderParallel();
  });
  window.addEventListener("mouseup", (ev) => {
    if (!drag) return;
    const d = drag; drag = null;
    if (d.moved) { render(); return; }
    if (d.ax && S.brushes.has(d.ax.key)) { S.brushes.delete(d.ax.key); render(); return; }
    const hit = parallelHit(d.x, d.y);
    if (hit) select(hit[0], hit[1]);
  });
  let resizeTimer = null;
  window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(() => { renderScatter(); renderHV(); renderParallel(); renderTableBody(); }, 100); });

  if (S.static) { ingest(EMBEDDED_DATA); setLive(); $("importance-card").hidden = true; }
  else poll();
})();
