// The pstrain dashboard: one server-sent-event stream, uPlot charts, no polling of tasks.
"use strict";
const KEEP = 600;                  // points of the cluster charts (about ten minutes)
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const times = [];
const series = {};                 // key -> array aligned with times
const charts = {};                 // id -> {plot, keys}
const scalarCharts = {};           // name -> {plot, xs, ys, el}
let last = null;
let lastTables = {};

function push(key, value) {
  if (!series[key]) series[key] = times.map(() => null);
  series[key].push(value);
}

function trim() {
  if (times.length > KEEP) {
    const n = times.length - KEEP;
    times.splice(0, n);
    for (const k in series) series[k].splice(0, n);
  }
}

function lineChart(id, title, keys, labels) {
  const el = document.getElementById(id);
  let c = charts[id];
  if (c && c.keys.join() === keys.join()) {
    c.plot.setData([times, ...keys.map(k => series[k] || times.map(() => null))]);
    return;
  }
  if (c) c.plot.destroy();
  const opts = {
    title, width: 420, height: 220,
    scales: { x: { time: true } },
    series: [{}, ...keys.map((k, i) => ({ label: labels[i], stroke: COLORS[i % COLORS.length], width: 2 }))],
  };
  charts[id] = { keys, plot: new uPlot(opts, [times, ...keys.map(k => series[k] || times.map(() => null))], el) };
}

function renderTasks(tasks) {
  const box = document.getElementById("tasks");
  const seen = new Set();
  for (const t of tasks) {
    seen.add(t.task);
    // Every string from the job (task names, addresses, paths) is text, never markup.
    let el = [...box.children].find(c => c.dataset.task === t.task);
    if (!el) {
      el = document.createElement("div");
      el.className = "task";
      el.dataset.task = t.task;
      box.appendChild(el);
    }
    el.dataset.state = t.state;
    const extra = [];
    if (t.incarnation) extra.push("incarnation " + t.incarnation.slice(0, 8));
    if (t.failures) extra.push(t.failures + " failure(s)");
    if (t.closures_per_s !== undefined) extra.push(t.closures_per_s.toFixed(1) + " closures/s");
    if (t.bytes !== undefined) extra.push((t.bytes / 1048576).toFixed(1) + " MiB in variables");
    if (t.tables && Object.keys(t.tables).length)
      extra.push((tableBytes(t) / 1048576).toFixed(1) + " MiB in tables");
    if (t.rss_bytes) extra.push((t.rss_bytes / 1048576).toFixed(0) + " MiB RSS");
    el.replaceChildren(textDiv("name", t.task), textDiv("state", t.state),
                       textDiv("meta", t.address || ""), textDiv("meta", extra.join(" · ")));
  }
  for (const el of [...box.children]) if (!seen.has(el.dataset.task)) el.remove();
}

// The loss of one step is noise: each scalar is drawn smoothed (an exponential moving
// average, as TensorBoard's smoothing 0.6 does), its raw values a faint line beside it,
// both read on hover.
const SMOOTHING = 0.6;

function ema(ys) {
  const out = [];
  let acc = null;
  for (const y of ys) {
    acc = acc === null ? y : SMOOTHING * acc + (1 - SMOOTHING) * y;
    out.push(acc);
  }
  return out;
}

function renderScalars(scalars) {
  const box = document.getElementById("scalars");
  for (const name of Object.keys(scalars)) {
    let c = scalarCharts[name];
    if (!c) {
      const none = document.getElementById("no-scalars");
      if (none) none.remove();
      const el = document.createElement("div");
      el.className = "chart scalar";
      el.dataset.scalar = name;
      box.appendChild(el);
      c = scalarCharts[name] = { xs: [], ys: [], el, plot: null };
    }
    for (const [step, value] of scalars[name]) { c.xs.push(step); c.ys.push(value); }
    // steps may arrive out of order from several workers: draw them sorted
    const order = c.xs.map((_, i) => i).sort((a, b) => c.xs[a] - c.xs[b]);
    const ys = order.map(i => c.ys[i]);
    const smooth = ema(ys);
    const data = [order.map(i => c.xs[i]), smooth, ys];
    c.el.dataset.points = String(c.xs.length);
    c.el.dataset.smoothed = String(smooth[smooth.length - 1]);
    if (!c.plot) {
      c.plot = new uPlot({ title: name, width: 420, height: 220, scales: { x: { time: false } },
        series: [{ label: "step" }, { label: name + " (smoothed)", stroke: COLORS[0], width: 2 },
                 { label: "raw", stroke: "rgba(31,119,180,0.25)", width: 1 }] }, data, c.el);
    } else {
      c.plot.setData(data);
    }
  }
}

function tableBytes(t) {
  let n = 0;
  for (const name in t.tables) n += t.tables[name].bytes || 0;
  return n;
}

