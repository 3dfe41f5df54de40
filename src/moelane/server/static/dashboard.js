/* moelane dashboard: draws one /v1/stats object (docs/server.md, "Dashboard") as SVG charts and tables.
 *
 * Live (served at /dashboard): fetches v1/stats once a second while the tab is visible, never while it is hidden.
 * Report (`moelane trace analyze --html`): the same object is inlined in <script id="moelane-data">, drawn once.
 * Every chart says its units on its axes; nothing here loads anything from the network but v1/stats.
 */
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var TIER_COLORS = ["#1f6fd1", "#2b8a3e", "#e8590c", "#7048e8"];
  var LINE_COLORS = ["#1f6fd1", "#d9480f", "#2b8a3e", "#7048e8", "#c2255c", "#0b7285"];
  var POLL_MS = 1000;

  function el(tag, attrs, parent) {
    var node = document.createElementNS(SVG, tag);
    for (var k in attrs) node.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function text(parent, x, y, s, attrs) {
    var node = el("text", Object.assign({ x: x, y: y }, attrs || {}), parent);
    node.textContent = s;
    return node;
  }
  function $(id) { return document.getElementById(id); }
  function chartOf(cardId) { return $(cardId).querySelector(".chart"); }
  function setText(id, s) { var n = $(id); if (n) n.textContent = s; }

  function num(x, digits) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    return Number(x).toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
  }
  function pct(x, digits) { return x === null || x === undefined ? "–" : num(100 * x, digits === undefined ? 1 : digits) + "%"; }
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return num(n, i ? 1 : 0) + " " + units[i];
  }
  function last(values) {
    for (var i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
    return null;
  }

  // Ticks at 1, 2 or 5 times a power of ten, about `n` of them over [lo, hi].
  function ticks(lo, hi, n) {
    if (!(hi > lo)) hi = lo + 1;
    var step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
    var err = (hi - lo) / n / step;
    step *= err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1;
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }

  // Tick labels with as many decimals as the step between ticks needs (0, 2, 4 ... or 0.0, 0.5, 1.0 ...).
  function stepFormat(values) {
    var step = values.length > 1 ? values[1] - values[0] : 1;
    var digits = step >= 1 ? 0 : step >= 0.1 ? 1 : 2;
    return function (v) { return num(v, digits); };
  }

  function noData(chart, message) {
    chart.innerHTML = "";
    var div = document.createElement("div");
    div.className = "nodata";
    div.textContent = message;
    chart.appendChild(div);
  }

  /* A line chart: opts = {xs, xLabel, xFormat, yLabel, yFormat, yMin, yMax, lines: [{name, values, color}],
   * bands: [[x0, x1]] shaded, marks: [x] dashed verticals}. Null values break a line. */
  function lineChart(chart, opts) {
    var lines = opts.lines.filter(function (l) { return l.values.some(function (v) { return v !== null; }); });
    if (!opts.xs.length || !lines.length) { noData(chart, opts.empty || "no data yet"); return; }
    chart.innerHTML = "";
    var W = Math.max(chart.clientWidth, 240), H = opts.height || 170, L = 56, R = 10, T = 8, B = 34;
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, height: H, role: "img" }, chart);
    var x0 = opts.xMin !== undefined ? opts.xMin : opts.xs[0], x1 = opts.xs[opts.xs.length - 1];
    if (x1 <= x0) x1 = x0 + 1;
    var ys = [];
    lines.forEach(function (l) { l.values.forEach(function (v) { if (v !== null) ys.push(v); }); });
    var y0 = opts.yMin !== undefined ? opts.yMin : Math.min.apply(null, ys);
    var y1 = opts.yMax !== undefined ? opts.yMax : Math.max.apply(null, ys);
    if (opts.yMax === undefined) y1 = y1 > y0 ? y1 * 1.08 : y0 + 1;
    var sx = function (x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
    var sy = function (y) { return T + (1 - (y - y0) / (y1 - y0)) * (H - T - B); };
    (opts.bands || []).forEach(function (b) {
      el("rect", { "class": "band", x: sx(b[0]), y: T, width: Math.max(1, sx(b[1]) - sx(b[0])), height: H - T - B }, svg);
    });
    var yt = ticks(y0, y1, 4), g = el("g", { "class": "tick" }, svg), yFormat = opts.yFormat || stepFormat(yt);
    yt.forEach(function (v) {
      el("line", { "class": "grid-line", x1: L, x2: W - R, y1: sy(v), y2: sy(v) }, g);
      text(g, L - 5, sy(v) + 4, yFormat(v), { "text-anchor": "end" });
    });
    ticks(x0, x1, 6).forEach(function (v) {
      el("line", { "class": "axis", x1: sx(v), x2: sx(v), y1: H - B, y2: H - B + 4 }, g);
      text(g, sx(v), H - B + 15, (opts.xFormat || String)(v), { "text-anchor": "middle" });
    });
    (opts.marks || []).forEach(function (m) { el("line", { "class": "mark", x1: sx(m), x2: sx(m), y1: T, y2: H - B }, svg); });
    el("line", { "class": "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }, svg);
    el("line", { "class": "axis", x1: L, x2: L, y1: T, y2: H - B }, svg);
    text(svg, (L + W - R) / 2, H - 3, opts.xLabel, { "text-anchor": "middle" });
    text(svg, 0, 0, opts.yLabel, { "text-anchor": "middle", transform: "translate(11," + (T + (H - T - B) / 2) + ") rotate(-90)" });
    lines.forEach(function (l, i) {
      var d = "", pen = false;
      l.values.forEach(function (v, j) {
        if (v === null || v === undefined) { pen = false; return; }
        d += (pen ? "L" : "M") + sx(opts.xs[j]).toFixed(1) + " " + sy(v).toFixed(1);
        pen = true;
      });
      if (d.indexOf("L") < 0 && d) d += "l0.1 0";  // a lone point still shows
      el("path", { "class": "line", d: d, stroke: l.color || LINE_COLORS[i % LINE_COLORS.length] }, svg);
    });
    if (lines.length > 1 || opts.legend) {
      var lx = L + 8;
      lines.forEach(function (l, i) {
        var color = l.color || LINE_COLORS[i % LINE_COLORS.length];
        el("rect", { x: lx, y: T + 2, width: 10, height: 3, fill: color }, svg);
        lx += 14 + text(svg, lx + 14, T + 7, l.name).getComputedTextLength() + 14;
      });
    }
  }

  /* A bar chart: bars = [{label, value, color, title}], labelled values over the bars. */
  function barChart(chart, opts) {
    var bars = opts.bars;
    if (!bars.length) { noData(chart, opts.empty || "no data yet"); return; }
    chart.innerHTML = "";
    var W = Math.max(chart.clientWidth, 240), H = opts.height || 170, L = 56, R = 10, T = 14, B = 34;
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, height: H, role: "img" }, chart);
    var top = Math.max.apply(null, bars.map(function (b) { return b.value; }).concat([opts.yMax || 0]));
    if (!(top > 0)) top = 1;
    var sy = function (y) { return T + (1 - y / top) * (H - T - B); };
    var g = el("g", { "class": "tick" }, svg), yt = ticks(0, top, 4), yFormat = opts.yFormat || stepFormat(yt);
    yt.forEach(function (v) {
      el("line", { "class": "grid-line", x1: L, x2: W - R, y1: sy(v), y2: sy(v) }, g);
      text(g, L - 5, sy(v) + 4, yFormat(v), { "text-anchor": "end" });
    });
    var slot = (W - L - R) / bars.length, bw = Math.min(slot * 0.7, 60);
    bars.forEach(function (b, i) {
      var cx = L + slot * (i + 0.5);
      var rect = el("rect", { "class": "bar", x: cx - bw / 2, y: sy(b.value), width: bw, height: Math.max(0, sy(0) - sy(b.value)),
                             fill: b.color || LINE_COLORS[0], opacity: b.dim ? 0.45 : 1 }, svg);
      if (b.title) el("title", {}, rect).textContent = b.title;
      text(g, cx, H - B + 15, b.label, { "text-anchor": "middle" });
      if (b.note) text(svg, cx, sy(b.value) - 3, b.note, { "text-anchor": "middle" });
    });
    el("line", { "class": "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }, svg);
    text(svg, (L + W - R) / 2, H - 3, opts.xLabel, { "text-anchor": "middle" });
    text(svg, 0, 0, opts.yLabel, { "text-anchor": "middle", transform: "translate(11," + (T + (H - T - B) / 2) + ") rotate(-90)" });
  }

  /* The layer x expert map: fill hue = tier held at (grey: not resident), strength = routing count (log scale),
   * a dot = pinned by the plan, a ring = hard pin. One <rect class="cell"> per expert. `unit`: what counts are of. */
  function heatMap(chart, h, unit) {
    chart.innerHTML = "";
    var nL = h.layers.length, nE = h.n_experts;
    var W = Math.max(chart.clientWidth, 320), L = 56, R = 10, T = 6, B = 34;
    var cw = (W - L - R) / nE, ch = Math.max(6, Math.min(22, cw));
    var H = T + ch * nL + B;
    var svg = el("svg", { viewBox: "0 0 " + W + " " + H, height: H, role: "img" }, chart);
    var max = 0;
    if (h.counts) h.counts.forEach(function (row) { row.forEach(function (c) { if (c > max) max = c; }); });
    var scale = Math.log1p(max || 1);
    var g = el("g", { "class": "tick" }, svg), every = Math.max(1, Math.ceil(nL / Math.floor((ch * nL) / 12)));
    for (var li = 0; li < nL; li++) {
      if (li % every === 0) text(g, L - 5, T + ch * (li + 0.5) + 4, String(h.layers[li]), { "text-anchor": "end" });
      for (var e = 0; e < nE; e++) {
        var tier = h.tier[li][e], count = h.counts ? h.counts[li][e] : null, pin = h.pinned[li][e];
        var strength = h.counts ? 0.12 + 0.88 * Math.log1p(count) / scale : 0.55;
        var color = tier >= 0 ? TIER_COLORS[tier % TIER_COLORS.length] : "#868e96";
        var x = L + e * cw, y = T + li * ch;
        var cell = el("rect", { "class": "cell", x: x, y: y, width: cw, height: ch, fill: color,
                                "fill-opacity": (tier >= 0 ? strength : strength * 0.55).toFixed(3),
                                "data-layer": h.layers[li], "data-expert": e }, svg);
        el("title", {}, cell).textContent = "layer " + h.layers[li] + ", expert " + e + ": " +
          (tier >= 0 ? "resident (" + h.tiers[tier] + ")" : "not resident") +
          (pin === 2 ? ", hard pin" : pin === 1 ? ", pinned" : "") + (count !== null ? ", routed " + count + " times" : "");
        var r = Math.max(1.5, Math.min(cw, ch) * 0.18);
        if (pin === 1) el("circle", { "class": "pin", cx: x + cw / 2, cy: y + ch / 2, r: r }, svg);
        if (pin === 2) el("circle", { "class": "hard", cx: x + cw / 2, cy: y + ch / 2, r: r * 1.6 }, svg);
      }
    }
    var step = ticks(0, nE - 1, Math.min(16, nE))[1] || 1;
    for (var t = 0; t < nE; t += step) text(g, L + (t + 0.5) * cw, T + ch * nL + 14, String(t), { "text-anchor": "middle" });
    text(svg, (L + W - R) / 2, H - 3, "expert id", { "text-anchor": "middle" });
    text(svg, 0, 0, "layer", { "text-anchor": "middle", transform: "translate(11," + (T + ch * nL / 2) + ") rotate(-90)" });
    var legend = $("heat-legend");
    legend.innerHTML = "";
    var item = function (swatch, label) {
      var span = document.createElement("span"), i = document.createElement("i");
      i.className = swatch;
      span.appendChild(i);
      span.appendChild(document.createTextNode(label));
      legend.appendChild(span);
    };
    h.tiers.forEach(function (name, i) { item("tier" + i, "resident, " + name); });
    item("gone", "not resident");
    item("dot pinned", "pinned by the plan");
    item("dot hard", "hard pin");
    var note = document.createElement("span");
    note.textContent = h.counts ? "stronger colour: routed more often (log scale; most: " + num(max, 0) + " " + unit + ")" : "routing counts not kept";
    legend.appendChild(note);
  }

  function xAxis(data) {
    var s = data.series;
    if (data.axis === "tokens") {
      return { xs: s.t, label: "tokens replayed (prompt + decode)", format: function (v) { return num(v, 0); } };
    }
    return { xs: s.t.map(function (t) { return t - data.now; }), label: "time (s, 0 = now)",
             format: function (v) { return num(v, 0); }, xMin: Math.min(-60, s.t.length ? s.t[0] - data.now : -60) };
  }

  // Intervals that fed prompt rows, as shaded bands, and each prefill -> decode boundary as a dashed mark.
  function prefillBands(data, xs) {
    var p = data.series.prefill, bands = [], marks = [];
    for (var i = 0; i < p.length; i++) {
      if (!p[i]) continue;
      var start = i > 0 ? xs[i - 1] : xs[i];
      bands.push([start, xs[i]]);
      if (i + 1 < p.length && !p[i + 1]) marks.push(xs[i]);
    }
    return { bands: bands, marks: marks };
  }

  function timeChart(cardId, data, opts) {
    var ax = xAxis(data), pb = prefillBands(data, ax.xs);
    lineChart(chartOf(cardId), Object.assign({ xs: ax.xs, xLabel: ax.label, xFormat: ax.format, xMin: ax.xMin,
                                               bands: pb.bands, marks: pb.marks }, opts));
  }

  function drawPager(data) {
    var p = data.pager, s = data.series;
    $("pager").hidden = !p;
    if (!p) return;
    setText("pager-note", p.paged ? "policy " + p.policy + " · " + num(p.n_slots, 0) + " slots of " + bytes(p.slot_bytes) +
      " (" + pct(p.budget_bytes / p.total_bytes, 0) + " of all experts) · shaded: intervals that fed prompt rows" : p.note);
    var hd = last(s.hit_rate_decode), hp = last(s.hit_rate_prefill);
    setText("hit-now", "decode " + pct(hd) + " · prefill " + pct(hp));
    timeChart("card-hit", data, { yLabel: "found resident (%)", yMin: 0, yMax: 1, yFormat: function (v) { return num(100 * v, 0); },
      lines: [{ name: "decode", values: s.hit_rate_decode, color: "#1f6fd1" }, { name: "prefill", values: s.hit_rate_prefill, color: "#d9480f" }],
      legend: true, empty: p.paged ? "no expert accesses yet" : "every expert resident: nothing to miss" });
    setText("stall-now", num(last(s.stall_ms_per_token), 2) + " ms");
    timeChart("card-stall", data, { yLabel: "ms per token", yMin: 0, lines: [{ name: "stall", values: s.stall_ms_per_token, color: "#c2255c" }], empty: p.paged ? "no tokens yet" : "no stalls: every expert resident" });
    var perToken = data.axis === "tokens";
    var readLines = Object.keys(s.read_rate).map(function (k, i) {
      return { name: k, values: s.read_rate[k].map(function (v) { return v === null ? null : v / (perToken ? 1024 : 1048576); }),
               color: LINE_COLORS[(i + 2) % LINE_COLORS.length] };
    });
    var readNow = readLines.reduce(function (a, l) { return a + (last(l.values) || 0); }, 0);
    setText("reads-now", num(readNow, 2) + (perToken ? " KiB/token" : " MiB/s"));
    timeChart("card-reads", data, { yLabel: perToken ? "KiB read per token" : "MiB read per s", yMin: 0,
      lines: readLines, legend: true, empty: p.paged ? "nothing read yet" : "nothing to read: every expert resident" });
    var most = Math.max.apply(null, p.reads.map(function (r) { return r.bytes; }).concat([1]));
    var unit = most >= 1073741824 ? ["GiB", 1073741824] : most >= 1048576 ? ["MiB", 1048576] : ["KiB", 1024];
    barChart(chartOf("card-levels"), { yLabel: unit[0] + " read (since start)", xLabel: "storage level / precision tier",
      empty: p.paged ? "nothing read yet" : "nothing to read",
      bars: p.reads.map(function (r, i) {
        return { label: r.level + " / " + r.tier, value: r.bytes / unit[1], note: bytes(r.bytes), color: LINE_COLORS[(i + 2) % LINE_COLORS.length],
                 title: num(r.experts, 0) + " experts, " + bytes(r.bytes) };
      }) });
    var b = p.bandit;
    setText("bandit-now", b ? "in use: decay " + b.decays[b.serving] : "");
    barChart(chartOf("card-bandit"), { yLabel: "arm weight (reward)", xLabel: "arm: score decay per token (solid: in use)",
      yMax: 0.01, empty: p.paged ? "no planner (policy " + p.policy + ")" : "no pager",
      bars: b ? b.decays.map(function (d, i) {
        return { label: String(d), value: b.weights[i], note: num(b.weights[i], 2), color: i === b.serving ? "#2b8a3e" : "#868e96",
                 dim: i !== b.serving, title: "decay " + d + ": weight " + num(b.weights[i], 3) };
      }) : [] });
    drawPlan(p);
    var h = p.heatmap;
    if (h) {
      var held = 0;
      h.tier.forEach(function (row) { row.forEach(function (t) { if (t >= 0) held++; }); });
      setText("heat-now", h.layers.length + " layers × " + h.n_experts + " experts · " + (p.paged ? num(held, 0) + " resident" : "all resident"));
      heatMap(chartOf("card-heat"), h, data.axis === "tokens" ? "tokens" : "passes");
    }
  }

  function drawPlan(p) {
    var rows = [];
    if (p.paged) {
      rows.push(["pool", num(p.n_slots, 0) + " slots · " + bytes(p.budget_bytes) + " of " + bytes(p.total_bytes)]);
      rows.push(["resident", bytes(p.resident_bytes)]);
      rows.push(["evictions", num(p.evictions, 0)]);
      ["decode", "prefill"].forEach(function (name) {
        var c = p.phases[name];
        if (c) rows.push([name + " since start", pct(c.hit_rate) + " found of " + num(c.accesses, 0) + " · stall " + num(c.stall_s, 2) + " s"]);
      });
    }
    if (p.plan) {
      rows.push(["plan version", p.plan.version === null ? "applied" : String(p.plan.version)]);
      rows.push(["plan budget", bytes(p.plan.budget_bytes)]);
      rows.push(["pins", num(p.plan.n_pins, 0) + " (" + p.plan.pin_mode + (p.plan.n_hard ? ", " + p.plan.n_hard + " hard" : "") + ")"]);
      rows.push(["window", p.plan.window_k + " tokens"]);
      rows.push(["default tier", p.plan.default_tier]);
    } else {
      rows.push(["plan", p.paged ? "none yet" : "none: every expert resident"]);
    }
    var dl = $("plan");
    dl.innerHTML = "";
    rows.forEach(function (r) {
      var dt = document.createElement("dt"), dd = document.createElement("dd");
      dt.textContent = r[0]; dd.textContent = r[1];
      dl.appendChild(dt); dl.appendChild(dd);
    });
  }

  function drawLanes(data) {
    var l = data.lanes, s = data.series;
    $("lanes").hidden = !l;
    if (!l) return;
    setText("lanes-note", "drafter " + l.drafter + " · up to " + l.max_streams + " streams · " + num(l.rounds, 0) +
      " rounds, " + num(l.committed, 0) + " tokens since start");
    setText("toks-now", num(last(s.tok_s), 1) + " tok/s");
    timeChart("card-toks", data, { yLabel: "tokens per s (all streams)", yMin: 0, lines: [{ name: "tok/s", values: s.tok_s, color: "#1f6fd1" }] });
    setText("streams-now", l.active + " active · " + l.waiting + " waiting");
    timeChart("card-streams", data, { yLabel: "streams", yMin: 0, legend: true,
      lines: [{ name: "active", values: s.active, color: "#2b8a3e" }, { name: "waiting", values: s.waiting, color: "#e8590c" }] });
    setText("rounds-now", num(last(s.rounds_s), 1) + " rounds/s");
    timeChart("card-rounds", data, { yLabel: "rounds per s", yMin: 0, lines: [{ name: "rounds/s", values: s.rounds_s, color: "#7048e8" }] });
    setText("rows-now", num(last(s.rows_per_round), 2) + " rows");
    timeChart("card-rows", data, { yLabel: "rows per round", yMin: 0, lines: [{ name: "rows/round", values: s.rows_per_round, color: "#0b7285" }] });
    setText("accept-now", l.drafter === "none" ? "no drafter" : l.drafter + " · " + pct(l.acceptance) + " since start");
    timeChart("card-accept", data, { yLabel: "accepted / held (%)", yMin: 0, yMax: 1, yFormat: function (v) { return num(100 * v, 0); },
      lines: [{ name: l.drafter, values: s.acceptance, color: "#2b8a3e" }],
      empty: l.drafter === "none" ? "drafter none: every round is plain" : "no drafts held yet" });
    drawGuard(l);
  }

  function drawGuard(l) {
    var box = $("guard");
    box.innerHTML = "";
    if (!l.guard || !l.guard.length) {
      var p = document.createElement("p");
      p.className = "note";
      p.textContent = l.guard ? "no rounds yet" : l.drafter === "none" ? "no guard: drafter none, every round plain" :
        "no guard: the " + l.drafter + " drafter drafts every round (--guard on to measure)";
      box.appendChild(p);
      return;
    }
    var rows = l.guard.map(function (g) {
      var next = g.state === "running" ? "re-measures " + (g.mode === "plain" ? "drafted" : "plain") + " in " + num(g.rounds_left, 0) + " rounds"
        : "measuring " + g.mode + ": " + num(g.rounds_left, 0) + " rounds left";
      return [g.streams, '<span class="' + g.mode + '">' + g.mode + "</span>", next, num(g.rate_plain, 0), num(g.rate_drafted, 0), g.decisions];
    });
    box.appendChild(table(["streams", "verdict", "next", "plain tok/s", "drafted tok/s", "decisions"], rows, [1, 2]));
  }

  function table(head, rows, textCols) {
    var t = document.createElement("table");
    var tr = t.insertRow();
    head.forEach(function (h, i) { var th = document.createElement("th"); th.textContent = h; if (textCols.indexOf(i) >= 0) th.className = "text"; tr.appendChild(th); });
    rows.forEach(function (r) {
      var row = t.insertRow();
      r.forEach(function (v, i) {
        var td = row.insertCell();
        if (typeof v === "string" && v.charAt(0) === "<") td.innerHTML = v; else td.textContent = v;
        if (textCols.indexOf(i) >= 0) td.className = "text";
      });
    });
    return t;
  }

  function drawRequests(data) {
    var reqs = data.requests;
    $("requests").hidden = !reqs;
    if (!reqs) return;
    setText("requests-note", reqs.length ? "newest first" + (data.show_text ? "" : " · prompt text hidden (--dashboard-show-text shows it)") : "none finished yet");
    var head = ["finished", "request", "endpoint", "prompt tok", "reply tok", "TTFT (ms)", "tok/s", "finish", "experts paged", "bytes paged", "stall (ms)"];
    if (data.show_text) head.push("prompt");
    var rows = reqs.map(function (r) {
      var row = [new Date(r.finished * 1000).toLocaleTimeString("en-GB"), r.id.slice(-8), r.endpoint + (r.choices > 1 ? " ×" + r.choices : ""),
                 num(r.prompt_tokens, 0), num(r.completion_tokens, 0), num(r.ttft_s === null ? null : 1000 * r.ttft_s, 1),
                 num(r.tok_s, 1), r.finish_reason || "–", num(r.experts_paged, 0), bytes(r.bytes_paged), num(1000 * r.stall_s, 1)];
      if (data.show_text) row.push(r.prompt_text || "");
      return row;
    });
    var t = table(head, rows, [1, 2, 7, 11]);
    if (data.show_text) Array.prototype.forEach.call(t.rows, function (row, i) { if (i) row.cells[11].className = "prompt"; });
    var old = $("request-table");
    t.id = "request-table";
    old.parentNode.replaceChild(t, old);
  }

  function draw(data) {
    setText("model", data.model);
    var up = data.now - data.started;
    setText("summary", data.axis === "tokens" ? "recorded trace, replayed" :
      "sampled on the server at most every " + data.interval_s + " s · up " + num(up / 60, 0) + " min · " + data.series.t.length + " samples");
    drawPager(data);
    drawLanes(data);
    drawRequests(data);
  }

  var status = $("status"), waiting = false, lastData = null;
  function setStatus(cls, s) { status.className = "status " + cls; status.textContent = s; }

  // One request at a time: the next is sent a second after the last answer, and none while the tab is hidden.
  function poll() {
    waiting = true;
    fetch("v1/stats", { cache: "no-store", credentials: "same-origin" }).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.json();
    }).then(function (data) {
      lastData = data;
      draw(data);
      setStatus("live", "live");
    }).catch(function (e) {
      setStatus(lastData ? "stale" : "error", "no answer (" + e.message + "), retrying");
    }).then(function () {
      setTimeout(function () { if (document.hidden) waiting = false; else poll(); }, POLL_MS);
    });
  }

  var inline = $("moelane-data");
  if (inline) {
    var data = JSON.parse(inline.textContent);
    setStatus("live", "report");
    draw(data);
    window.addEventListener("resize", function () { draw(data); });
  } else {
    document.addEventListener("visibilitychange", function () {
      if (!document.hidden && !waiting) poll();
    });
    window.addEventListener("resize", function () { if (lastData) draw(lastData); });
    poll();
  }
  window.moelaneDashboard = { draw: draw, ticks: ticks };
})();
