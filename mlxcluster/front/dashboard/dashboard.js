// mlxcluster dashboard: live state from /dashboard/events (server-sent snapshots, the same figures
// /metrics exports) and a chat box streaming /v1/chat/completions. No external assets.
"use strict";

const $ = (id) => document.getElementById(id);
const MB = (b) => (b / 1e6).toFixed(1) + " MB";
let model = null;

function text(el, value) { if (el.textContent !== String(value)) el.textContent = value; }

// A join node's snapshot also lists the nodes: draw the cluster's nodes (rank, layers) instead of
// rank 0's ranks, so that nodes without a rank and lost nodes show too.
function graphItems(s) {
  if (!s.nodes) return (s.ranks || []).map((rk) => ({
    cls: rk.alive ? "alive" : "lost", rank: rk.rank, top: `rank ${rk.rank}`,
    bottom: `TP ${rk.rank + 1}/${(s.ranks || []).length}`}));
  const nodes = s.nodes.slice().sort((a, b) => (a.rank == null) - (b.rank == null) || (a.rank || 0) - (b.rank || 0));
  return nodes.map((nd) => ({
    cls: nd.status === "lost" ? "lost" : nd.status === "live" ? "alive" : "pending", rank: nd.rank,
    top: nd.rank == null ? nd.node_id.slice(0, 10) : `rank ${nd.rank}`,
    bottom: nd.rank == null ? nd.status : (nd.layers ? `layers ${nd.layers}` : `TP ${nd.rank + 1}/${s.world_size}`),
    node: nd.node_id}));
}

function drawGraph(s) {
  const svg = $("graph");
  const ranks = graphItems(s);
  const n = Math.max(ranks.length, 1);
  const w = 400, h = 220, cx = w / 2, cy = 110, r = n > 1 ? 80 : 0;
  const pos = ranks.map((_, i) => n === 1 ? [cx, cy] :
    [cx + r * Math.cos(Math.PI * (2 * i / n - 0.5)) * 1.6, cy + r * Math.sin(Math.PI * (2 * i / n - 0.5))]);
  let out = "";
  for (let i = 1; i < ranks.length; i++) {  // every rank N is linked to rank 0 (frames) and to the group (collectives)
    out += `<line class="link" x1="${pos[0][0]}" y1="${pos[0][1]}" x2="${pos[i][0]}" y2="${pos[i][1]}"></line>`;
    const [mx, my] = [(pos[0][0] + pos[i][0]) / 2, (pos[0][1] + pos[i][1]) / 2];
    out += `<text x="${mx}" y="${my - 4}">${s.backend || ""}</text>`;
  }
  ranks.forEach((rk, i) => {
    out += `<g class="node ${rk.cls}" data-rank="${rk.rank == null ? "" : rk.rank}" data-node="${escapeHtml(rk.node || "")}">` +
      `<title>${escapeHtml(rk.node || rk.top)}</title><circle cx="${pos[i][0]}" cy="${pos[i][1]}" r="26"></circle>` +
      `<text x="${pos[i][0]}" y="${pos[i][1] - 2}">${escapeHtml(rk.top)}</text>` +
      `<text x="${pos[i][0]}" y="${pos[i][1] + 13}">${escapeHtml(rk.bottom)}</text></g>`;
  });
  svg.innerHTML = out;
}

function drawRanks(s) {
  const body = $("ranks").tBodies[0];
  const rows = (s.ranks || []).map((rk) =>
    `<tr class="${rk.alive ? "alive" : "lost"}" data-rank="${rk.rank}"><td>${rk.rank}</td>` +
    `<td class="state">${rk.alive ? "live" : "lost"}</td><td class="memory">${MB(rk.active_memory_bytes)}</td>` +
    `<td>${MB(rk.weight_bytes)}</td><td>${rk.address || "local"}</td></tr>`).join("");
  if (body.innerHTML !== rows) body.innerHTML = rows;
}