// Each dynamic table over every ps: rows (against the capacity), admitted and evicted per
// second, bytes; for tables tiered on their ps (--memory-budget), the rows on disk, the hit
// rate of lookups since the last refresh (hitRate), reads from disk per second, their worst
// p99 latency, how the ps read (io_uring, or one pread a run of records: a kernel or a
// container without io_uring), and the share of the rows read from disk that the page cache
// held (pageCache).
function renderTables(state, dt) {
  const totals = {};
  for (const t of state.tasks) {
    if (t.job !== "ps" || !t.tables) continue;
    for (const name in t.tables) {
      const s = t.tables[name];
      const a = totals[name] || (totals[name] = { rows: 0, capacity: 0, admitted: 0, evicted: 0, bytes: 0, unbounded: false,
                                                   tiered: false, cold: 0, disk: 0, looked: 0, promoted: 0, reads: 0, p99: 0, ways: new Set(),
                                                   rowsRead: 0, cached: 0 });
      a.rows += s.rows; a.admitted += s.admitted; a.evicted += s.evicted; a.bytes += s.bytes;
      if (s.capacity) a.capacity += s.capacity; else a.unbounded = true;
      if (s.cold_rows !== undefined) {
        a.tiered = true; a.cold += s.cold_rows; a.disk += s.disk_bytes; a.looked += s.looked_up;
        a.promoted += s.promoted; a.reads += s.cold_reads; a.p99 = Math.max(a.p99, s.cold_read_p99_us);
        a.ways.add(s.cold_reads_io_uring ? "io_uring" : "pread");
        a.rowsRead += s.cold_rows_read || 0; a.cached += s.cold_rows_from_page_cache || 0;
      }
    }
  }
  const rate = (name, key) => {
    const before = lastTables[name];
    return before && dt ? Math.max(0, (totals[name][key] - before[key]) / dt).toFixed(1) : "–";
  };
  const names = Object.keys(totals).sort();
  const table = document.getElementById("tables");
  table.replaceChildren(row("th", ["table", "rows", "capacity", "admitted/s", "evicted/s", "MiB", "on disk", "hit %",
                                   "disk reads/s", "p99 µs", "reads by", "page cache %"]),
    ...names.map(name => {
      const a = totals[name];
      const tiered = (text) => a.tiered ? text : "–";
      const tr = row("td", [name, a.rows.toLocaleString(), a.unbounded ? "no limit" : a.capacity.toLocaleString(),
                            rate(name, "admitted"), rate(name, "evicted"), (a.bytes / 1048576).toFixed(1),
                            tiered(a.cold.toLocaleString() + " (" + (a.disk / 1048576).toFixed(1) + " MiB)"),
                            tiered(hitRate(a, lastTables[name])),
                            tiered(rate(name, "reads")), tiered(String(a.p99)), tiered([...a.ways].sort().join(" and ")),
                            tiered(pageCache(a, lastTables[name]))]);
      tr.dataset.table = name;
      tr.dataset.rows = String(a.rows);
      if (a.tiered) tr.dataset.cold = String(a.cold);
      return tr;
    }));
  document.getElementById("no-tables").hidden = names.length > 0;
  lastTables = totals;
}

// The share of a tiered table's training lookups that found their rows in RAM since the
// last refresh (what the hot set does now: a fill long past would hide it), or since its
// ps started while nothing has been looked up between refreshes.
function hitRate(now, before) {
  const looked = before ? now.looked - before.looked : 0;
  if (looked > 0) return (100 * (1 - (now.promoted - before.promoted) / looked)).toFixed(1);
  return now.looked ? (100 * (1 - now.promoted / now.looked)).toFixed(1) : "–";
}

// The share of a tiered table's rows read from disk since the last refresh that its ps
// found in the page cache (read on its serving loop, no thread), or since its ps started
// while nothing has been read between refreshes.
function pageCache(now, before) {
  const read = before ? now.rowsRead - before.rowsRead : 0;
  if (read > 0) return (100 * (now.cached - before.cached) / read).toFixed(1);
  return now.rowsRead ? (100 * now.cached / now.rowsRead).toFixed(1) : "–";
}

function textDiv(cls, text) {
  const div = document.createElement("div");
  div.className = cls;
  div.textContent = String(text);
  return div;
}

function row(tag, cells) {
  const tr = document.createElement("tr");
  for (const cell of cells) {
    const td = document.createElement(tag);
    td.textContent = String(cell);
    tr.appendChild(td);
  }
  return tr;
}

