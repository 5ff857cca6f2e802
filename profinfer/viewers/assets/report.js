// The report page (kind "report"): a recording's JSON summary drawn (profinfer report --html).
// LABELS.flight_families names a flight capture's families of counts (viewers/flight.py).
  const PHASE_COLOR = { prefill: "var(--prefill)", decode: "var(--decode)", mixed: "var(--mixed)", other: "var(--other)" };
  const phaseColor = (p) => PHASE_COLOR[p] || PHASE_COLOR.other;
  const PHASE_ORDER = ["prefill", "decode", "mixed", "other"];
  const byPhase = (a, b) => ((PHASE_ORDER.indexOf(a) + 5) % 5) - ((PHASE_ORDER.indexOf(b) + 5) % 5);

  // ---- the page ----
  function header() {
    const meta = S.meta || {};
    const h = el("header", {}, page);
    el("h1", {}, h, `profinfer report: ${S.process_name || meta.engine || "process"} (pid ${S.pid ?? "?"})`);
    const bits = [meta.engine && `engine ${meta.engine}`, meta.model && `model ${meta.model}`,
      meta.levels && `levels ${meta.levels}`, meta.cpus_online && `${meta.cpus_online} CPUs`,
      meta.kernel && `kernel ${meta.kernel}`].filter(Boolean);
    el("div", { class: "sub" }, h, bits.join(" · "));
    const tiles = el("div", { class: "tiles" }, page);
    const tile = (label, path, value, text, key) => {
      if (value === undefined) return;
      const t = el("div", { class: "tile" + (key ? " key" : "") }, tiles);
      el("div", { class: "label" }, t, label);
      num(t, "div", path, value, text, { class: "value" });
    };
    tile("time to first token (TTFT, median)", ["ttft_ns"], S.ttft_ns, time(S.ttft_ns), true);
    tile("time per output token (TPOT)", ["tpot_ns"], S.tpot_ns, time(S.tpot_ns), true);
    tile("decode tokens/s", ["tokens_per_s"], S.tokens_per_s, rate(S.tokens_per_s, "tok/s"), true);
    tile("prefill tokens/s", ["prefill_tokens_per_s"], S.prefill_tokens_per_s, rate(S.prefill_tokens_per_s, "tok/s"), true);
    if (S.tokens) {
      tile("prompt tokens", ["tokens", "prefill"], S.tokens.prefill, count(S.tokens.prefill));
      tile("generated tokens", ["tokens", "decode"], S.tokens.decode, count(S.tokens.decode));
    }
    if (S.time_ns) {
      tile("prefill time", ["time_ns", "prefill"], S.time_ns.prefill, time(S.time_ns.prefill));
      tile("decode time", ["time_ns", "decode"], S.time_ns.decode, time(S.time_ns.decode));
    }
    if (isNum(S.decode_calls)) tile("decode calls", ["decode_calls"], S.decode_calls, count(S.decode_calls));
    if (isNum(S.steps)) tile("engine steps", ["steps"], S.steps, count(S.steps));
    if (isNum(S.sequences)) tile("sequences", ["sequences"], S.sequences, count(S.sequences));
    tile("lost events", ["lost_events"], S.lost_events, count(S.lost_events));
    if (S.lost_events) el("p", { class: "warn" }, page, "Events were lost: the numbers below undercount.");
  }

  // The decode calls (llama.cpp) or engine steps (vLLM) on one time axis, with each sequence's
  // time to first token above them.
  function timeline() {
    const calls = S.decode_call_list || S.step_list;
    if (!Array.isArray(calls) || !calls.length) return;
    const what = S.decode_call_list ? "decode call" : "engine step";
    // how many calls (steps) an entry merges: the summary groups a long run's
    const group = (S.decode_call_list ? S.decode_call_group : S.step_group) || 1;
    const merged = (c) => (S.decode_call_list ? c.calls : c.steps) || 1;
    const s = section(`Timeline: ${what}s, TTFT and TPOT`,
      `Top: each sequence from its request to its last token, the part before its first token (TTFT) in orange. ` +
      `Middle: each ${what} as a bar as long as it ran. Bottom: its duration` +
      (group > 1 ? ` (mean of each group of ${count(group)} ${what}s: the summary merges ${what}s beyond 2,000)` : "") +
      `; the dashed line is the TPOT.`);
    legend(s, [["prefill", phaseColor("prefill")], ["decode", phaseColor("decode")], ["mixed", phaseColor("mixed")]]);
    const seqs = (S.sequence_latency || []).slice(0, 24);
    const t0 = Math.min(...calls.map((c) => c.start_ns), ...seqs.map((q) => q.start_ns));
    const t1 = Math.max(...calls.map((c) => (c.end_ns ?? c.start_ns + c.dur_ns)), ...seqs.map((q) => q.end_ns ?? q.start_ns));
    const useMs = t1 - t0 < 5e9, unit = useMs ? 1e6 : 1e9;
    const W = 1100, lane = 14, seqH = seqs.length ? seqs.length * (lane + 4) + 8 : 0;
    const stripT = 10 + seqH, stripH = 22, plotT = stripT + stripH + 14, plotH = 200, H = plotT + plotH + 46;
    const box = { l: 92, r: W - 16, t: plotT, b: plotT + plotH };
    const svg = svgBox(s, W, H, "timeline");
    const x = linear(0, (t1 - t0) / unit, box.l, box.r);
    const X = (ns) => x((ns - t0) / unit);
    const per = (c) => c.dur_ns / merged(c);
    const shown = calls.filter((c) => c.phase !== "prefill" || !S.decode_call_list);
    const ymax = Math.max(...shown.map(per), S.tpot_ns || 0, 1) * 1.12 / 1e6;
    const y = linear(0, ymax, box.b, box.t);
    axes(svg, box, x, y, linTicks(0, (t1 - t0) / unit, 10), linTicks(0, ymax, 5),
      `time since the first ${what} (${useMs ? "ms" : "s"})`, `${what} duration (ms)`);
    // sequences
    seqs.forEach((q, i) => {
      const ty = 10 + i * (lane + 4);
      const end = q.end_ns ?? q.prefill_end_ns ?? q.start_ns;
      const firstTok = q.prefill_end_ns ?? end;
      tip(sv("rect", { x: X(q.start_ns), y: ty, width: Math.max(1, X(firstTok) - X(q.start_ns)), height: lane,
        fill: phaseColor("prefill"), rx: 2 }, svg), `sequence ${q.seq}: TTFT ${time(q.ttft_ns)}`);
      tip(sv("rect", { x: X(firstTok), y: ty, width: Math.max(1, X(end) - X(firstTok)), height: lane,
        fill: phaseColor("decode"), "fill-opacity": 0.35, rx: 2 }, svg),
      `sequence ${q.seq}: ${count(q.decode_tokens)} tokens after the first, TPOT ${time(q.tpot_ns)}`);
      const label = sv("text", { x: box.l - 6, y: ty + lane - 3, "text-anchor": "end", class: "muted" }, svg, `seq ${q.seq}`);
      void label;
      const txt = sv("text", { x: Math.min(X(end) + 6, box.r - 200), y: ty + lane - 3 }, svg);
      txt.appendChild(document.createTextNode("TTFT "));
      mark(sv("tspan", {}, txt, time(q.ttft_ns)), ["sequence_latency", i, "ttft_ns"], q.ttft_ns);
      txt.appendChild(document.createTextNode(" · TPOT "));
      mark(sv("tspan", {}, txt, time(q.tpot_ns)), ["sequence_latency", i, "tpot_ns"], q.tpot_ns);
    });
    // the strip of calls
    sv("text", { x: box.l - 6, y: stripT + stripH - 7, "text-anchor": "end", class: "muted" }, svg, what + "s");
    const listKey = S.decode_call_list ? "decode_call_list" : "step_list";
    calls.forEach((c, i) => {
      const end = c.end_ns ?? c.start_ns + c.dur_ns;
      tip(sv("rect", { x: X(c.start_ns), y: stripT, width: barWidth(X(end) - X(c.start_ns)), height: stripH,
        fill: phaseColor(c.phase), class: "call" }, svg),
      (merged(c) > 1 ? `${what}s ${count(i * group)}–${count(i * group + merged(c) - 1)}` : `${what} ${count(i * group)}`) +
      `: ${c.phase}, ${count(c.tokens)} tokens, ${time(c.dur_ns)}`);
    });
    // durations
    calls.forEach((c, i) => {
      if (!shown.includes(c)) return;
      const end = c.end_ns ?? c.start_ns + c.dur_ns;
      const top = y(Math.min(per(c) / 1e6, ymax));
      mark(tip(sv("rect", { x: X(c.start_ns), y: top, width: barWidth(X(end) - X(c.start_ns)), height: box.b - top,
        fill: phaseColor(c.phase), class: "duration" }, svg), `${what} ${i}: ${time(per(c))}`),
      [listKey, i, "dur_ns"], c.dur_ns);
    });
    if (isNum(S.tpot_ns)) {
      const py = y(S.tpot_ns / 1e6);
      sv("line", { x1: box.l, x2: box.r, y1: py, y2: py, stroke: "var(--ink)", "stroke-dasharray": "5 4", "stroke-width": 1.3 }, svg);
      const t = sv("text", { x: box.r - 4, y: py - 5, "text-anchor": "end", class: "title" }, svg, "TPOT ");
      mark(sv("tspan", {}, t, time(S.tpot_ns)), ["tpot_ns"], S.tpot_ns);
    }
  }

  // Op time per phase: the top ops of each phase as bars.
  function opBreakdown() {
    const phases = Object.entries(S.phases || {}).filter(([, p]) => Array.isArray(p.ops) && p.ops.length);
    const s = section("Where the time went: ops per phase",
      "Each phase's op time (summed over threads) by op type, largest first; the share is of the phase's op time.");
    const row = el("div", { class: "row" }, s);
    const lists = phases.length ? phases.map(([name, p]) => [name, p.ops, ["phases", name, "ops"]])
      : (S.ops && S.ops.length ? [["all", S.ops, ["ops"]]] : []);
    for (const [name, ops, path] of lists) {
      const div = el("div", {}, row);
      const total = ops.reduce((a, o) => a + o.total_ns, 0) || 1;
      const title = el("h3", {}, div, `${name}: `);
      if (path[0] === "phases") {
        title.appendChild(document.createTextNode("op time "));
        num(title, "span", ["phases", name, "op_ns"], S.phases[name].op_ns, time(S.phases[name].op_ns));
      }
      const top = ops.map((o, i) => [o, i]).sort((a, b) => b[0].total_ns - a[0].total_ns).slice(0, 10);
      const rest = ops.length - top.length;
      const W = 600, bh = 20, H = top.length * (bh + 5) + (rest ? 22 : 6);
      const svg = svgBox(div, W, H, `ops in ${name}`);
      const x = linear(0, top.length ? top[0][0].total_ns : 1, 0, W - 198 - 235);
      top.forEach(([o, i], k) => {
        const ty = k * (bh + 5);
        tip(sv("text", { x: 192, y: ty + 14, "text-anchor": "end" }, svg, o.op.length > 28 ? o.op.slice(0, 27) + "…" : o.op), o.op);
        tip(sv("rect", { x: 198, y: ty, width: Math.max(1, x(o.total_ns)), height: bh, fill: phaseColor(name), rx: 2 }, svg),
          `${o.op}: ${count(o.count)} runs`);
        const t = sv("text", { x: 204 + Math.max(1, x(o.total_ns)), y: ty + 14 }, svg);
        mark(sv("tspan", {}, t, time(o.total_ns)), [...path, i, "total_ns"], o.total_ns);
        sv("tspan", { class: "muted" }, t, ` · ${pct(o.total_ns / total)} · ${count(o.count)} runs`);
      });
      if (rest) sv("text", { x: 198, y: H - 6, class: "muted" }, svg, `and ${rest} more op types`);
    }
    if (Array.isArray(S.ops) && S.ops.length) {
      el("h3", {}, s, "All ops (all phases, all threads)");
      const tb = table(s, ["op", "runs", "total", "mean", "p50", "p99", "share"]);
      S.ops.forEach((o, i) => {
        const tr = el("tr", {}, tb);
        el("td", { class: "name" }, tr, o.op);
        num(tr, "td", ["ops", i, "count"], o.count, count(o.count));
        num(tr, "td", ["ops", i, "total_ns"], o.total_ns, time(o.total_ns));
        num(tr, "td", ["ops", i, "mean_ns"], o.mean_ns, time(o.mean_ns));
        num(tr, "td", ["ops", i, "p50_ns"], o.p50_ns, time(o.p50_ns));
        num(tr, "td", ["ops", i, "p99_ns"], o.p99_ns, time(o.p99_ns));
        num(tr, "td", ["ops", i, "share"], o.share, pct(o.share));
      });
    }
  }

  // The roofline: each verdict a point (intensity, GFLOP/s) under this machine's roofs, log-log.
  function roofline() {
    const R = S.roofline;
    if (!R || !R.roofs || !Array.isArray(R.verdicts)) return;
    const roofs = R.roofs;
    const caches = Array.isArray(roofs.caches) ? roofs.caches.filter((c) => isNum(c.gbps) && c.gbps > 0) : [];
    const s = section("Roofline",
      "Each point is one op type in one phase, at its arithmetic intensity (FLOP per byte moved, from the engine's cost model) " +
      "and the FLOP/s it reached; the lines are this machine's roofs (" + (roofs.origin || "calibrated") + "). " +
      "Area ∝ the time it took. Log-log axes.");
    const pts = R.verdicts.map((v, i) => [v, i]).filter(([v]) => isNum(v.intensity) && v.intensity > 0 && isNum(v.gflops) && v.gflops > 0);
    const peak = roofs.peak_gflops, bw = roofs.peak_gbps;
    const xs = [...pts.map(([v]) => v.intensity), roofs.ridge || peak / bw, ...caches.map((c) => peak / c.gbps)];
    const ys = [...pts.map(([v]) => v.gflops), peak];
    const xlo = Math.pow(10, Math.floor(Math.log10(Math.min(...xs) / 2))), xhi = Math.pow(10, Math.ceil(Math.log10(Math.max(...xs) * 2)));
    const ylo = Math.pow(10, Math.floor(Math.log10(Math.min(...ys, bw * xlo) / 1.5))), yhi = Math.pow(10, Math.ceil(Math.log10(peak * 1.6)));
    const W = 1100, H = 480, box = { l: 78, r: W - 230, t: 16, b: H - 48 };
    const svg = svgBox(s, W, H, "roofline");
    const x = logScale(xlo, xhi, box.l, box.r), y = logScale(ylo, yhi, box.b, box.t);
    axes(svg, box, x, y, logTicks(xlo, xhi), logTicks(ylo, yhi),
      "arithmetic intensity (FLOP/byte, log)", "performance (GFLOP/s, log)", { ytitleOffset: 58 });
    const clip = sv("clipPath", { id: "plot" }, sv("defs", {}, svg));
    sv("rect", { x: box.l, y: box.t, width: box.r - box.l, height: box.b - box.t }, clip);
    const roofG = sv("g", { "clip-path": "url(#plot)" }, svg);
    const drawRoof = (gbps, label, dash, path) => {
      const ridge = peak / gbps;
      const xa = Math.max(xlo, ylo / gbps);
      sv("polyline", { points: `${x(xa)},${y(gbps * xa)} ${x(Math.min(ridge, xhi))},${y(gbps * Math.min(ridge, xhi))}`,
        fill: "none", stroke: "var(--roof)", "stroke-width": dash ? 1.3 : 2.2, "stroke-dasharray": dash || "" }, roofG);
      // the label along the slope, where the roof crosses the plot's lower part
      const lx = Math.max(xa * 1.6, Math.min(ridge / 6, xhi / 2));
      const angle = -Math.atan2(y(gbps * lx) - y(gbps * lx * 10), x(lx * 10) - x(lx)) * 180 / Math.PI;
      const t = sv("text", { x: x(lx), y: y(gbps * lx) - 6, transform: `rotate(${angle} ${x(lx)} ${y(gbps * lx) - 6})`, class: "title" }, svg, label + " ");
      mark(sv("tspan", {}, t, withUnit(gbps, "GB/s")), path, gbps);
    };
    sv("line", { x1: x(Math.min(peak / Math.max(bw, ...caches.map((c) => c.gbps)), xhi)), x2: box.r, y1: y(peak), y2: y(peak),
      stroke: "var(--roof)", "stroke-width": 2.2 }, roofG);
    const ct = sv("text", { x: box.r - 4, y: y(peak) - 7, "text-anchor": "end", class: "title" }, svg, "compute ");
    mark(sv("tspan", {}, ct, withUnit(peak, "GFLOP/s")), ["roofline", "roofs", "peak_gflops"], peak);
    drawRoof(bw, "DRAM", "", ["roofline", "roofs", "peak_gbps"]);
    caches.forEach((c) => drawRoof(c.gbps, c.level, "6 4", ["roofline", "roofs", "caches", roofs.caches.indexOf(c), "gbps"]));
    // points, biggest first so that small ones stay on top
    const tmax = Math.max(...pts.map(([v]) => v.time_ns || 0), 1);
    const sorted = pts.slice().sort((a, b) => (b[0].time_ns || 0) - (a[0].time_ns || 0));
    for (const [v, i] of sorted) {
      const phase = (v.scope || "").split(" ")[0];
      const r = 4 + 12 * Math.sqrt((v.time_ns || 0) / tmax);
      const c = sv("circle", { cx: x(v.intensity), cy: y(v.gflops), r, fill: phaseColor(phase), "fill-opacity": 0.75,
        stroke: "#fff", "stroke-width": 1.2, class: "verdict" }, svg);
      mark(tip(c, `${v.scope}: ${sig3(v.intensity)} FLOP/B, ${sig3(v.gflops)} GFLOP/s, ${v.bound}-bound, ${time(v.time_ns)}`),
        ["roofline", "verdicts", i, "gflops"], v.gflops);
    }
    // labels of the larger points, on the right margin, joined to their point
    const labelled = sorted.slice(0, 10).sort((a, b) => y(a[0].gflops) - y(b[0].gflops));
    let ly = box.t + 4;
    for (const [v] of labelled) {
      const py = Math.max(ly, Math.min(y(v.gflops), box.b - 4));
      sv("line", { x1: x(v.intensity), y1: y(v.gflops), x2: box.r + 12, y2: py, stroke: "#c0c6d0", "stroke-width": 0.8 }, svg);
      sv("text", { x: box.r + 16, y: py + 4 }, svg, v.scope);
      ly = py + 15;
    }
    const phases = [...new Set(pts.map(([v]) => (v.scope || "").split(" ")[0]))].sort(byPhase);
    legend(s, [...phases.map((p) => [p, phaseColor(p)]), ["roof: solid (DRAM, compute), dashed (caches)", "var(--roof)"]]);
    const cols = ["scope", "nodes", "time", "FLOP/B", "GFLOP/s", "GB/s", "bound", "of its roof"];
    const hasRoof = R.verdicts.some((v) => v.roof), hasNotes = R.verdicts.some((v) => v.notes);
    if (hasRoof) cols.push("roof");
    if (hasNotes) cols.push("notes");
    const tb = table(s, cols);
    R.verdicts.forEach((v, i) => {
      const tr = el("tr", {}, tb), p = ["roofline", "verdicts", i];
      el("td", { class: "name" }, tr, v.scope);
      num(tr, "td", [...p, "nodes"], v.nodes, count(v.nodes));
      num(tr, "td", [...p, "time_ns"], v.time_ns, time(v.time_ns));
      num(tr, "td", [...p, "intensity"], v.intensity, sig3(v.intensity));
      num(tr, "td", [...p, "gflops"], v.gflops, sig3(v.gflops));
      num(tr, "td", [...p, "gbps"], v.gbps, sig3(v.gbps));
      el("span", { class: "badge bound-" + v.bound }, el("td", {}, tr), v.bound || "–");
      num(tr, "td", [...p, "roof_share"], v.roof_share, pct(v.roof_share));
      if (hasRoof) el("td", {}, tr, v.roof ? `${v.roof}${isNum(v.roof_gbps) ? " " + sig3(v.roof_gbps) + " GB/s" : ""}` : "–");
      if (hasNotes) el("td", { class: "name" }, tr, Array.isArray(v.notes) ? v.notes.join("; ") : (v.notes || ""));
    });
  }

  // Time per transformer layer, a bar per phase.
  function layers() {
    const rows = S.layers;
    if (!Array.isArray(rows) || !rows.length) return;
    const s = section("Per layer",
      "Node time per transformer layer (each node counted once: its longest thread's slice), summed over the run.");
    const phases = [...new Set(rows.map((r) => r.phase))].sort(byPhase);
    const ids = [...new Set(rows.map((r) => r.layer))].sort((a, b) => (a === null) - (b === null) || a - b);
    legend(s, phases.map((p) => [p, phaseColor(p)]));
    const W = 1100, H = 300, box = { l: 70, r: W - 12, t: 22, b: H - 46 };
    const svg = svgBox(s, W, H, "per-layer time");
    const ymax = Math.max(...rows.map((r) => r.time_ns)) * 1.12 / 1e6 || 1;
    const y = linear(0, ymax, box.b, box.t);
    const slot = (box.r - box.l) / ids.length, bw = Math.min(46, (slot * 0.8) / phases.length);
    axes(svg, box, () => 0, y, [], linTicks(0, ymax, 5), "", "time (ms)");
    sv("text", { x: (box.l + box.r) / 2, y: box.b + 36, "text-anchor": "middle", class: "title" }, svg, "layer");
    const labelBars = ids.length * phases.length <= 24;
    ids.forEach((id, k) => {
      const cx = box.l + slot * (k + 0.5);
      sv("text", { x: cx, y: box.b + 16, "text-anchor": "middle", class: "muted" }, svg, id === null ? "outside layers" : String(id));
      phases.forEach((ph, j) => {
        const i = rows.findIndex((r) => r.layer === id && r.phase === ph);
        if (i < 0) return;
        const r = rows[i], bx = cx - (bw * phases.length) / 2 + j * bw, top = y(r.time_ns / 1e6);
        mark(tip(sv("rect", { x: bx + 1, y: top, width: bw - 2, height: box.b - top, fill: phaseColor(ph), rx: 2, class: "layer" }, svg),
          `layer ${id === null ? "outside" : id}, ${ph}: ${time(r.time_ns)} over ${count(r.nodes)} nodes`), ["layers", i, "time_ns"], r.time_ns);
        if (labelBars) mark(sv("text", { x: bx + bw / 2, y: top - 4, "text-anchor": "middle", "font-size": 10 }, svg, time(r.time_ns)),
          ["layers", i, "time_ns"], r.time_ns);
      });
    });
    const ctx = S.decode_by_context;
    if (Array.isArray(ctx) && ctx.length) {
      el("h3", {}, s, "Decode time against context (KV length attention reads)");
      const tb = table(s, ["KV length", "calls", "per call", "attention per call"]);
      ctx.forEach((c, i) => {
        const tr = el("tr", {}, tb);
        num(tr, "td", ["decode_by_context", i, "kv_len"], c.kv_len, count(c.kv_len));
        num(tr, "td", ["decode_by_context", i, "calls"], c.calls, count(c.calls));
        num(tr, "td", ["decode_by_context", i, "mean_call_ns"], c.mean_call_ns, time(c.mean_call_ns));
        num(tr, "td", ["decode_by_context", i, "mean_attention_ns"], c.mean_attention_ns, time(c.mean_attention_ns));
      });
    }
  }

  function threads() {
    const th = S.threads;
    if (!Array.isArray(th) || !th.length) return;
    const s = section("Threads", "Per thread: time in ops, waiting at barriers, arriving late to a graph, and its graphs' time.");
    const cols = [["op_ns", "in ops"], ["barrier_ns", "at barriers"], ["arrival_ns", "arrival"], ["graph_ns", "graphs"]]
      .filter(([k]) => th.some((t) => k in t));
    const tb = table(s, ["thread", ...cols.map((c) => c[1])]);
    th.forEach((t, i) => {
      const tr = el("tr", {}, tb);
      el("td", {}, tr, `${t.tid}${t.name ? " " + t.name : ""}`);
      for (const [k] of cols) num(tr, "td", ["threads", i, k], t[k], time(t[k]));
    });
  }

  function cuda() {
    const C = S.cuda;
    if (!C) return;
    const s = section("CUDA", "Kernels launched (top 15 by launches), copies and sets by kind, and where the host waited (syncs).");
    const kt = table(s, ["kernel", "launches", "captured", "configs", "launched by op"]);
    Object.entries(C.kernels || {}).slice(0, 15).forEach(([name, k]) => {
      const tr = el("tr", {}, kt);
      el("td", { class: "name", title: name }, tr, name);
      num(tr, "td", ["cuda", "kernels", name, "launches"], k.launches, count(k.launches));
      num(tr, "td", ["cuda", "kernels", name, "captured"], k.captured, count(k.captured));
      el("td", {}, tr, count(Object.keys(k.configs || {}).length));
      el("td", { class: "name" }, tr, Object.entries(k.ops || {}).sort((a, b) => b[1] - a[1]).slice(0, 3)
        .map(([op, n]) => `${op} ${count(n)}`).join(", "));
    });
    const copies = Object.entries(C.copies || {});
    if (copies.length) {
      el("h3", {}, s, "Copies and sets by kind");
      const tb = table(s, ["kind", "calls", "bytes", "host time"]);
      copies.forEach(([kind, c]) => {
        const tr = el("tr", {}, tb);
        el("td", {}, tr, kind);
        num(tr, "td", ["cuda", "copies", kind, "calls"], c.calls, count(c.calls));
        num(tr, "td", ["cuda", "copies", kind, "bytes"], c.bytes, mib(c.bytes));
        num(tr, "td", ["cuda", "copies", kind, "host_ns"], c.host_ns, time(c.host_ns));
      });
    }
    const syncs = Object.entries(C.syncs || {});
    if (syncs.length) {
      el("h3", {}, s, "Where the host waited for the GPU");
      const tb = table(s, ["call", "calls", "blocked", "longest"]);
      syncs.forEach(([api, c]) => {
        const tr = el("tr", {}, tb);
        el("td", {}, tr, api);
        num(tr, "td", ["cuda", "syncs", api, "calls"], c.calls, count(c.calls));
        num(tr, "td", ["cuda", "syncs", api, "blocked_ns"], c.blocked_ns, time(c.blocked_ns));
        num(tr, "td", ["cuda", "syncs", api, "max_ns"], c.max_ns, time(c.max_ns));
      });
    }
    const m = C.memory;
    if (m) {
      const p = el("p", {}, s, "Device memory: peak ");
      num(p, "span", ["cuda", "memory", "device_peak_bytes"], m.device_peak_bytes, mib(m.device_peak_bytes));
      p.appendChild(document.createTextNode(", live at the end "));
      num(p, "span", ["cuda", "memory", "device_live_bytes_at_end"], m.device_live_bytes_at_end, mib(m.device_live_bytes_at_end));
      p.appendChild(document.createTextNode("; allocations "));
      num(p, "span", ["cuda", "memory", "allocations"], m.allocations, count(m.allocations));
      p.appendChild(document.createTextNode(", frees "));
      num(p, "span", ["cuda", "memory", "frees"], m.frees, count(m.frees));
    }
  }

  function profilerCost() {
    const c = S.profiler_cost;
    if (!c) return;
    const s = section("What profiling cost", "The probes' own time, from the kernel's BPF accounting and the calibrated cost of a probe hit.");
    const p = el("p", {}, s, "BPF programs ran ");
    num(p, "span", ["profiler_cost", "bpf_runs"], c.bpf_runs, count(c.bpf_runs));
    p.appendChild(document.createTextNode(" times for "));
    num(p, "span", ["profiler_cost", "bpf_ns"], c.bpf_ns, time(c.bpf_ns));
    if (isNum(c.trap_ns)) {
      p.appendChild(document.createTextNode("; probe traps about "));
      num(p, "span", ["profiler_cost", "trap_ns"], c.trap_ns, time(c.trap_ns));
    }
    if (isNum(c.in_target_share)) {
      p.appendChild(document.createTextNode("; in the target, "));
      num(p, "span", ["profiler_cost", "in_target_share"], c.in_target_share, pct(c.in_target_share));
      p.appendChild(document.createTextNode(" of its CPU time"));
    }
    p.appendChild(document.createTextNode("."));
  }

  // A figure in its quantity's unit (the flight recorder's: seconds, tokens/s, tokens), marked:
  // seconds shown as a time (data-scale 1e9: the text reads in ns).
  function inUnit(parent, tag, path, v, unit) {
    if (unit === "s") return mark(el(tag, {}, parent, time(isNum(v) ? v * 1e9 : v)), path, v, 1e9);
    if (unit === "tokens/s") return num(parent, tag, path, v, rate(v, "tok/s"));
    const e = num(parent, tag, path, v, sig3(v));
    if (unit) parent.appendChild(document.createTextNode(" " + unit));
    return e;
  }
  const text = (parent, t) => parent.appendChild(document.createTextNode(t));

  // A flight recorder's capture: what fired it, the trigger's series around the moment, and
  // what changed against the baseline before the incident.
  function flight() {
    const F = S.flight;
    if (!F || !F.fired) return;
    const f = F.fired, unit = f.unit || "s", P = ["flight", "fired"];
    const s = section("Flight recorder: why this capture was made",
      "The daemon's trigger fired on the process's own series; the capture that followed is the rest of this page.");
    const p = el("p", {}, s);
    el("b", {}, p, String(f.trigger ?? "a trigger"));
    text(p, ` fired: ${f.stat ?? ""} `);
    inUnit(p, "span", [...P, "value"], f.value, unit);
    text(p, ` ${f.below ? "<" : ">"} limit `);
    inUnit(p, "span", [...P, "limit"], f.limit, unit);
    if (isNum(f.baseline)) { text(p, ", baseline "); inUnit(p, "span", [...P, "baseline"], f.baseline, unit); }
    text(p, "; captured ");
    mark(el("span", {}, p, time(isNum(F.record_for_s) ? F.record_for_s * 1e9 : null)), ["flight", "record_for_s"], F.record_for_s, 1e9);
    text(p, ` at ${(F.levels || []).join(", ") || "–"}.`);
    for (const [level, why] of Object.entries(F.left_out || {})) el("p", { class: "warn" }, s, `left out: ${level} (${why})`);
    flightChart(s, f, unit);
    flightChanges(s, F);
  }

  function flightChart(s, f, unit) {
    const pts = [];
    (f.series || []).forEach((q, j) => pts.push([q, ["flight", "fired", "series", j, "value"]]));
    (f.series_after || []).forEach((q, j) => {
      if (!pts.length || q.t > pts[pts.length - 1][0].t) pts.push([q, ["flight", "fired", "series_after", j, "value"]]);
    });
    const shown = pts.filter(([q]) => isNum(q.t) && isNum(q.value));
    if (!shown.length) return;
    const at = isNum(f.fired_monotonic_s) ? f.fired_monotonic_s : shown[shown.length - 1][0].t;
    const k = unit === "s" ? 1e3 : 1, ylab = unit === "s" ? "ms" : unit;   // seconds drawn in ms
    el("h3", {}, s, `${f.quantity ?? ""} ${f.stat ?? ""} per second around the firing`);
    const W = 1100, H = 240, box = { l: 78, r: W - 130, t: 14, b: H - 44 };
    const svg = svgBox(s, W, H, "the trigger's series");
    const xs = shown.map(([q]) => q.t - at);
    const x0 = Math.min(...xs, 0), x1 = Math.max(...xs, 0);
    const ymax = Math.max(...shown.map(([q]) => q.value), isNum(f.limit) ? f.limit : 0, isNum(f.baseline) ? f.baseline : 0) * k * 1.15 || 1;
    const x = linear(x0, x1, box.l, box.r), y = linear(0, ymax, box.b, box.t);
    axes(svg, box, x, y, linTicks(x0, x1, 10), linTicks(0, ymax, 5), "seconds from the firing", `${f.stat ?? ""} (${ylab})`);
    sv("line", { x1: x(0), x2: x(0), y1: box.t, y2: box.b, stroke: "var(--slower)", "stroke-width": 1.5 }, svg);
    sv("text", { x: x(0) + 4, y: box.t + 10, class: "title" }, svg, "fired");
    const level = (v, path, label, dash) => {
      if (!isNum(v)) return;
      sv("line", { x1: box.l, x2: box.r, y1: y(v * k), y2: y(v * k), stroke: "var(--ink)", "stroke-dasharray": dash, "stroke-width": 1.2 }, svg);
      const t = sv("text", { x: box.r + 6, y: y(v * k) + 4 }, svg, label + " ");
      const shownValue = unit === "s" ? time(v * 1e9) : sig3(v);
      mark(sv("tspan", {}, t, shownValue), path, v, unit === "s" ? 1e9 : undefined);
    };
    level(f.limit, ["flight", "fired", "limit"], "limit", "6 4");
    level(f.baseline, ["flight", "fired", "baseline"], "baseline", "2 3");
    sv("polyline", { points: shown.map(([q]) => `${x(q.t - at)},${y(q.value * k)}`).join(" "), fill: "none",
      stroke: "var(--decode)", "stroke-width": 1.8 }, svg);
    for (const [q, path] of shown) {
      mark(tip(sv("circle", { cx: x(q.t - at), cy: y(q.value * k), r: 3, fill: "var(--decode)", class: "flight-point" }, svg),
        `${(q.t - at).toFixed(0)} s: ${unit === "s" ? time(q.value * 1e9) : sig3(q.value)} over ${count(q.samples)} samples`), path, q.value);
    }
  }

  const VERDICT_CLASS = (v) => (/^outside/.test(v) ? "verdict-slower" : (v === "new" || v === "gone") ? "verdict-uncertain" : "");

  function flightChanges(s, F) {
    const rows = F.changes || [];
    if (!F.baseline || !F.incident) {
      el("p", { class: "note" }, s, "No comparison with a baseline: the daemon had not counted this process long enough before the incident.");
      return;
    }
    el("h3", {}, s, "What changed: the incident against the baseline before it");
    const p = el("p", { class: "note" }, s, "The daemon's own counts: the incident's ");
    mark(el("span", {}, p, time(F.incident.seconds * 1e9)), ["flight", "incident", "seconds"], F.incident.seconds, 1e9);
    text(p, " before its capture against the baseline's ");
    mark(el("span", {}, p, time(F.baseline.seconds * 1e9)), ["flight", "baseline", "seconds"], F.baseline.seconds, 1e9);
    text(p, " (");
    num(p, "span", ["flight", "baseline", "intervals"], F.baseline.intervals, count(F.baseline.intervals));
    text(p, " intervals; under a baseline's figure, their lowest..highest). Outside: beyond that range.");
    if (!rows.length) return;
    const tb = table(s, ["what", "item", "share: baseline", "incident", "time a call: baseline", "incident",
      "a second: baseline", "incident", "verdict"]);
    const figure = (tr, r, i, side, key, fmt, scale) => {
      const td = el("td", {}, tr), f = r[side];
      if (!f || f[key] === null || f[key] === undefined || (key === "s_per_call" && !f[key])) { td.textContent = "–"; return; }
      const path = ["flight", "changes", i, side];
      const put = (parent, k, v) => mark(el("span", {}, parent, fmt(scale ? v * scale : v)), [...path, ...k], v, scale);
      put(td, [key], f[key]);
      const span = f[key + "_range"];
      if (Array.isArray(span)) {      // the baseline's range, under its figure
        const m = el("div", { class: "range" }, td, "");
        put(m, [key + "_range", 0], span[0]);
        text(m, "..");
        put(m, [key + "_range", 1], span[1]);
      }
    };
    rows.forEach((r, i) => {
      const tr = el("tr", {}, tb);
      el("td", {}, tr, (LABELS.flight_families || {})[r.family] || r.family);
      el("td", { class: "name", title: String(r.item) }, tr, String(r.item));
      for (const side of ["baseline", "incident"]) figure(tr, r, i, side, "share", pct);
      for (const side of ["baseline", "incident"]) figure(tr, r, i, side, "s_per_call", time, 1e9);
      for (const side of ["baseline", "incident"]) figure(tr, r, i, side, "per_s", (v) => (isNum(v) ? fixed(v, 1) : "–"));
      el("span", { class: "badge " + VERDICT_CLASS(r.verdict) }, el("td", { class: "wrap" }, tr), r.verdict);
    });
  }

  // Perf counters per op type and per phase (scaled for multiplexing; counted ops only).
  function counters() {
    const C = S.counters;
    if (!C || !Array.isArray(C.names)) return;
    const names = C.names;
    const s = section("Perf counters",
      `Per op type and per phase, the counters read at each op's start and end (${names.join(", ") || "none"}), ` +
      "summed over the ops counted (scaled where the kernel multiplexed them), and what they give.");
    const dropped = Object.entries(C.dropped_ops || {}).filter(([, n]) => n);
    if (dropped.length) {
      const p = el("p", { class: "warn" }, s, "Ops not counted: ");
      dropped.forEach(([why, n], j) => {
        if (j) text(p, ", ");
        num(p, "span", ["counters", "dropped_ops", why], n, count(n));
        text(p, ` ${why}`);
      });
    }
    for (const note of C.notes || []) el("p", { class: "warn" }, s, note);
    const metrics = [...new Set([...(C.ops || []), ...Object.values(C.phases || {})].flatMap((r) => Object.keys(r.derived || {})))];
    const rowCells = (tr, r, path) => {
      num(tr, "td", [...path, "counted"], r.counted, count(r.counted));
      num(tr, "td", [...path, "dur_ns"], r.dur_ns, time(r.dur_ns));
      for (const n of names) num(tr, "td", [...path, "totals", n], (r.totals || {})[n], count((r.totals || {})[n]));
      for (const m of metrics) {
        const v = (r.derived || {})[m];
        if (v === undefined) el("td", {}, tr, "–");
        else num(tr, "td", [...path, "derived", m], v, isNum(v) ? fixed(v, 2) : "–");
      }
    };
    const cols = ["counted", "time", ...names, ...metrics];
    if ((C.ops || []).length) {
      el("h3", {}, s, "Per op type");
      const tb = table(s, ["op", ...cols]);
      C.ops.forEach((r, i) => { const tr = el("tr", {}, tb); el("td", { class: "name" }, tr, r.op); rowCells(tr, r, ["counters", "ops", i]); });
    }
    const phases = Object.entries(C.phases || {}).sort((a, b) => byPhase(a[0], b[0]));
    if (phases.length) {
      el("h3", {}, s, "Per phase");
      const tb = table(s, ["phase", ...cols]);
      for (const [ph, r] of phases) { const tr = el("tr", {}, tb); el("td", {}, tr, ph); rowCells(tr, r, ["counters", "phases", ph]); }
    }
    const perTok = Object.entries(C.per_token || {});
    if (perTok.length) {
      el("h3", {}, s, "Per token");
      const tb = table(s, ["phase", ...names]);
      for (const [ph, vals] of perTok) {
        const tr = el("tr", {}, tb);
        el("td", {}, tr, ph);
        for (const n of names) num(tr, "td", ["counters", "per_token", ph, n], vals[n], sig3(vals[n]));
      }
    }
  }

  // Each target thread's time on and off the CPU, from its context switches and wakeups.
  const SCHED_PARTS = [["on CPU", "var(--accent)"], ["preempted", "var(--slower)"],
    ["waiting for a CPU after a wakeup", "var(--uncertain)"], ["sleeping", "var(--other)"]];
  function sched() {
    const D = S.sched;
    if (!D || !Array.isArray(D.threads)) return;
    const s = section("Scheduling: on and off the CPU",
      "Each thread of the target from its first context switch or wakeup on: on a CPU, preempted (taken off while " +
      "runnable, and who ran instead), waiting for a CPU after a wakeup, and sleeping; runnable is the two waits together.");
    const p = el("p", {}, s);
    num(p, "span", ["sched", "switches"], D.switches, count(D.switches));
    text(p, " context switches, ");
    num(p, "span", ["sched", "wakeups"], D.wakeups, count(D.wakeups));
    text(p, " wakeups.");
    const th = D.threads.map((t, i) => [t, i]);
    const total = (t) => t.on_cpu_ns + t.runnable_ns + t.sleeping_ns;
    const drawn = th.filter(([t]) => total(t) > 0);
    if (drawn.length) {
      legend(s, SCHED_PARTS);
      const lane = 22, W = 1100, box = { l: 200, r: W - 20, t: 6, b: 6 + drawn.length * (lane + 6) };
      const svg = svgBox(s, W, box.b + 40, "scheduling per thread");
      const tmax = Math.max(...drawn.map(([t]) => total(t)));
      const x = linear(0, tmax / 1e6, box.l, box.r);
      axes(svg, box, x, () => 0, linTicks(0, tmax / 1e6, 10), [], "time (ms)", "");
      drawn.forEach(([t, i], row) => {
        const ty = box.t + row * (lane + 6);
        sv("text", { x: box.l - 6, y: ty + lane - 7, "text-anchor": "end" }, svg, `${t.tid}${t.name ? " " + t.name : ""}`);
        const parts = [[t.on_cpu_ns, "on_cpu_ns"], [t.preempted_ns, "preempted_ns"], [t.runnable_ns - t.preempted_ns, null],
          [t.sleeping_ns, "sleeping_ns"]];
        let at = 0;
        parts.forEach(([ns, key], j) => {
          if (!(ns > 0)) return;
          const r = tip(sv("rect", { x: x(at / 1e6), y: ty, width: Math.max(0.5, x((at + ns) / 1e6) - x(at / 1e6)), height: lane,
            fill: SCHED_PARTS[j][1], class: "sched" }, svg), `${t.tid}: ${SCHED_PARTS[j][0]} ${time(ns)}`);
          if (key) mark(r, ["sched", "threads", i, key], ns);
          at += ns;
        });
      });
    }
    const tb = table(s, ["thread", "on CPU", "preempted", "preemptions", "runnable", "sleeping", "preempted by (top 3)"]);
    th.forEach(([t, i]) => {
      const tr = el("tr", {}, tb), P = ["sched", "threads", i];
      el("td", {}, tr, `${t.tid}${t.name ? " " + t.name : ""}`);
      num(tr, "td", [...P, "on_cpu_ns"], t.on_cpu_ns, time(t.on_cpu_ns));
      num(tr, "td", [...P, "preempted_ns"], t.preempted_ns, time(t.preempted_ns));
      num(tr, "td", [...P, "preemptions"], t.preemptions, count(t.preemptions));
      num(tr, "td", [...P, "runnable_ns"], t.runnable_ns, time(t.runnable_ns));
      num(tr, "td", [...P, "sleeping_ns"], t.sleeping_ns, time(t.sleeping_ns));
      const by = el("td", { class: "wrap" }, tr);
      (t.preempted_by || []).slice(0, 3).forEach((b, j) => {
        if (j) text(by, ", ");
        text(by, `${b.comm} `);
        num(by, "span", [...P, "preempted_by", j, "ns"], b.ns, time(b.ns));
      });
      if (!(t.preempted_by || []).length) by.textContent = "–";
    });
    if (Array.isArray(D.ops) && D.ops.length) {
      el("h3", {}, s, "Ops while their thread was not running");
      const ot = table(s, ["op", "runs", "op time", "preempted", "runnable", "sleeping"]);
      D.ops.forEach((o, i) => {
        const tr = el("tr", {}, ot), P = ["sched", "ops", i];
        el("td", { class: "name" }, tr, o.op);
        num(tr, "td", [...P, "count"], o.count, count(o.count));
        num(tr, "td", [...P, "op_ns"], o.op_ns, time(o.op_ns));
        num(tr, "td", [...P, "preempted_ns"], o.preempted_ns, time(o.preempted_ns));
        num(tr, "td", [...P, "runnable_ns"], o.runnable_ns, time(o.runnable_ns));
        num(tr, "td", [...P, "sleeping_ns"], o.sleeping_ns, time(o.sleeping_ns));
      });
    }
  }

  // Mixture-of-experts routing: how often each layer chose each expert, as heatmaps.
  function moe() {
    const M = S.moe;
    if (!M || !Array.isArray(M.counts) || !M.counts.length) return;
    const s = section("Mixture of experts: expert selections per layer",
      "How many times each MoE layer's router chose each expert (each routed token picks several), " +
      "over the run and per phase; darker is more.");
    const p = el("p", {}, s);
    num(p, "span", ["moe", "activations"], M.activations, count(M.activations));
    text(p, " selections: ");
    num(p, "span", ["moe", "n_used"], M.n_used, count(M.n_used));
    text(p, " of ");
    num(p, "span", ["moe", "n_experts"], M.n_experts, count(M.n_experts));
    text(p, ` experts a token in each of ${count((M.layers || []).length)} layers; routed tokens `);
    Object.entries(M.routed_tokens || {}).forEach(([ph, n], j) => {
      if (j) text(p, ", ");
      text(p, `${ph} `);
      num(p, "span", ["moe", "routed_tokens", ph], n, count(n));
    });
    text(p, ".");
    const maps = [["all phases", M.counts, ["moe", "counts"]],
      ...Object.entries(M.by_phase || {}).sort((a, b) => byPhase(a[0], b[0])).map(([ph, c]) => [ph, c, ["moe", "by_phase", ph]])];
    const row = el("div", { class: "row" }, s);
    for (const [name, counts, path] of maps) {
      const div = el("div", {}, row);
      el("h3", {}, div, name);
      heatmap(div, counts, path, M.layers || []);
    }
  }

  function heatmap(parent, counts, path, layers) {
    const nE = Math.max(...counts.map((r) => r.length));
    const W = 520, box = { l: 54, t: 18 }, cw = Math.max(4, Math.min(48, (W - box.l - 8) / nE)), ch = Math.max(8, Math.min(24, cw));
    const H = box.t + counts.length * ch + 22;
    const svg = svgBox(parent, W, H, "expert selections per layer");
    const peak = Math.max(1, ...counts.flat());
    const labelled = cw >= 26, every = Math.ceil(nE / Math.floor((W - box.l) / 28));
    for (let e = 0; e < nE; e += every) sv("text", { x: box.l + (e + 0.5) * cw, y: box.t - 5, "text-anchor": "middle", class: "muted" }, svg, `e${e}`);
    counts.forEach((r, i) => {
      const y = box.t + i * ch;
      sv("text", { x: box.l - 6, y: y + ch / 2 + 4, "text-anchor": "end", class: "muted" }, svg, `layer ${layers[i] ?? i}`);
      r.forEach((v, e) => {
        const cell = tip(sv("rect", { x: box.l + e * cw, y, width: cw - 1, height: ch - 1, fill: "var(--decode)",
          "fill-opacity": 0.06 + 0.94 * (v / peak), class: "expert" }, svg), `layer ${layers[i] ?? i}, expert ${e}: ${count(v)}`);
        mark(cell, [...path, i, e], v);
        if (labelled) mark(sv("text", { x: box.l + (e + 0.5) * cw, y: y + ch / 2 + 4, "text-anchor": "middle", "font-size": 10,
          style: v / peak > 0.55 ? "fill:#fff" : "" }, svg, count(v)), [...path, i, e], v);
      });
    });
    sv("text", { x: box.l, y: H - 4, class: "muted" }, svg, "expert");
  }

  function footer() {
    const f = el("footer", {}, page);
    el("div", {}, f, "Drawn from profinfer's JSON summary (profinfer report TRACE --json), embedded in this page; it makes no request.");
    const details = el("details", {}, f);
    el("summary", {}, details, `The recording's metadata (${Object.keys(S.meta || {}).length} entries)`);
    const dl = el("dl", {}, details);
    for (const [k, v] of Object.entries(S.meta || {})) {
      el("dt", {}, dl, k);
      el("dd", {}, dl, v);
    }
  }

  page.textContent = "";
  header();
  flight();
  timeline();
  opBreakdown();
  counters();
  roofline();
  layers();
  moe();
  cuda();
  threads();
  sched();
  profilerCost();
  footer();
  document.body.dataset.rendered = "1";
