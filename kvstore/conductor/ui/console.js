// The conductor's console: polls /api/console every second and redraws. No framework, no build step.
"use strict";

const POLL_MS = 1000;
const WINDOW_S = 300; // the charts show the last five minutes

const $ = (sel) => document.querySelector(sel);

function bytes(n) {
  if (n === undefined || n === null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(Math.round(n))) + " " + units[i];
}

function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + " %"; }

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) tr.appendChild(c instanceof Node ? (c.tagName === "TD" ? c : wrap(c)) : el("td", String(c)));
  return tr;
}

function wrap(node) { const td = el("td"); td.appendChild(node); return td; }

function fill(tbodySel, rows, empty, columns) {
  const body = $(tbodySel);
  body.replaceChildren();
  if (!rows.length) { const td = el("td", empty, "muted"); td.colSpan = columns; body.appendChild(el("tr")).appendChild(td); }
  for (const r of rows) body.appendChild(r);
}

function tierBars(tiers) {
  const box = el("div", undefined, "tiers");
  for (const t of tiers || []) {
    const line = el("div", undefined, "tier");
    line.dataset.tier = t.tier;
    const bar = el("span", undefined, "bar");
    const used = el("span", undefined, "used");
    used.style.width = (t.capacity ? Math.min(100, 100 * t.used / t.capacity) : 0) + "%";
    bar.appendChild(used);
    line.append(el("b", t.tier), bar, el("span", `${bytes(t.used)} / ${bytes(t.capacity)} · ${t.entries} chunks · ${t.hits} hits`));
    box.appendChild(line);
  }
  return box;
}

function load(m) {
  if (m.kind === "store") {
    return `${m.chunks ?? 0} chunks indexed · ${m.misses ?? 0} misses · in ${bytes(m.bytes_in)} · out ${bytes(m.bytes_out)} · ${m.pinned ?? 0} pinned`;
  }
  const q = m.predicted_queue_s === null ? "∞" : m.predicted_queue_s.toFixed(2) + " s";
  if (m.vllm) return `vLLM instance (followed through its KV events) · ${m.chunks} chunks in its GPU prefix cache · queue ${q}`;
  return `${m.running} running · ${m.waiting} waiting · ${m.queued_tokens} queued tokens · KV ${pct(m.kv_usage)} · queue ${q}`;
}

// Per-interval rates from consecutive cumulative samples (a counter that went down, as when a
// store node restarts, counts as zero for that interval).
function rates(series) {
  const out = [];
  for (let i = 1; i < series.length; i++) {
    const a = series[i - 1], b = series[i], dt = b.t - a.t;
    if (dt <= 0) continue;
    const d = (k) => Math.max(0, b[k] - a[k]);
    const chunks = d("scheduled_chunks"), gets = d("hits") + d("misses");
    out.push({
      t: b.t,
      reuse: chunks ? d("cached_chunks") / chunks : null,
      storeHits: gets ? d("hits") / gets : null,
      bytesIn: d("bytes_in") / dt,
      bytesOut: d("bytes_out") / dt,
    });
  }
  return out;
}

function chart(canvas, points, now, keys, fmt, fixedMax) {
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, left = 64, bottom = 20, top = 8;
  ctx.clearRect(0, 0, w, h);
  let max = fixedMax || 0;
  if (!fixedMax) for (const p of points) for (const k of keys) if (p[k] !== null) max = Math.max(max, p[k]);
  if (!max) max = 1;
  ctx.strokeStyle = "#d0d4dc"; ctx.fillStyle = "#5b6170"; ctx.font = "11px sans-serif"; ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = top + (h - top - bottom) * (1 - i / 4);
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText(fmt(max * i / 4), 4, y + 4);
  }
  for (const s of [WINDOW_S, 240, 180, 120, 60, 0]) {
    const x = left + (w - left) * (1 - s / WINDOW_S);
    ctx.fillText(s ? `-${s / 60} min` : "now", Math.min(x, w - 24), h - 5);
  }
  const colors = ["#2f6fde", "#e0772a"];
  keys.forEach((k, j) => {
    ctx.strokeStyle = colors[j]; ctx.lineWidth = 2; ctx.beginPath();
    let pen = false;
    for (const p of points) {
      const age = now - p.t;
      if (age > WINDOW_S || p[k] === null) { pen = false; continue; }
      const x = left + (w - left) * (1 - age / WINDOW_S), y = top + (h - top - bottom) * (1 - p[k] / max);
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    }
    ctx.stroke();
  });
}