// The placement map: its version, each ps's share of the variables (a bar against the
// largest), the move under way and the lost ps replaced from a checkpoint.
function renderPlacement(p) {
  if (!p) return;
  const most = Math.max(1, ...p.ps.map(s => s.bytes));
  const table = document.getElementById("placement");
  const tables = (s) => Object.entries(s.table_shares || {})
    .map(([name, share]) => `${name} ${(100 * share).toFixed(1)}%`).join(", ");
  table.replaceChildren(row("th", ["ps", "address", "in the job", "share", "", "dynamic tables"]),
                        ...p.ps.map(s => {
    const tr = row("td", ["ps:" + s.index, s.address || "(left)", s.active ? "yes" : "left",
                          (s.bytes / 1048576).toFixed(1) + " MiB", "", tables(s)]);
    tr.dataset.ps = String(s.index);
    const bar = document.createElement("span");
    bar.className = "share";
    bar.style.width = Math.round(120 * s.bytes / most) + "px";
    tr.children[4].appendChild(bar);
    return tr;
  }));
  const parts = [`map version ${p.version}`, `${p.moves_done} move(s) done, ` +
                 `${(p.bytes_moved / 1048576).toFixed(1)} MiB moved`];
  if (p.moving) parts.push(`moving ${p.moving.variables.length} variable(s) ps:${p.moving.from} → ` +
                           `ps:${p.moving.to} (${p.moving.seconds} s)`);
  for (const r of p.replaced || [])
    parts.push(`ps:${r.ps} lost, replaced from ${r.checkpoint} in ${r.seconds} s`);
  if ((p.replacing || []).length) parts.push(`replacing ps:${p.replacing.join(", ps:")}`);
  document.getElementById("placement-status").textContent = parts.join(" · ");
}

function renderCheckpoints(saves) {
  const table = document.getElementById("checkpoints");
  table.replaceChildren(row("th", ["saved", "path"]), ...saves.map(s =>
    row("td", [new Date(s.time * 1000).toLocaleTimeString(), s.path])));
}

// The job ended: the coordinator said so as it closed. Every task is shown as finished
// (not "up" under a dead connection) and the page stops reconnecting.
function finish(state) {
  source.close();
  for (const el of document.getElementById("tasks").children) {
    el.dataset.state = "finished";
    const st = el.querySelector(".state");
    if (st) st.textContent = "finished";
  }
  document.body.dataset.finished = "true";
  document.getElementById("status").textContent =
    `finished · ${new Date(state.time * 1000).toLocaleTimeString()} · the coordinator closed; ` +
    (last ? `${last.closures.done} closures done` : "");
}

function update(state) {
  if (state.finished) { finish(state); return; }
  const now = state.time;
  const dt = last ? Math.max(1e-3, now - last.time) : null;
  times.push(now);
  const c = state.closures;
  push("closures_per_s", dt ? (c.done - last.closures.done) / dt : null);
  push("queued", c.queued);
  push("in_flight", c.in_flight);
  const workerKeys = [], workerLabels = [], psMem = [], psReq = [], psBytes = [], psLabels = [];
  for (const t of state.tasks) {
    if (t.job === "worker") {
      const prev = last && last.tasks.find(p => p.task === t.task);
      t.closures_per_s = prev && dt ? (t.completed - prev.completed) / dt : 0;
      push("w:" + t.task, t.closures_per_s);
      workerKeys.push("w:" + t.task); workerLabels.push(t.task);
    } else if (t.job === "ps") {
      const prev = last && last.tasks.find(p => p.task === t.task);
      push("mem:" + t.task, t.rss_bytes ? t.rss_bytes / 1048576 : (t.bytes || 0) / 1048576);
      push("req:" + t.task, prev && dt && t.requests !== undefined ? (t.requests - prev.requests) / dt : null);
      push("mb:" + t.task, prev && dt && t.wire_bytes !== undefined ? (t.wire_bytes - prev.wire_bytes) / dt / 1e6 : null);
      psMem.push("mem:" + t.task); psReq.push("req:" + t.task); psBytes.push("mb:" + t.task); psLabels.push(t.task);
    }
  }
  trim();
  renderTasks(state.tasks);
  lineChart("chart-closures", "closures per second and queue depth", ["closures_per_s", "queued", "in_flight"],
            ["closures/s", "queued", "in flight"]);
  lineChart("chart-workers", "closures per second, per worker", workerKeys, workerLabels);
  lineChart("chart-memory", "ps memory (MiB, RSS)", psMem, psLabels);
  lineChart("chart-requests", "ps requests per second", psReq, psLabels);
  lineChart("chart-bytes", "ps MB per second (in + out)", psBytes, psLabels);
  renderScalars(state.scalars || {});
  renderTables(state, dt);
  renderPlacement(state.placement);
  renderCheckpoints(state.checkpoints || []);
  document.getElementById("status").textContent =
    `live · ${new Date(now * 1000).toLocaleTimeString()} · ${c.done} closures done, ` +
    `${c.retried} retried, ${c.worker_failures} worker failure(s)`;
  document.body.dataset.updates = String((+document.body.dataset.updates || 0) + 1);
  last = state;
}

const source = new EventSource("/events");
source.onmessage = (e) => update(JSON.parse(e.data));
source.onerror = () => {
  if (document.body.dataset.finished) return;
  // Not known any more: no box stays green under a dead connection.
  for (const el of document.getElementById("tasks").children) el.dataset.state = "unknown";
  document.getElementById("status").textContent = "disconnected: retrying…";
};
