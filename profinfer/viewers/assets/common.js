// What every page kind shares: the embedded data (S), the page's root, number formats, DOM
// helpers, scales and axes. The page's script is this file and its kind's (report.js,
// diff.js) inside one function (viewers/html.py joins them).
// Every number shown that is one of the data's carries data-key (its path in the data, a JSON
// array) and data-value (the data's value), so that a test can hold the page to it; where its
// text is in another unit than the data's (seconds shown as a time), data-scale says what the
// data's value is multiplied by to be in the text's (1e9: the text reads in ns, as times do).
  const S = JSON.parse(document.getElementById("summary").textContent);
  const page = document.getElementById("page");
  const LABELS = JSON.parse(document.getElementById("labels").textContent);
  // SVG's namespace, as the page's HTML parser gives it (the file names no host)
  const SVG = (() => { const d = document.createElement("div"); d.innerHTML = "<svg></svg>"; return d.firstChild.namespaceURI; })();

  // ---- formatting: fixed decimals, so a shown number says how exact it is ----
  const isNum = (x) => typeof x === "number" && isFinite(x);
  function fixed(x, d) { return x.toLocaleString("en-US", { minimumFractionDigits: d, maximumFractionDigits: d }); }
  function time(ns) {
    if (!isNum(ns)) return "–";
    const a = Math.abs(ns);
    if (a < 1e3) return fixed(ns, 0) + " ns";
    if (a < 1e6) return fixed(ns / 1e3, 1) + " µs";
    if (a < 1e9) return fixed(ns / 1e6, 2) + " ms";
    return fixed(ns / 1e9, 3) + " s";
  }
  function sig3(x) {  // three significant digits, without exponent notation
    if (!isNum(x)) return "–";
    if (x === 0) return "0";
    const d = Math.min(8, Math.max(0, 2 - Math.floor(Math.log10(Math.abs(x)))));
    return fixed(x, d);
  }
  const count = (n) => (isNum(n) ? fixed(n, 0) : "–");
  const pct = (x) => (isNum(x) ? fixed(100 * x, 1) + " %" : "–");
  const mib = (b) => (isNum(b) ? fixed(b / 1048576, 3) + " MiB" : "–");
  const rate = (x, unit) => (isNum(x) ? fixed(x, 1) + " " + unit : "–");
  const withUnit = (x, unit) => (isNum(x) ? sig3(x) + " " + unit : "–");

  // ---- DOM helpers ----
  function el(tag, attrs, parent, text) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  function sv(tag, attrs, parent, text) {
    const e = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    if (parent) parent.appendChild(e);
    return e;
  }
  const barWidth = (w) => (w > 3 ? w - 1 : Math.max(0.8, w));
  function tip(e, text) { sv("title", {}, e, text); return e; }
  // A shown number of the summary: its path and value ride along for checking.
  function num(parent, tag, path, value, text, attrs) {
    const e = el(tag, attrs || {}, parent, text);
    e.dataset.key = JSON.stringify(path);
    e.dataset.value = JSON.stringify(value === undefined ? null : value);
    return e;
  }
  function mark(e, path, value, scale) {
    e.setAttribute("data-key", JSON.stringify(path));
    e.setAttribute("data-value", JSON.stringify(value === undefined ? null : value));
    if (scale !== undefined) e.setAttribute("data-scale", String(scale));
    return e;
  }
  function section(title, note) {
    const s = el("section", {}, page);
    el("h2", {}, s, title);
    if (note) el("p", { class: "note" }, s, note);
    return s;
  }
  function legend(parent, items) {
    const l = el("div", { class: "legend" }, parent);
    for (const [label, color] of items) {
      const span = el("span", {}, l);
      el("i", { style: "background:" + color }, span);
      span.appendChild(document.createTextNode(label));
    }
  }
  function table(parent, columns) {
    const t = el("table", {}, parent);
    const tr = el("tr", {}, el("thead", {}, t));
    for (const c of columns) el("th", {}, tr, c);
    return el("tbody", {}, t);
  }

  // ---- scales and axes ----
  function linear(d0, d1, r0, r1) {
    const f = (v) => r0 + ((v - d0) / (d1 - d0 || 1)) * (r1 - r0);
    f.domain = [d0, d1];
    return f;
  }
  function logScale(d0, d1, r0, r1) {
    const l0 = Math.log10(d0), l1 = Math.log10(d1);
    const f = (v) => r0 + ((Math.log10(v) - l0) / (l1 - l0 || 1)) * (r1 - r0);
    f.domain = [d0, d1];
    return f;
  }
  function niceTicks(lo, hi, n) {
    const span = hi - lo || 1;
    const raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => span / s <= n) || 10 * mag;
    const out = [];
    for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toFixed(12));
    return out;
  }
  function tickLabel(v) {
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e6 || a < 1e-3) return v.toExponential(0).replace("e+", "e");
    return String(+v.toPrecision(6)).replace(/\B(?=(\d{3})+(?!\d))/g, ",");
  }
  // Axes of a plot box: x along the bottom, y along the left, with grid lines and titles.
  function axes(g, box, x, y, xticks, yticks, xtitle, ytitle, fmt) {
    fmt = fmt || {};
    const ax = sv("g", { class: "axis" }, g);
    for (const t of yticks) {
      const py = y(t.v);
      sv("line", { x1: box.l, x2: box.r, y1: py, y2: py, class: "grid" + (t.major === false ? "" : " major") }, ax);
      if (t.label !== "") sv("text", { x: box.l - 6, y: py + 3.5, "text-anchor": "end", class: "muted" }, ax, t.label);
    }
    for (const t of xticks) {
      const px = x(t.v);
      sv("line", { x1: px, x2: px, y1: box.t, y2: box.b, class: "grid" + (t.major === false ? "" : " major") }, ax);
      if (t.label !== "") sv("text", { x: px, y: box.b + 15, "text-anchor": "middle", class: "muted" }, ax, t.label);
    }
    sv("line", { x1: box.l, x2: box.r, y1: box.b, y2: box.b }, ax);
    sv("line", { x1: box.l, x2: box.l, y1: box.t, y2: box.b }, ax);
    if (xtitle) sv("text", { x: (box.l + box.r) / 2, y: box.b + 34, "text-anchor": "middle", class: "title" }, ax, xtitle);
    if (ytitle) sv("text", { x: 0, y: 0, "text-anchor": "middle", class: "title",
      transform: `translate(${box.l - (fmt.ytitleOffset || 48)},${(box.t + box.b) / 2}) rotate(-90)` }, ax, ytitle);
  }
  const linTicks = (lo, hi, n) => niceTicks(lo, hi, n).map((v) => ({ v, label: tickLabel(v) }));
  function logTicks(lo, hi) {
    const out = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
      for (let m = 1; m < 10; m++) {
        const v = m * Math.pow(10, e);
        if (v >= lo * 0.999 && v <= hi * 1.001) out.push({ v, label: m === 1 ? tickLabel(v) : "", major: m === 1 });
      }
    }
    return out;
  }
  function svgBox(parent, w, h, label) {
    // never drawn larger than designed: a lone chart keeps its text size
    return sv("svg", { viewBox: `0 0 ${w} ${h}`, role: "img", "aria-label": label, style: `max-width:${w}px` }, parent);
  }

