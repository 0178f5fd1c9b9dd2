"""The page `phalanx watch` serves: plain HTML, CSS and JavaScript drawing SVG, polling /api/state twice a second."""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>phalanx watch</title>
<style>
body { font: 14px system-ui, sans-serif; margin: 16px 24px; color: #222; background: #fafafa; }
h1 { font-size: 18px; margin: 0 0 4px; } h2 { font-size: 15px; margin: 0 0 6px; }
.counts span { display: inline-block; margin-right: 18px; } .counts b { font-size: 16px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 14px; margin-top: 12px; }
.panel { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 10px 12px; }
.empty { color: #999; font-style: italic; } svg text { font-size: 11px; fill: #444; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: right; border-bottom: 1px solid #eee; }
.legend span { margin-right: 12px; font-size: 12px; } .sw { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
</style></head><body>
<h1>phalanx watch <span id="title"></span></h1>
<div style="color:#777">__RUN_DIR__</div>
<div class="counts" id="counts">waiting for the run's files…</div>
<div class="grid">
 <div class="panel"><h2>Loss</h2><div id="loss"></div></div>
 <div class="panel"><h2>Test accuracy</h2><div id="accuracy"></div></div>
 <div class="panel"><h2>Peers per step (events: crash, join, ban by reason)</h2><div id="peers"></div><div id="events" class="legend"></div></div>
 <div class="panel"><h2>BTARD admission</h2><div id="admission"></div></div>
 <div class="panel"><h2>Pipeline stage occupancy (busy seconds per iteration)</h2><div id="occupancy"></div></div>
 <div class="panel"><h2>Microbatch outcomes per iteration</h2><div id="outcomes"></div></div>
 <div class="panel"><h2>SENTINEL flags per link</h2><div id="links"></div><div id="linkflags"></div></div>
</div>
<script>
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const EVENT_COLORS = {crash: "#000", join: "#2ca02c"};
function reasonColor(reason, all) { return COLORS[(all.indexOf(reason) + 3) % COLORS.length]; }
function esc(s) { return String(s).replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})[c]); }

// series: [{name, points: [[x, y], ...]}]; marks: [{x, color, label}]
function chart(id, series, opts = {}) {
  const el = document.getElementById(id);
  const pts = series.flatMap(s => s.points);
  if (!pts.length) { el.innerHTML = '<div class="empty">no data for this run</div>'; return; }
  const W = 500, H = 220, L = 58, R = 10, T = 10, B = 28;
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  let y0 = opts.y0 !== undefined ? opts.y0 : Math.min(...ys), y1 = opts.y1 !== undefined ? opts.y1 : Math.max(...ys);
  if (y1 - y0 < 1e-9) { y1 = y0 + 1; }
  const sx = x => L + (x - x0) / (x1 - x0) * (W - L - R), sy = y => H - B - (y - y0) / (y1 - y0) * (H - T - B);
  let svg = `<svg viewBox="0 0 ${W} ${H}" width="100%" data-points="${pts.length}">`;
  svg += `<line x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}" stroke="#999"/><line x1="${L}" y1="${T}" x2="${L}" y2="${H - B}" stroke="#999"/>`;
  for (let i = 0; i <= 4; i++) {
    const y = y0 + (y1 - y0) * i / 4;
    svg += `<text x="${L - 4}" y="${sy(y) + 4}" text-anchor="end">${+y.toPrecision(3)}</text>`;
  }
  const every = Math.max(1, Math.ceil((x1 - x0) / 6));  // steps are integers: ticks on whole steps
  for (let x = Math.ceil(x0 / every) * every; x <= x1; x += every) {
    svg += `<text x="${sx(x)}" y="${H - B + 14}" text-anchor="middle">${x}</text>`;
  }
  svg += `<text x="${(L + W - R) / 2}" y="${H - 2}" text-anchor="middle">${opts.xlabel || "step"}</text>`;
  for (const m of (opts.marks || [])) {
    svg += `<line class="mark" x1="${sx(m.x)}" y1="${T}" x2="${sx(m.x)}" y2="${H - B}" stroke="${m.color}" stroke-dasharray="3,2"><title>${esc(m.label)}</title></line>`;
  }
  series.forEach((s, i) => {
    if (!s.points.length) return;
    const d = s.points.map((p, k) => (k ? "L" : "M") + sx(p[0]).toFixed(1) + "," + sy(p[1]).toFixed(1)).join("");
    const color = s.color || COLORS[i % COLORS.length];
    svg += `<path class="series" data-name="${esc(s.name)}" data-n="${s.points.length}" d="${d}" fill="none" stroke="${color}" stroke-width="1.6"/>`;
    if (s.dots) for (const p of s.points) svg += `<circle cx="${sx(p[0])}" cy="${sy(p[1])}" r="2.5" fill="${color}"/>`;
  });
  svg += "</svg>";
  const legend = series.length > 1 || opts.legend ? '<div class="legend">' + series.map((s, i) =>
    `<span><i class="sw" style="background:${s.color || COLORS[i % COLORS.length]}"></i>${esc(s.name)}</span>`).join("") + "</div>" : "";
  el.innerHTML = svg + legend;
}

