// A small line chart on <canvas> for the dashboard: a fixed time window ending now, one line per series,
// gaps where a value is null, a few horizontal grid lines labelled with the unit. No library.

import { el } from "./common.js";

const GRID_LINES = 4;
const PAD = { left: 54, right: 8, top: 8, bottom: 18 };

/** A "nice" upper bound for the y axis (its quarters are round too): 1, 2, 4 or 8 times a power of ten. */
function niceMax(max) {
  if (!(max > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(max));
  for (const step of [1, 2, 4, 8, 10]) if (step * power >= max) return step * power;
  return 10 * power;
}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

export class LineChart {
  /**
   * @param {HTMLElement} figure the panel to draw in (its content is replaced)
   * @param {object} options {title, unit, windowS, format(v) -> label, series: [{key, label, color}]}
   */
  constructor(figure, options) {
    this.options = options;
    this.canvas = el("canvas", { role: "img", "aria-label": options.title });
    this.legend = el("div", { class: "legend" });
    figure.replaceChildren(
      el("div", { class: "chart-head" }, el("h2", { text: options.title }), this.legend),
      this.canvas);
    this.data = null;
    new ResizeObserver(() => this.draw()).observe(this.canvas);
  }

  /** `t`: seconds relative to now (<= 0); `data`: series key -> values parallel to `t` (null = no value). */
  update(t, data) {
    this.data = { t, data };
    const { series, format } = this.options;
    this.legend.replaceChildren(...series.map((s) => {
      const values = data[s.key] ?? [];
      const last = [...values].reverse().find((v) => v !== null && v !== undefined);
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = s.color;
      return el("span", { class: "item" }, swatch, `${s.label} `, el("b", { text: last === undefined ? "–" : format(last) }));
    }));
    this.draw();
  }

  draw() {
    const { canvas } = this;
    const width = canvas.clientWidth;
    const height = canvas.clientHeight;
    if (!width || !height) return;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);

    const { series, format } = this.options;
    const t = this.data?.t ?? [];
    // the window: the history there is, in whole minutes, between one minute and `windowS`
    const seen = t.length ? -t[0] : 0;
    const windowS = Math.min(this.options.windowS, 60 * Math.max(1, Math.ceil(seen / 60)));
    const data = this.data?.data ?? {};
    const values = series.flatMap((s) => (data[s.key] ?? []).filter((v) => v !== null && v !== undefined));
    const yMax = niceMax(Math.max(0, ...values));
    const plotW = width - PAD.left - PAD.right;
    const plotH = height - PAD.top - PAD.bottom;
    const x = (seconds) => PAD.left + plotW * (1 + seconds / windowS);
    const y = (v) => PAD.top + plotH * (1 - v / yMax);

    ctx.font = "11px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    ctx.lineWidth = 1;
    for (let i = 0; i <= GRID_LINES; i += 1) {
      const v = (yMax * i) / GRID_LINES;
      ctx.strokeStyle = cssVar("--border");
      ctx.beginPath();
      ctx.moveTo(PAD.left, Math.round(y(v)) + 0.5);
      ctx.lineTo(width - PAD.right, Math.round(y(v)) + 0.5);
      ctx.stroke();
      ctx.fillStyle = cssVar("--muted");
      ctx.textAlign = "right";
      ctx.fillText(v === 0 ? "0" : format(v), PAD.left - 6, y(v));
    }
    ctx.textAlign = "left";
    ctx.textBaseline = "alphabetic";
    ctx.fillText(`-${Math.round(windowS / 60)} min`, PAD.left, height - 4);
    ctx.textAlign = "right";
    ctx.fillText("now", width - PAD.right, height - 4);

    ctx.lineWidth = 1.75;
    ctx.lineJoin = "round";
    for (const s of series) {
      const points = data[s.key] ?? [];
      ctx.strokeStyle = s.color;
      ctx.beginPath();
      let drawing = false;
      points.forEach((v, i) => {
        if (v === null || v === undefined || t[i] < -windowS) {
          drawing = false;
          return;
        }
        if (drawing) ctx.lineTo(x(t[i]), y(v));
        else ctx.moveTo(x(t[i]), y(v));
        drawing = true;
      });
      ctx.stroke();
      // a lone point (one sample between gaps) would not show as a line: mark the last value
      const last = points.length - 1;
      if (last >= 0 && points[last] !== null && points[last] !== undefined) {
        ctx.fillStyle = s.color;
        ctx.beginPath();
        ctx.arc(x(t[last]), y(points[last]), 2.5, 0, 2 * Math.PI);
        ctx.fill();
      }
    }
  }
}
