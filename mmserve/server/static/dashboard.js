// The dashboard (/dashboard): polls /ui/api/stats and shows the engine, the encoders, charts of the last
// minutes (history kept by the server: mmserve.server.ui_stats) and latency percentiles.

import { LineChart } from "./charts.js";
import {
  apiFetch, el, ensureKey, fmtBytes, fmtMs, fmtNumber, fmtPercent, servedModel,
} from "./common.js";

const POLL_MS = 2000;
const WINDOW_S = 300;
const $ = (id) => document.getElementById(id);

const charts = {
  throughput: new LineChart($("chart-throughput"), {
    title: "Throughput", windowS: WINDOW_S, format: (v) => `${fmtNumber(v, 1)}/s`,
    series: [
      { key: "gen_tps", label: "output tokens", color: "#10b981" },
      { key: "prompt_tps", label: "prompt tokens", color: "#6366f1" },
    ],
  }),
  latency: new LineChart($("chart-latency"), {
    title: "Latency", windowS: WINDOW_S, format: fmtMs,
    series: [
      { key: "ttft_p50", label: "TTFT p50", color: "#6366f1" },
      { key: "ttft_p90", label: "TTFT p90", color: "#a5b4fc" },
      { key: "e2e_p50", label: "E2E p50", color: "#f59e0b" },
      { key: "e2e_p90", label: "E2E p90", color: "#fcd34d" },
    ],
  }),
  requests: new LineChart($("chart-requests"), {
    title: "Requests", windowS: WINDOW_S, format: (v) => fmtNumber(v, 1),
    series: [
      { key: "running", label: "running", color: "#4f46e5" },
      { key: "waiting", label: "waiting", color: "#f79009" },
    ],
  }),
  kv: new LineChart($("chart-kv"), {
    title: "KV cache usage", windowS: WINDOW_S, format: (v) => `${fmtNumber(v, 1)}%`,
    series: [{ key: "kv_usage", label: "used by requests", color: "#06b6d4" }],
  }),
};

function card(label, value, sub = "", meter = null) {
  const node = el("div", { class: "card panel" },
    el("div", { class: "label", text: label }),
    el("div", { class: "value", text: value }),
    sub ? el("div", { class: "sub", text: sub }) : null);
  if (meter !== null) {
    const fill = el("span");
    fill.style.width = `${Math.min(100, Math.max(0, 100 * meter))}%`;
    node.append(el("div", { class: "meter" }, fill));
  }
  return node;
}

function lastRate(series, key) {
  const values = series[key] ?? [];
  return values.length ? values[values.length - 1] : null;
}

function renderCards(s) {
  const e = s.engine;
  const encoders = s.encoders.length;
  const healthy = s.encoders.filter((x) => x.healthy).length;
  $("cards").replaceChildren(
    card("Running", fmtNumber(e.running), `${fmtNumber(e.in_flight)} in flight at the API server`),
    card("Waiting", fmtNumber(e.waiting), "queued or waiting for media"),
    card("KV cache", fmtPercent(e.kv_usage, 1),
      `${fmtNumber(e.kv_cache_tokens)} tokens · ${fmtNumber(e.prefix_cache_tokens)} in the prefix cache`,
      e.kv_usage),
    card("Prefix cache hits", fmtPercent(e.prefix_cache_hit_rate, 1), "of prompt tokens, since start"),
    card("Output tokens/s", fmtNumber(lastRate(s.series, "gen_tps"), 1),
      `${fmtNumber(s.totals.generation_tokens)} since start`),
    card("Requests", fmtNumber(s.totals.requests), `finished · ${fmtNumber(s.totals.errors)} error responses`),
    card("Encoders", encoders ? `${healthy} / ${encoders}` : "in-process",
      encoders ? "healthy / registered" : `engine cache hits ${fmtPercent(e.mm_cache_hit_rate, 0)}`),
  );
}

function health(encoder) {
  const state = encoder.healthy ? "ok" : "bad";
  return el("span", { class: "badge" }, el("span", { class: `dot ${state}` }),
    encoder.healthy ? "healthy" : "evicted");
}

function renderEncoders(s) {
  const rows = s.encoders.map((x) => el("tr", { "data-url": x.url },
    el("td", { class: "url", text: x.url }),
    el("td", {}, health(x)),
    el("td", { class: "num", text: fmtNumber(x.strikes) }),
    el("td", { class: "num", text: fmtNumber(x.in_flight) }),
    el("td", { class: "num", text: fmtNumber(x.pending) }),
    el("td", { class: "num", text: fmtNumber(x.batches) }),
    el("td", { class: "num", text: fmtNumber(x.items_per_batch, 2) }),
    el("td", {
      class: "num", title: `${x.cache_hits} of ${x.cache_queries} lookups · ${fmtBytes(x.cache_bytes)} held`,
      text: `${fmtPercent(x.cache_hit_rate, 0)} (${fmtNumber(x.cache_hits)}/${fmtNumber(x.cache_queries)})`,
    }),
    el("td", { class: "num", text: fmtMs(x.forward_ms) }),
    el("td", { class: "num", text: fmtMs(x.queue_wait_ms) })));
  if (!rows.length) {
    rows.push(el("tr", {}, el("td", { colspan: 10, class: "muted",
      text: "No encoder services: the engine encodes media in-process (monolithic mode)." })));
  }
  $("encoders").tBodies[0].replaceChildren(...rows);
  const d = s.dispatch;
  $("dispatch").textContent = d
    ? `routing ${d.routing} · transport ${d.transport} · ${d.failovers} failovers · ${d.local_fallbacks} local fallbacks`
    : "";
}

function renderLatency(s) {
  const names = { ttft: "time to first token", itl: "inter-token gap", e2e: "end to end" };
  const rows = [];
  for (const [window, row] of Object.entries(s.latency ?? {})) {
    const label = `last ${Math.round(parseInt(window, 10) / 60)} min`
      + (row.covered_s + 2 * s.sample_interval_s < parseInt(window, 10) ? ` (${Math.round(row.covered_s)} s seen)` : "");
    for (const [key, name] of Object.entries(names)) {
      const q = row[key];
      rows.push(el("tr", {},
        el("td", { text: label }), el("td", { text: name }),
        el("td", { class: "num", text: fmtNumber(q.count) }),
        el("td", { class: "num", text: fmtMs(q.p50) }),
        el("td", { class: "num", text: fmtMs(q.p90) }),
        el("td", { class: "num", text: fmtMs(q.p99) })));
    }
  }
  $("latency").tBodies[0].replaceChildren(...rows);
}

function setStatus(ok, text) {
  $("status").querySelector(".dot").className = `dot ${ok ? "ok" : "bad"}`;
  $("status-text").textContent = text;
}

async function poll() {
  try {
    const response = await apiFetch("/ui/api/stats");
    if (response.status === 401) {
      setStatus(false, "API key needed");
      await ensureKey("The server refused the key.");
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const s = await response.json();
    renderCards(s);
    renderEncoders(s);
    renderLatency(s);
    for (const chart of Object.values(charts)) chart.update(s.series.t, s.series);
    setStatus(s.engine.alive, s.engine.alive ? `live · ${new Date().toLocaleTimeString()}` : "engine down");
    document.body.dataset.ready = "true";
  } catch (error) {
    setStatus(false, `unreachable (${error.message})`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

async function start() {
  await ensureKey();
  $("model-name").textContent = (await servedModel()) || "no model";
  poll();
}

start();