function named(obj) { return Object.entries(obj).map(([name, points]) => ({name, points})); }

function render(s) {
  document.getElementById("title").textContent = `— ${s.preset} (${s.kind})`;
  const planned = s.planned_steps ? ` of ${s.planned_steps}` : "";
  document.getElementById("counts").innerHTML =
    `<span>steps <b id="steps">${s.steps_seen}</b>${planned}</span><span>records <b id="records">${s.records}</b></span>` +
    `<span>peers <b id="npeers">${s.peers_seen}</b></span><span>banned <b id="nbanned">${s.banned}</b></span>` +
    `<span>events <b id="nevents">${s.events.length}</b></span><span id="state">${s.finished ? "finished" : "running"}</span>`;
  const x = s.kind === "pipeline" ? "iteration" : "step";
  chart("loss", [{name: "train loss", points: s.loss}, {name: "test loss", points: s.test_loss, dots: true}], {xlabel: x});
  chart("accuracy", [{name: "test accuracy", points: s.test_accuracy, dots: true}], {xlabel: x, y0: 0, y1: 1});
  const reasons = [...new Set(s.events.filter(e => e.kind === "ban").map(e => e.reason))];
  const color = e => e.kind === "ban" ? reasonColor(e.reason, reasons) : EVENT_COLORS[e.kind];
  const marks = s.events.map(e => ({x: e.step, color: color(e), label: `${e.kind} peer ${e.peer} at ${e.step}: ${e.reason}`}));
  chart("peers", [{name: "peers", points: s.peers_per_step}], {marks, xlabel: x, y0: 0});
  const kinds = [["crash", "crashed / left"], ["join", "joined"]].filter(([k]) => s.events.some(e => e.kind === k));
  document.getElementById("events").innerHTML = kinds.map(([k, t]) => `<span><i class="sw" style="background:${EVENT_COLORS[k]}"></i>${t}</span>`).join("") +
    reasons.map(r => `<span><i class="sw" style="background:${reasonColor(r, reasons)}"></i>ban: ${esc(r)}</span>`).join("");
  chart("admission", named(s.admission), {y0: 0});
  chart("occupancy", named(s.occupancy).map(v => ({...v, name: "stage " + v.name})), {xlabel: "iteration", y0: 0, legend: true});
  chart("outcomes", named(s.outcomes), {xlabel: "iteration", y0: 0, legend: true});
  document.getElementById("links").innerHTML = s.links.length ? "<table><tr><th>link</th><th>checked</th><th>flagged</th><th>rate</th></tr>" +
    s.links.map(l => `<tr><td>${l.link}</td><td>${l.checked}</td><td>${l.flagged}</td><td>${(l.flagged / Math.max(1, l.checked)).toFixed(3)}</td></tr>`).join("") + "</table>"
    : '<div class="empty">no data for this run</div>';
  if (Object.keys(s.link_flags).length) chart("linkflags", named(s.link_flags).map(v => ({...v, name: "link " + v.name})), {xlabel: "iteration", y0: 0});
}

async function tick() {
  try {
    const r = await fetch("api/state", {cache: "no-store"});
    if (r.ok) render(await r.json());
  } catch (e) { document.getElementById("counts").textContent = "watch server unreachable: " + e; }
  setTimeout(tick, 500);
}
tick();
</script></body></html>
"""
