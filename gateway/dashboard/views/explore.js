// Explore: search with a reader, layer and date filters; results grouped by channel.

import { api } from "../api.js";
import { h, errorBox, emptyState, fmtTime, LAYERS } from "../dom.js";

const CHANNEL_NOTES = {
  pages: "the Now page: what is going on lately",
  profile: "who the user is (L1 profile, L6 schemas)",
  proactive: "intentions and plans (L7)",
  experiences: "how earlier tasks went",
  normal: "everything else (raw turns, facts, summaries, knowledge)",
};
const READERS = [["hybrid", "hybrid (vector + keyword)"], ["semantic", "semantic (vector)"], ["keyword", "keyword"]];

function dayStart(value) {
  return value ? Date.parse(`${value}T00:00:00Z`) / 1000 : null;
}

function inRange(item, from, to) {
  const at = item.event_at || item.gmt_created;
  if (from !== null && at < from) return false;
  if (to !== null && at >= to + 86400) return false;
  return true;
}

function resultItem(item) {
  const when = item.event_at ? `happened ${fmtTime(item.event_at)}` : `learned ${fmtTime(item.gmt_created)}`;
  return h("li", { class: "hit", "data-memory-id": item.memory_id },
    h("a", { href: `#/memories/${encodeURIComponent(item.memory_id)}`, class: "hit-content" }, item.content),
    h("div", { class: "hit-meta" },
      h("span", { class: "score", title: "cosine similarity" }, `score ${Number(item.score).toFixed(3)}`),
      h("span", { class: `layer-tag ${item.layer}` }, item.layer),
      h("span", null, when),
      item.label ? h("span", null, item.label) : null));
}

function results(body, filters) {
  const memories = body.memories || {};
  const order = body.order && body.order.length ? body.order : Object.keys(memories);
  const box = h("div", { class: "results" });
  let shown = 0;
  if (body.now) {
    box.append(h("section", { class: "channel", "data-channel": "now" }, h("h3", null, "Now"), h("ul", { class: "hits" }, resultItem(body.now))));
  }
  for (const name of order) {
    const items = (memories[name] || []).filter((item) => inRange(item, filters.from, filters.to));
    if (!items.length) continue;
    shown += items.length;
    box.append(h("section", { class: "channel", "data-channel": name },
      h("h3", null, name, " ", h("small", null, `${items.length} · ${CHANNEL_NOTES[name] || ""}`)),
      h("ul", { class: "hits" }, items.map(resultItem))));
  }
  if (!shown && !body.now) {
    box.append(emptyState("Nothing matched for this owner.",
      "Try the keyword reader for exact words, lower the minimum score, or widen the layer and date filters."));
  }
  return box;
}

export async function render(root, ctx) {
  const { owner, params } = ctx;
  const form = h("form", { class: "search", id: "search-form", role: "search" },
    h("input", { type: "search", name: "query", id: "query", placeholder: "What do you want to find?", required: true, value: params.get("q") || "" }),
    h("label", null, "Reader ", h("select", { name: "reader", id: "reader" },
      READERS.map(([value, label]) => h("option", { value, selected: (params.get("reader") || "hybrid") === value }, label)))),
    h("label", null, "Layer ", h("select", { name: "layer", id: "layer" },
      h("option", { value: "" }, "all layers"),
      LAYERS.map((name) => h("option", { value: name, selected: params.get("layer") === name }, name)))),
    h("label", null, "From ", h("input", { type: "date", name: "from", id: "from", value: params.get("from") || "" })),
    h("label", null, "To ", h("input", { type: "date", name: "to", id: "to", value: params.get("to") || "" })),
    h("label", null, "Limit ", h("input", { type: "number", name: "limit", id: "limit", min: 1, max: 100, value: params.get("limit") || "10" })),
    h("button", { type: "submit" }, "Search"));
  const out = h("div", { id: "explore-results" });
  root.append(h("h1", null, "Explore"), form, out);

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const data = new FormData(form);
    const next = new URLSearchParams();
    next.set("q", String(data.get("query")).trim());
    for (const key of ["reader", "layer", "from", "to", "limit"]) if (data.get(key)) next.set(key, String(data.get(key)));
    const hash = `#/explore?${next}`;
    if (window.location.hash === hash) ctx.refresh();
    else ctx.go(hash);
  });

  const query = (params.get("q") || "").trim();
  if (!query) {
    out.append(emptyState(`Search the memories of ${owner.user_id}${owner.agent_id ? ` / ${owner.agent_id}` : ""}.`,
      "Results come back in channels: profile, proactive, normal (and pages and experiences once extraction writes them)."));
    return;
  }
  const filters = { from: dayStart(params.get("from")), to: dayStart(params.get("to")) };
  const limit = Math.min(100, Math.max(1, Number(params.get("limit")) || 10));
  // Dates filter here, on the page: ask for more so the filter has something to choose from.
  const dated = filters.from !== null || filters.to !== null;
  try {
    const body = await api("/api/v1/search", {
      method: "POST",
      body: {
        query,
        user_id: owner.user_id,
        agent_id: owner.agent_id,
        reader: params.get("reader") || "hybrid",
        layer: params.get("layer") || "",
        limit: dated ? Math.min(100, limit * 5) : limit,
      },
    });
    if (ctx.stale()) return;
    out.append(results(body, filters));
  } catch (error) {
    if (!ctx.stale()) out.append(errorBox(error));
  }
}