function drawNodes(s) {
  $("nodes-card").hidden = !s.nodes;
  if (!s.nodes) return;
  text($("waiting"), s.waiting ? `waiting: ${s.waiting}` : "");
  const body = $("nodes").tBodies[0];
  const rows = s.nodes.map((nd) => {
    const cls = nd.status === "lost" ? "lost" : nd.status === "live" ? "alive" : "pending";
    const why = nd.reason ? ` title="${escapeHtml(nd.reason)}"` : "";
    return `<tr class="${cls}" data-node="${escapeHtml(nd.node_id)}"><td>${escapeHtml(nd.node_id)}${nd.self ? " (this node)" : ""}${nd.spare ? " (spare)" : ""}</td>` +
      `<td class="state"${why}>${escapeHtml(nd.status)}</td><td>${escapeHtml(nd.state || "")}</td>` +
      `<td>${nd.rank == null ? "–" : nd.rank}${nd.layers ? " · layers " + escapeHtml(nd.layers) : ""}</td>` +
      `<td>${escapeHtml(nd.address)}</td></tr>`;
  }).join("");
  if (body.innerHTML !== rows) body.innerHTML = rows;
  drawPlan(s.plan);
  const f = s.fetch;
  $("fetch").hidden = !f;
  if (f) {
    const bar = $("fetch-progress");
    bar.max = Math.max(1, f.total_bytes); bar.value = f.done_bytes;
    text($("fetch-text"), `${f.state}: ${MB(f.done_bytes)} of ${MB(f.total_bytes)} from ${f.from}` +
      (f.state === "fetching" ? ` (${MB(f.bytes_per_s)}/s)` : "") + (f.error ? ` – ${f.error}` : ""));
  }
}

// The formation's plan (rank 0's node, issue 31): the planner's predicted decode tok/s and TTFT beside
// the figures measured while it serves ("measuring…" before the first request).
function drawPlan(p) {
  $("plan").hidden = !p;
  if (!p) return;
  const num = (v, digits) => v == null ? null : Number(v).toFixed(digits);
  const pred = p.decode_tok_s == null ? "not predicted" :
    `predicted ${num(p.decode_tok_s, 1)} tok/s` + (p.ttft_s == null ? "" : `, TTFT ${num(p.ttft_s, 2)} s (${p.prompt_tokens} tokens)`);
  const meas = p.measured_decode_tok_s == null ? "measuring…" :
    `measured ${num(p.measured_decode_tok_s, 1)} tok/s` + (p.measured_ttft_s == null ? "" : `, TTFT ${num(p.measured_ttft_s, 2)} s`);
  text($("plan"), `plan ${p.label}${p.mode ? " (" + p.mode + ")" : ""}: ${pred}; ${meas}` + (p.note ? ` – ${p.note}` : ""));
}

// Speculative decoding (rank 0's Info, since it started): the server's default drafter and bound, the
// acceptance rate (accepted / drafted) and tokens per step of a drafting sequence; "–" before any draft.
function drawSpeculative(spec) {
  const sp = spec || {};
  text($("spec-draft"), spec == null ? "–" : sp.draft ? `${sp.draft} · k ≤ ${sp.draft_tokens}` : "off");
  text($("spec-acceptance"), sp.acceptance_rate == null ? "–" : (sp.acceptance_rate * 100).toFixed(0) + " %");
  text($("spec-tokens-per-step"), sp.tokens_per_step == null ? "–" : sp.tokens_per_step.toFixed(2));
}

function drawErrors(s) {
  const ul = $("errors");
  const items = (s.errors || []).slice().reverse().map((e) =>
    `<li><time>${new Date(e.time * 1000).toLocaleTimeString()}</time> ${escapeHtml(e.message)}</li>`).join("");
  const html = items || '<li class="muted">none</li>';
  if (ul.innerHTML !== html) ul.innerHTML = html;
}

