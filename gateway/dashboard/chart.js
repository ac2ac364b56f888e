// Charts drawn as inline SVG from plain data.

import { h, s, fmtCount } from "./dom.js";

/** A stacked bar chart of raw and derived rows per day. */
export function writesChart(days) {
  const width = 640;
  const height = 180;
  const pad = { left: 36, right: 8, top: 10, bottom: 28 };
  const max = Math.max(1, ...days.map((d) => d.raw + d.derived));
  const plotW = width - pad.left - pad.right;
  const plotH = height - pad.top - pad.bottom;
  const step = plotW / Math.max(1, days.length);
  const bar = Math.max(2, step * 0.7);
  const y = (value) => pad.top + plotH - (value / max) * plotH;
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart", role: "img", "aria-label": "Writes per day" });
  for (const tick of new Set([0, Math.round(max / 2), max])) {
    const ty = y(tick);
    svg.append(s("line", { x1: pad.left, x2: width - pad.right, y1: ty, y2: ty, class: "grid" }));
    svg.append(s("text", { x: pad.left - 4, y: ty + 4, class: "axis", "text-anchor": "end" }, fmtCount(tick)));
  }
  days.forEach((day, i) => {
    const x = pad.left + i * step + (step - bar) / 2;
    const group = s("g", { class: "day", "data-date": day.date, "data-total": day.raw + day.derived });
    group.append(s("title", null, `${day.date}: ${day.raw} raw, ${day.derived} derived`));
    if (day.raw) group.append(s("rect", { x, width: bar, y: y(day.raw), height: y(0) - y(day.raw), class: "raw" }));
    if (day.derived) {
      group.append(s("rect", { x, width: bar, y: y(day.raw + day.derived), height: y(day.raw) - y(day.raw + day.derived), class: "derived" }));
    }
    const every = Math.ceil(days.length / 7);
    if (i % every === 0 || i === days.length - 1) {
      group.append(s("text", { x: x + bar / 2, y: height - 8, class: "axis", "text-anchor": "middle" }, day.date.slice(5)));
    }
    svg.append(group);
  });
  const legend = h("p", { class: "legend" },
    h("span", { class: "swatch raw" }), " raw writes (L2) ",
    h("span", { class: "swatch derived" }), " derived rows (other layers)");
  return h("figure", { class: "chart-box" }, svg, legend);
}
