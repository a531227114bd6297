// Where one answer's time went, from the `mmserve` object of the last streamed chunk and the usage chunk.
//
// Timeline of a request (mmserve.server.serving.Timings): the engine waits for its media's embeddings
// (encode_s, which in EPD includes transfer_s, the last part's trip from its encoder), then the request waits
// for the scheduler (queue_s), is prefilled to its first token (prefill_s) and decoded (decode_s). "other" is
// the rest of the end-to-end time: the API server's own work (chat template, tokenizer, detokenizer).

import { el, fmtSeconds } from "./common.js";

const SEGMENTS = [
  ["encode", "encode", "fetch, preprocess and run the vision / audio tower (cache hits skip it)"],
  ["transfer", "transfer", "embeddings from the encoder to the engine (EPD)"],
  ["queue", "queue", "waiting for the scheduler"],
  ["prefill", "prefill", "prompt forward up to the first token"],
  ["decode", "decode", "first token to the last"],
  ["other", "other", "API server: template, tokenizer, detokenizer, streaming"],
];

/** Seconds per segment (all >= 0) and the end-to-end total. */
export function segmentsOf(timings) {
  const transfer = timings.transfer_s ?? 0;
  const seconds = {
    encode: Math.max(0, (timings.encode_s ?? 0) - transfer),
    transfer,
    queue: timings.queue_s ?? 0,
    prefill: timings.prefill_s ?? 0,
    decode: timings.decode_s ?? 0,
  };
  const known = Object.values(seconds).reduce((a, b) => a + b, 0);
  seconds.other = Math.max(0, (timings.e2e_s ?? known) - known);
  return { seconds, total: Math.max(timings.e2e_s ?? 0, known) };
}

function bar(seconds, total) {
  const node = el("div", { class: "bar", role: "img", "aria-label": "time breakdown" });
  for (const [key, label] of SEGMENTS) {
    if (!seconds[key] || !total) continue;
    const seg = el("span", { class: `seg ${key}`, title: `${label}: ${fmtSeconds(seconds[key])}` });
    seg.style.width = `${(100 * seconds[key]) / total}%`; // CSSOM, allowed by the page's CSP
    node.append(seg);
  }
  return node;
}

function legend(seconds) {
  return el("div", { class: "legend" },
    SEGMENTS.map(([key, label, help]) =>
      el("span", { class: "item", title: help, "data-segment": key },
        el("span", { class: `swatch ${key}` }), `${label} `, el("b", { text: fmtSeconds(seconds[key]) }))));
}

function fact(label, value) {
  return el("span", {}, `${label} `, el("b", { text: value }));
}

/** The breakdown card of one answer. `extra`: the response's `mmserve` object; `usage`: its usage (or null). */
export function renderBreakdown(extra, usage) {
  const timings = extra.timings ?? {};
  const { seconds, total } = segmentsOf(timings);
  const facts = [fact("TTFT", fmtSeconds(timings.ttft_s)), fact("total", fmtSeconds(total))];
  if (usage) {
    const completion = usage.completion_tokens ?? 0;
    const decode = timings.decode_s ?? 0;
    const rate = completion > 1 && decode > 0 ? ` · ${((completion - 1) / decode).toFixed(1)} tok/s` : "";
    facts.push(fact("output", `${completion} tokens${rate}`));
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    facts.push(fact("prompt", `${usage.prompt_tokens} tokens, ${cached} from the prefix cache`));
  }
  if (extra.mm_items) {
    facts.push(fact("embedding cache", `${extra.mm_cache_hits} of ${extra.mm_items} item(s) hit`));
  }
  const items = (extra.items ?? []).map((item, i) =>
    el("li", { text: `${item.modality} ${i + 1} → ${item.encoded_by}` }));
  return el("div", { class: "breakdown", "data-testid": "breakdown" },
    bar(seconds, total),
    legend(seconds),
    el("div", { class: "facts" }, facts),
    items.length ? el("ul", { class: "items", "data-testid": "item-encoders" }, items) : null);
}
