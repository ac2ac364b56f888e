// Graph: the L5 knowledge graph as of a date, laid out by a small force simulation into SVG.

import { api } from "../api.js";
import { h, s, errorBox, emptyState, fmtCount } from "../dom.js";

const WIDTH = 900;
const HEIGHT = 560;
// The most relations one graph draws (the layout is quadratic in its nodes).
const EDGE_LIMIT = 500;

/** Node positions from a few hundred rounds of spring and repulsion forces (deterministic). */
function layout(nodes, edges) {
  const n = nodes.length;
  const pos = nodes.map((_, i) => {
    const angle = (2 * Math.PI * i) / Math.max(1, n);
    const r = 0.35 * Math.min(WIDTH, HEIGHT);
    return { x: WIDTH / 2 + r * Math.cos(angle), y: HEIGHT / 2 + r * Math.sin(angle) };
  });
  const index = new Map(nodes.map((node, i) => [node.id, i]));
  const links = edges.map((e) => [index.get(e.from), index.get(e.to)]).filter(([a, b]) => a !== undefined && b !== undefined && a !== b);
  const ideal = Math.sqrt((WIDTH * HEIGHT) / Math.max(1, n)) * 0.6;
  const rounds = n > 200 ? 80 : 250;
  for (let round = 0; round < rounds; round++) {
    const cool = 1 - round / rounds;
    const move = pos.map(() => ({ x: 0, y: 0 }));
    for (let i = 0; i < n; i++) {
      for (let j = i + 1; j < n; j++) {
        const dx = pos[i].x - pos[j].x || 0.01;
        const dy = pos[i].y - pos[j].y || 0.01;
        const d2 = Math.max(1, dx * dx + dy * dy);
        const f = (ideal * ideal) / d2;
        move[i].x += dx * f * 0.05; move[i].y += dy * f * 0.05;
        move[j].x -= dx * f * 0.05; move[j].y -= dy * f * 0.05;
      }
    }
    for (const [a, b] of links) {
      const dx = pos[b].x - pos[a].x;
      const dy = pos[b].y - pos[a].y;
      const d = Math.max(1, Math.hypot(dx, dy));
      const f = (d - ideal) / d * 0.1;
      move[a].x += dx * f; move[a].y += dy * f;
      move[b].x -= dx * f; move[b].y -= dy * f;
    }
    for (let i = 0; i < n; i++) {
      const step = Math.hypot(move[i].x, move[i].y);
      const cap = 20 * cool + 1;
      const k = step > cap ? cap / step : 1;
      pos[i].x = Math.min(WIDTH - 30, Math.max(30, pos[i].x + move[i].x * k));
      pos[i].y = Math.min(HEIGHT - 20, Math.max(20, pos[i].y + move[i].y * k));
    }
  }
  return { pos, index };
}

function drawGraph(nodes, edges) {
  const { pos, index } = layout(nodes, edges);
  const svg = s("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, class: "graph", id: "graph-svg", role: "img", "aria-label": "Knowledge graph" });
  for (const edge of edges) {
    const a = pos[index.get(edge.from)];
    const b = pos[index.get(edge.to)];
    if (!a || !b) continue;
    svg.append(s("g", { class: "edge" },
      s("title", null, `${edge.from} —${edge.relation}→ ${edge.to}`),
      s("line", { x1: a.x, y1: a.y, x2: b.x, y2: b.y }),
      s("text", { x: (a.x + b.x) / 2, y: (a.y + b.y) / 2 - 3, class: "edge-label", "text-anchor": "middle" }, edge.relation)));
  }
  nodes.forEach((node, i) => {
    svg.append(s("g", { class: `node ${node.type || ""}`, "data-node-id": node.id },
      s("title", null, `${node.label} (${node.type || "node"})`),
      s("circle", { cx: pos[i].x, cy: pos[i].y, r: 6 }),
      s("text", { x: pos[i].x + 9, y: pos[i].y + 4 }, node.label || node.id)));
  });
  return svg;
}

export async function render(root, ctx) {
  const { owner, params } = ctx;
  const asOf = params.get("as_of") || new Date().toISOString().slice(0, 10);
  const form = h("form", { class: "toolbar", id: "graph-form" },
    h("label", null, "As of (UTC day) ", h("input", { type: "date", id: "as-of", name: "as_of", value: asOf })),
    h("button", { type: "submit" }, "Show"));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const value = form.elements.as_of.value;
    ctx.go(value ? `#/graph?as_of=${encodeURIComponent(value)}` : "#/graph");
  });
  const out = h("div", { id: "graph-out" });
  root.append(h("h1", null, "Graph ", h("small", null, "L5 knowledge")), form, out);
  // The end of the chosen UTC day: what the graph knew by then. An as_of that is no day (a
  // hand-edited address) goes as it is: the API reads it or its 400 says what ts takes.
  const dayEnd = Date.parse(`${asOf}T23:59:59Z`);
  const ts = Number.isNaN(dayEnd) ? asOf : Math.floor(dayEnd / 1000);
  const fillNote = "The knowledge graph (L5) is empty until consolidation builds it: in ultra mode the periodic consolidation pass turns facts into entities and relations.";
  const query = { ts, n: EDGE_LIMIT, user_id: owner.user_id, agent_id: owner.agent_id };
  const draw = (body) => {
    const nodes = body.nodes || [];
    const edges = body.relations || body.edges || [];
    if (!nodes.length) {
      out.append(emptyState(`No graph for ${owner.user_id} as of ${asOf}.`, fillNote));
      return;
    }
    // The server sends the newest EDGE_LIMIT relations: say so when there are more.
    const shown = body.total > edges.length
      ? `the newest ${fmtCount(edges.length)} of ${fmtCount(body.total)} relations (the rest are not drawn)`
      : `${fmtCount(edges.length)} relations`;
    out.append(h("p", { class: "muted" }, `${fmtCount(nodes.length)} nodes, ${shown} as of ${asOf}`), h("div", { class: "graph-box" }, drawGraph(nodes, edges)));
  };
  const fail = (error) => {
    if (error.status === 501) out.append(emptyState(fillNote), errorBox(error, "The server says"));
    else out.append(errorBox(error, error.status === 400 ? `No graph as of ${JSON.stringify(asOf)}` : undefined));
  };
  await ctx.part(out, () => api("/api/v1/graph-as-of", { query }), draw, fail);
}