function render(s) {
  window.crescentConsole = { snapshot: s, rates: rates(s.series) }; // for scripts and tests driving the page
  const c = s.conductor;
  $("#conductor").textContent = `${c.address} · ${c.leader ? "leader" : "follower"} · policy ${c.policy} · ${c.chunk_tokens} tokens per chunk`;
  const kinds = {};
  for (const m of s.members) kinds[m.kind] = (kinds[m.kind] || 0) + 1;
  $("#stat-members").textContent = String(s.members.length);
  $("#stat-members").title = Object.entries(kinds).map(([k, n]) => `${n} ${k}`).join(", ");
  $("#stat-chunks").textContent = `${c.num_chunks} / ${c.num_copies}`;
  $("#stat-scheduled").textContent = String(s.counters.scheduled);
  $("#stat-rejected").textContent = String(s.counters.rejected);
  const sc = s.counters.scheduled_chunks;
  $("#stat-hit-rate").textContent = sc ? pct(s.counters.cached_chunks / sc) : "–";
  $("#stat-hit-rate").dataset.cached = s.counters.cached_chunks;
  $("#stat-hit-rate").dataset.scheduled = sc;
  let hits = 0, misses = 0, moved = 0;
  for (const m of s.members) if (m.kind === "store") {
    for (const t of m.tiers || []) hits += t.hits;
    misses += m.misses || 0; moved += (m.bytes_in || 0) + (m.bytes_out || 0);
  }
  $("#stat-store-hit-rate").textContent = hits + misses ? pct(hits / (hits + misses)) : "–";
  $("#stat-bytes").textContent = bytes(moved);

  fill("#members tbody", s.members.map((m) => {
    const tr = row([m.id, m.kind, m.address, m.host || "–", m.state, m.last_seen_s.toFixed(1) + " s",
                    m.kind === "store" ? tierBars(m.tiers) : "–", load(m)]);
    tr.dataset.id = m.id;
    tr.dataset.kind = m.kind;
    if (m.state !== "alive") tr.className = "draining";
    return tr;
  }), "no members registered", 8);

  fill("#hot tbody", s.hot_prefixes.map((p) => row([el("code", p.key), p.tokens, p.uses.toFixed(2),
    Object.entries(p.holders).map(([n, t]) => `${n} (${t})`).join(", ") || "nobody (evicted)"])),
    "no prompt scheduled yet", 4);
  $("#num-pins").textContent = s.num_pins ? `(${s.num_pins} keys)` : "";
  fill("#pins tbody", s.pins.map((p) => row([el("code", p.key), p.expires_in_s.toFixed(0) + " s", p.nodes])),
    "nothing pinned through the conductor", 3);
  fill("#decisions tbody", s.decisions.slice(0, 50).map((d) => {
    const tr = row([new Date(d.t * 1000).toLocaleTimeString(), d.tokens, `${d.cached_chunks} / ${d.chunks}`,
                    d.prefill || "–", d.decode || "–", d.source || "–",
                    d.ttft_s === null ? "∞" : (1000 * d.ttft_s).toFixed(0) + " ms", d.policy,
                    d.rejected ? "rejected: " + d.rejected : (d.replicate_to ? "replicate to " + d.replicate_to : "accepted")]);
    if (d.rejected) tr.className = "rejected";
    return tr;
  }), "no decisions in the last 10 minutes", 9);

  const r = window.crescentConsole.rates;
  chart($("#chart-hits"), r, s.now, ["reuse", "storeHits"], pct, 1);
  chart($("#chart-bytes"), r, s.now, ["bytesIn", "bytesOut"], (v) => bytes(v) + "/s");
  const u = $("#updated");
  u.textContent = "updated " + new Date(s.now * 1000).toLocaleTimeString();
  u.dataset.ok = String(Number(u.dataset.ok) + 1);
  u.className = "muted";
}

async function poll() {
  try {
    const resp = await fetch("/api/console", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    render(await resp.json());
  } catch (err) {
    const u = $("#updated");
    u.textContent = `conductor unreachable (${err.message}); retrying`;
    u.className = "error";
  }
  setTimeout(poll, POLL_MS);
}

poll();
