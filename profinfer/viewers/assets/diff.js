// The diff page (kind "diff"): a comparison of two recordings drawn (profinfer diff --html), S
// being the JSON that diff --json writes (exporters/diff.schema.json). LABELS.sections holds
// the sections' titles, in the terminal view's order (viewers/difftable.py).
  const VERDICT_COLOR = { slower: "var(--slower)", faster: "var(--faster)", uncertain: "var(--uncertain)" };
  const verdictColor = (v) => VERDICT_COLOR[v] || "var(--other)";
  const verdictClass = (v) => "verdict-" + (VERDICT_COLOR[v] ? v : "other");
  const SIDES = ["before", "after"];
  const GATE_CLASS = { pass: "verdict-faster", fail: "verdict-slower", inconclusive: "verdict-uncertain" };

  // a change as a signed percentage; a row's values in its unit (times in ns, else a count)
  const signedPct = (x) => (isNum(x) ? (x > 0 ? "+" : "") + fixed(100 * x, 1) + " %" : "–");
  const inUnit = (x, unit) => (String(unit).startsWith("ns") ? time(x) : sig3(x));
  const per = (unit) => String(unit).replace(/^ns /, "").replace(/^per /, "");
  const sideName = (run) => (run.traces.length === 1 ? run.traces[0] : `${run.traces.length} runs`);
  const text = (parent, t) => parent.appendChild(document.createTextNode(t));

  function header() {
    const h = el("header", {}, page);
    el("h1", {}, h, `profinfer diff: ${sideName(S.runs.before)} → ${sideName(S.runs.after)}`);
    el("div", { class: "sub" }, h, [S.runs.before.engine, `${S.statistic}s compared`,
      `${fixed(100 * S.confidence, 0)} % intervals`, `noise floor ±${fixed(100 * S.noise, 0)} %`].join(" · "));
    const counts = {};
    for (const c of S.changes) counts[c.verdict] = (counts[c.verdict] || 0) + 1;
    const tiles = el("div", { class: "tiles" }, page);
    const tile = (label, value, cls) => {
      const t = el("div", { class: "tile " + (cls || "") }, tiles);
      el("div", { class: "label" }, t, label);
      el("div", { class: "value" }, t, value);
    };
    tile("quantities compared", count(S.changes.length));
    tile("slower", count(counts.slower || 0), counts.slower ? "verdict-slower" : "");
    tile("faster", count(counts.faster || 0), counts.faster ? "verdict-faster" : "");
    tile("uncertain", count(counts.uncertain || 0), counts.uncertain ? "verdict-uncertain" : "");
    tile("gates", !S.gate ? "none" : S.gate.verdict, S.gate ? GATE_CLASS[S.gate.verdict] : "");
  }

  // Warnings first: a bad recording is not a change.
  function warnings() {
    if (!S.warnings.length) return;
    const box = el("div", { class: "warnings", role: "alert" }, page);
    el("strong", {}, box, S.warnings.length === 1 ? "Warning" : `${S.warnings.length} warnings`);
    const ul = el("ul", {}, box);
    S.warnings.forEach((w) => el("li", {}, ul, w));
  }

  function gates() {
    if (!S.gate) return;
    const s = section("Gates", "The --fail-above rules: fail where a row's interval lies wholly above its limit (exit status 1), inconclusive where it spans it (3), pass where every row lies wholly below (0).");
    const p = el("p", {}, s);
    el("span", { class: "badge " + GATE_CLASS[S.gate.verdict] }, p, S.gate.verdict.toUpperCase());
    text(p, " " + S.gates.map((g) => "--fail-above " + g).join(", ") + ` (${S.gate.passed} rows passed)`);
    if (!S.gate.rows.length) return;
    const tb = table(s, ["gate", "quantity", "change", "interval", "verdict", "why"]);
    S.gate.rows.forEach((r, i) => {
      const tr = el("tr", { class: r.verdict === "fail" ? "failed" : "" }, tb);
      el("td", {}, tr, r.gate);
      el("td", { class: "name" }, tr, r.name);
      num(tr, "td", ["gate", "rows", i, "change"], r.change, signedPct(r.change));
      el("td", { class: "num" }, tr, r.low === null ? "-" : `${signedPct(r.low)} .. ${signedPct(r.high)}`);
      el("td", { class: GATE_CLASS[r.verdict] }, tr, r.verdict);
      el("td", {}, tr, r.why + (r.verdict !== "inconclusive" ? "" : r.runs_needed
        ? `; ${r.runs_needed} runs a side would likely tell` : "; more runs a side may not tell"));
    });
  }

  function sides() {
    const s = section("The two sides", "Several traces a side are pooled: their events and lost events summed, the busiest neighbours, the least coverage.");
    const tb = table(s, ["", "before", "after"]);
    const row = (label, key, fmt, mark) => {
      const tr = el("tr", {}, tb);
      el("td", {}, tr, label);
      for (const side of SIDES) {
        const v = S.runs[side][key];
        if (mark) num(tr, "td", ["runs", side, key], v, fmt(v));
        else el("td", { class: "name" }, tr, fmt(v));
      }
      return tr;
    };
    row("traces", "traces", (t) => t.join(", "));
    row("engine", "engine", (v) => v);
    row("levels", "levels", (v) => v);
    row("events", "events", count, true);
    const lost = row("lost events", "lost_events", count, true);
    if (SIDES.some((side) => S.runs[side].lost_events)) lost.classList.add("failed");
    row("graph time the probes explain", "graph_coverage", pct, true);
    row("other processes' CPU use (CPUs)", "others_cpus", (v) => (isNum(v) ? fixed(v, 2) : "–"), true);
    el("h3", {}, s, "What differs");
    if (S.only_build_differs) el("p", { class: "differs" }, s, "Only the build differs.");
    else if (!S.differences.length) el("p", {}, s, "Nothing the recordings say: the same build, model, machine and threads.");
    if (S.differences.length) {
      const dt = table(s, ["fact", "before", "after"]);
      for (const d of S.differences) {
        const tr = el("tr", {}, dt);
        el("td", {}, tr, d.fact);
        el("td", { class: "name" }, tr, d.before ?? "–");
        el("td", { class: "name" }, tr, d.after ?? "–");
      }
    }
  }

  // The change axis: log of the ratio after/before, so that halving and doubling lie as far
  // from zero; labelled in percent.
  const RATIO_TICKS = [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 1.1, 1.25, 1.5, 2, 3, 5, 10, 100];
  function changeAxis(rows, floors) {
    const ratios = rows.filter((r) => isNum(r.c.change)).map((r) => 1 + r.c.change);
    const bounds = rows.flatMap((r) => [r.c.low, r.c.high]).filter(isNum).map((v) => 1 + v);
    const pts = [...ratios, ...floors.flatMap((f) => [1 - f, 1 + f]), 0.95, 1.05].map((v) => Math.max(v, 1e-3));
    let lo = Math.min(...pts), hi = Math.max(...pts);
    // intervals widen the axis up to four times the points' reach; beyond, they are cut (an arrow)
    lo = Math.max(Math.min(lo, ...bounds.map((v) => Math.max(v, 1e-3))), lo / 4);
    hi = Math.min(Math.max(hi, ...bounds), hi * 4);
    return [lo / 1.05, hi * 1.05];
  }

  // One section's forest plot: a row per quantity, its change a point, its interval a bar,
  // its noise floor a shaded band, colored by verdict.
  function forest(s, rows) {
    const floors = rows.map((r) => r.c.floor).filter(isNum);
    const [lo, hi] = changeAxis(rows, floors);
    const W = 1100, lane = 18, nameW = 300, box = { l: nameW + 10, r: W - 175, t: 8, b: 8 + lane * rows.length };
    const H = box.b + 40;
    const svg = svgBox(s, W, H, "forest plot");
    svg.dataset.domain = JSON.stringify([lo, hi]);     // the ratios it spans: beyond, a point sits at its end
    const x = logScale(lo, hi, box.l, box.r);
    const X = (change) => x(Math.min(hi, Math.max(lo, 1 + change)));
    // ticks at least 44 px apart, the nearest to zero first
    const ticks = [];
    for (const t of RATIO_TICKS.filter((t) => t >= lo && t <= hi).sort((a, b) => Math.abs(Math.log(a)) - Math.abs(Math.log(b)))) {
      if (ticks.every((u) => Math.abs(x(t) - x(u)) >= 44)) ticks.push(t);
    }
    const tickMarks = ticks
      .map((t) => ({ v: t, label: t === 1 ? "0" : (t > 1 ? "+" : "") + fixed(100 * (t - 1), 0) + "%", major: t === 1 }));
    axes(svg, box, x, () => 0, tickMarks, [], `change, after against before (log of the ratio)`, "");
    rows.forEach(({ c, i }, k) => {
      const cy = box.t + lane * (k + 0.5), color = verdictColor(c.verdict);
      const g = sv("g", { class: "row " + verdictClass(c.verdict) }, svg);
      if (k % 2) sv("rect", { x: 0, y: cy - lane / 2, width: W, height: lane, fill: "#f7f8fa" }, g);
      const name = sv("text", { x: nameW, y: cy + 4, "text-anchor": "end" }, g, c.name.length > 46 ? c.name.slice(0, 45) + "…" : c.name);
      tip(name, c.name);
      if (isNum(c.floor)) {
        tip(sv("rect", { x: X(-c.floor), y: cy - lane / 2 + 1, width: X(c.floor) - X(-c.floor), height: lane - 2,
          fill: "#e4e7ec", class: "floor" }, g), `noise floor ±${pct(c.floor)}`);
      }
      if (isNum(c.low) && isNum(c.high)) {
        const bar = sv("line", { x1: X(c.low), x2: X(c.high), y1: cy, y2: cy, stroke: color, "stroke-width": 2.5, class: "interval" }, g);
        mark(bar, ["changes", i, "low"], c.low);
        bar.dataset.high = JSON.stringify(c.high);
        for (const [v, dir] of [[c.low, -1], [c.high, 1]]) {
          if (1 + v < lo || 1 + v > hi) {   // cut at the axis' end: an arrow says it goes on
            const ex = X(v);
            sv("path", { d: `M${ex},${cy - 4} L${ex + 5 * dir},${cy} L${ex},${cy + 4} Z`, fill: color }, g);
          }
        }
      }
      if (isNum(c.change)) {
        const pt = sv("circle", { cx: X(c.change), cy, r: 4.5, fill: color, stroke: "#fff", "stroke-width": 1, class: "change" }, g);
        mark(tip(pt, `${c.name}: ${signedPct(c.change)}` + (isNum(c.low) ? ` (${signedPct(c.low)} .. ${signedPct(c.high)})` : "") +
          `, ${c.verdict}`), ["changes", i, "change"], c.change);
      }
      sv("text", { x: box.r + 8, y: cy + 4, fill: color, class: "verdict" }, g,
        (isNum(c.change) ? signedPct(c.change) + " " : "") + c.verdict);
    });
    legend(s, [["slower", verdictColor("slower")], ["faster", verdictColor("faster")], ["uncertain", verdictColor("uncertain")],
      ["within noise, no change, not judged", verdictColor("")], ["noise floor (±)", "#e4e7ec"]]);
  }

  function changeTable(s, rows, failedNames) {
    const tb = table(s, ["quantity", "before", "after", "change", "interval", "floor", "verdict", "per", "samples"]);
    for (const { c, i } of rows) {
      const tr = el("tr", { class: failedNames.has(c.name) ? "failed" : "" }, tb);
      const p = ["changes", i];
      el("td", { class: "name", title: c.name }, tr, c.name);
      num(tr, "td", [...p, "before"], c.before, inUnit(c.before, c.unit));
      num(tr, "td", [...p, "after"], c.after, inUnit(c.after, c.unit));
      num(tr, "td", [...p, "change"], c.change, signedPct(c.change));
      const iv = el("td", {}, tr);
      if (isNum(c.low)) {
        num(iv, "span", [...p, "low"], c.low, signedPct(c.low));
        text(iv, " .. ");
        num(iv, "span", [...p, "high"], c.high, signedPct(c.high));
      } else text(iv, "–");
      const fl = el("td", {}, tr);
      if (isNum(c.floor)) { text(fl, "±"); num(fl, "span", [...p, "floor"], c.floor, pct(c.floor)); } else text(fl, "–");
      el("span", { class: "badge " + verdictClass(c.verdict), "data-verdict": c.verdict }, el("td", {}, tr), c.verdict);
      el("td", { class: "muted" }, tr, per(c.unit) + (c.statistic !== S.statistic ? ` (${c.statistic})` : ""));
      el("td", { class: "muted" }, tr, `${count(c.before_n)} / ${count(c.after_n)}`);
    }
  }

  function changes() {
    const titles = LABELS.sections || {};
    const bySection = new Map(Object.keys(titles).map((k) => [k, []]));
    S.changes.forEach((c, i) => {
      if (!bySection.has(c.section)) bySection.set(c.section, []);
      bySection.get(c.section).push({ c, i });
    });
    const failedNames = new Set(S.failed.map((f) => f.name));
    for (const [name, rows] of bySection) {
      if (!rows.length) continue;
      const s = section(titles[name] || name, `${rows.length} quantit${rows.length === 1 ? "y" : "ies"}, ` +
        `each the ${S.statistic} per unit of work; the bar is its ${fixed(100 * S.confidence, 0)} % interval.`);
      s.dataset.section = name;
      forest(s, rows);
      changeTable(s, rows, failedNames);
    }
  }

  function verdictsChanged() {
    if (!S.verdicts_changed.length) return;
    const s = section("Roofline verdicts that changed", "What bounds each op type in each phase: memory, compute or neither.");
    const tb = table(s, ["scope", "before", "after"]);
    for (const v of S.verdicts_changed) {
      const tr = el("tr", {}, tb);
      el("td", { class: "name" }, tr, v.scope);
      for (const side of SIDES) el("span", { class: "badge bound-" + v[side] }, el("td", {}, tr), v[side] ?? "–");
    }
  }

  function footer() {
    const f = el("footer", {}, page);
    el("div", {}, f, `Drawn from profinfer's comparison (profinfer diff --json), embedded in this page; it makes no request. ` +
      `Intervals: ${S.method}.`);
  }

  page.textContent = "";
  header();
  warnings();
  gates();
  sides();
  changes();
  verdictsChanged();
  footer();
  document.body.dataset.rendered = "1";