function escapeHtml(t) {
  return String(t).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

function render(s) {
  model = s.model;
  const group = s.group || {};
  const lost = (s.ranks || []).filter((r) => !r.alive).length;
  const lostNodes = (s.nodes || []).filter((n) => n.status === "lost").length;
  const state = group.status !== "ok" ? group.status :
    (lost ? `${lost} rank(s) lost` : lostNodes ? `${lostNodes} node(s) lost` : "ok");
  const where = s.nodes ? `node ${escapeHtml(s.node_id)} of cluster ${escapeHtml(s.cluster)} · ` : "";
  $("summary").innerHTML = `${where}${escapeHtml(s.model || "no model yet")} · world size ${s.world_size} · ` +
    `${escapeHtml(s.backend || "")} · ${escapeHtml(s.weight_format || "")} · ` +
    `<span class="${state === "ok" ? "status-ok" : "status-bad"}">${escapeHtml(state)}</span>`;
  drawGraph(s);
  drawRanks(s);
  drawNodes(s);
  text($("tok-s"), s.decode_tokens_per_s.toFixed(1));
  drawSpeculative(s.speculative);
  text($("ttft"), s.ttft_s == null ? "–" : (s.ttft_s * 1000).toFixed(0) + " ms");
  text($("queued"), s.queue.queued);
  text($("running"), s.queue.running);
  text($("tokens"), s.tokens_total);
  text($("restarts"), group.restarts || 0);
  const failover = s.failover || {};  // serve's provider only (lossless failover): replays across re-formations
  text($("reformation"), failover.last_reformation_s == null ? "–" : failover.last_reformation_s.toFixed(1) + " s");
  text($("replays"), failover.replays == null ? "–" : failover.replays +
    (failover.failed_after_replays ? ` (${failover.failed_after_replays} failed)` : ""));
  text($("waited"), failover.waited == null ? "–" : failover.waited);
  drawErrors(s);
  recordHistory(s);
  drawCharts();
}

// -- charts: the last HISTORY_S seconds of snapshots, kept in this page (a bounded ring buffer) and
// drawn as inline SVG paths (no chart library: the page loads nothing from outside).
const HISTORY_S = 300;
const HISTORY_MAX = 600;  // snapshots come once a second; a bound even if they come faster
const history = [];

// One snapshot -> one history entry: {t (s), toks, ttft (s or null), queued, running, mem {rank: bytes}}.
function recordHistory(s) {
  const t = typeof s.time === "number" ? s.time : Date.now() / 1000;
  const mem = {};
  for (const rk of s.ranks || []) if (rk.alive) mem[rk.rank] = rk.active_memory_bytes;
  history.push({t, toks: s.decode_tokens_per_s, ttft: s.ttft_s == null ? null : s.ttft_s,
                queued: (s.queue || {}).queued || 0, running: (s.queue || {}).running || 0, mem});
  while (history.length > HISTORY_MAX || (history.length && history[0].t < t - HISTORY_S)) history.shift();
}

// The SVG path of points [t, v] (v null: a gap) in a 300 x 80 box over the last HISTORY_S seconds,
// y from 0 to ymax; and how many points it holds.
function chartPath(points, now, ymax) {
  const W = 300, H = 80, PAD = 3;
  let d = "", n = 0, pen = false;
  for (const [t, v] of points) {
    if (v == null || !isFinite(v)) { pen = false; continue; }
    const x = Math.max(0, Math.min(W, W - (now - t) / HISTORY_S * W));
    const y = H - PAD - Math.max(0, Math.min(1, v / ymax)) * (H - 2 * PAD);
    d += `${pen ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
    pen = true; n++;
  }
  return {d, n};
}

// Draw one chart: each series {name, points} as one path (class "series cI", ``data-points`` its
// count), scaled to the largest value in view; the caption gives the latest values (``showNow``)
// and that peak.
function drawChart(id, series, fmt, showNow = true) {
  const svg = $(id);
  if (!svg) return;
  const now = history.length ? history[history.length - 1].t : 0;
  let peak = 0;
  for (const sr of series) for (const [, v] of sr.points) if (v != null && isFinite(v)) peak = Math.max(peak, v);
  const ymax = peak > 0 ? peak * 1.1 : 1;
  let out = [20, 40, 60].map((y) => `<line class="grid" x1="0" x2="300" y1="${y}" y2="${y}"></line>`).join("");
  series.forEach((sr, i) => {
    const {d, n} = chartPath(sr.points, now, ymax);
    out += `<path class="series c${i % 8}" data-series="${escapeHtml(sr.name)}" data-points="${n}" d="${d}">` +
      `<title>${escapeHtml(sr.name)}</title></path>`;
  });
  svg.innerHTML = out;
  const latest = series.map((sr) => { const p = sr.points[sr.points.length - 1]; return p ? p[1] : null; });
  text($(id + "-now"), !latest.some((v) => v != null) ? "" :
    (showNow ? `· now ${latest.map((v) => v == null ? "–" : fmt(v)).join(" / ")} ` : "") + `· peak ${fmt(peak)}`);
  const legend = $(id + "-legend");
  if (legend) {
    const html = series.map((sr, i) =>
      `<span class="item"><span class="swatch c${i % 8}"></span>${escapeHtml(sr.name)}</span> `).join("");
    if (legend.innerHTML !== html) legend.innerHTML = html;
  }
}

function drawCharts() {
  const pts = (f) => history.map((h) => [h.t, f(h)]);
  drawChart("chart-tok-s", [{name: "tok/s", points: pts((h) => h.toks)}], (v) => v.toFixed(1));
  drawChart("chart-ttft", [{name: "TTFT", points: pts((h) => h.ttft)}], (v) => (v * 1000).toFixed(0) + " ms");
  drawChart("chart-queue", [{name: "queued", points: pts((h) => h.queued)},
                            {name: "in flight", points: pts((h) => h.running)}], (v) => v.toFixed(0));
  const ranks = [...new Set(history.flatMap((h) => Object.keys(h.mem).map(Number)))].sort((a, b) => a - b);
  drawChart("chart-memory", ranks.map((r) => ({name: `rank ${r}`, points: pts((h) => h.mem[r] == null ? null : h.mem[r])})),
            (v) => MB(v), false);
}

function connect() {
  const events = new EventSource("/dashboard/events");
  events.onmessage = (ev) => render(JSON.parse(ev.data));
  events.onerror = () => {
    text($("summary"), "disconnected from the server; retrying…");
    // With API keys (serve/join --api-key) a session cookie signs the page in (EventSource cannot
    // send a key header); once it is refused (expired, the server restarted) reload: the server
    // then answers the page with its sign-in form.
    fetch("/dashboard/state", {cache: "no-store"})
      .then((r) => { if (r.status === 401) { events.close(); location.reload(); } }).catch(() => {});
  };
}

async function chat(ev) {
  ev.preventDefault();
  const input = $("chat-input"), log = $("chat-log"), button = $("chat-send");
  const message = input.value.trim();
  if (!message) return;
  input.value = "";
  const user = document.createElement("div");
  user.className = "user"; user.textContent = message;
  const answer = document.createElement("div");
  answer.className = "assistant"; answer.id = "last-answer";
  const old = document.getElementById("last-answer");
  if (old) old.removeAttribute("id");
  log.append(user, answer);
  button.disabled = true;
  answer.dataset.state = "streaming";
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: {"content-type": "application/json"},
      body: JSON.stringify({model, stream: true, temperature: 0, max_tokens: Number($("max-tokens").value) || 128,
                            messages: [{role: "user", content: message}]})});
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || resp.statusText);
    }
    const reader = resp.body.getReader(), decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut); buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const chunk = JSON.parse(event.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        for (const c of chunk.choices || []) answer.textContent += (c.delta && c.delta.content) || "";
        log.scrollTop = log.scrollHeight;
      }
    }
    answer.dataset.state = "done";
  } catch (e) {
    answer.dataset.state = "error";
    answer.textContent += ` [error: ${e.message}]`;
  } finally {
    button.disabled = false;
    input.focus();
  }
}

$("chat-form").addEventListener("submit", chat);
connect();
