// Explore: search with a reader, layer and date filters; results grouped by channel.

import { api } from "../api.js";
import { h, errorBox, emptyState, fmtTime, fmtWriterTime, LAYERS } from "../dom.js";

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

const WHY_READERS = [["hybrid", "hybrid: the full ranking"], ["semantic", "semantic (vector) only"], ["keyword", "keyword only"], ["rrf", "plain rank fusion (the reference's)"]];
let stageNames = null;

/** What a search answer shows, in order: the Now page, then the channels' hits within the dates
 * (`view.from`, `view.to`), at most `view.limit` of them; and how many hits the dates hid. */
function shownHits(body, view) {
  const memories = body.memories || {};
  const order = body.order && body.order.length ? body.order : Object.keys(memories);
  const found = order.flatMap((name) => (memories[name] || []).map((item) => ({ channel: name, item })));
  const dated = found.filter(({ item }) => inRange(item, view.from, view.to));
  return { now: body.now || null, hits: dated.slice(0, view.limit), found: found.length, hidden: found.length - dated.length };
}

/** Where a memory lands (1-based, the Now page first, then the channels in their order) among
 * what a search shows, or null. */
async function placeOf(search, view, memoryId, extra) {
  const { now, hits } = shownHits(await api("/api/v1/search", { method: "POST", body: { ...search, ...extra } }), view);
  const items = [...(now ? [now] : []), ...hits.map(({ item }) => item)];
  const at = items.findIndex((item) => item.memory_id === memoryId);
  return at < 0 ? null : { rank: at + 1, score: items[at].score };
}

// What a hit's score is: a hit the vector reader did not see (found by keywords or the graph)
// has no cosine to the query.
const SCORE_NOTE = "the cosine similarity to the query; for a hit the vector reader did not see, the share of the query's words it holds";

function scoreText(score) {
  return `score ${Number(score).toFixed(3)}`;
}

function placeText(place, limit) {
  return place ? `#${place.rank} · ${scoreText(place.score)}` : `not in the top ${limit}`;
}

function moveText(full, without, limit) {
  if (!full && !without) return "";
  if (!full) return `keeps it out of the top ${limit}`;
  if (!without) return `brings it into the top ${limit}`;
  if (without.rank === full.rank) return "no change";
  const by = Math.abs(without.rank - full.rank);
  return without.rank > full.rank ? `moves it up ${by}` : `moves it down ${by}`;
}

/** Why a hit ranks where it does (`full`, its place on screen): its place by reader, what each
 * stage does to it, stage toggles; each asked of the search on screen, shown as it shows. */
async function explain(box, { search, view }, memoryId, full) {
  stageNames = stageNames || (await api("/dashboard/api/search-stages")).stages;
  const where = (extra) => placeOf(search, view, memoryId, extra);
  const text = (place) => placeText(place, view.limit);
  const byReader = await Promise.all(WHY_READERS.map(([reader]) => where({ reader })));
  const byStage = await Promise.all(stageNames.map((stage) => where({ skip_stages: [stage] })));
  const toggles = stageNames.map((stage) => h("label", { class: "check" }, h("input", { type: "checkbox", name: "skip", value: stage }), ` ${stage}`));
  const toggled = h("span", { class: "why-toggled", id: `why-toggled-${memoryId}` });
  const form = h("form", { class: "why-toggles" }, h("span", null, "Switch off: "), toggles,
    h("button", { type: "submit" }, "Rank again"), toggled);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const skip = [...form.querySelectorAll("input[name=skip]:checked")].map((input) => input.value);
    toggled.textContent = "…";
    toggled.textContent = text(await where({ skip_stages: skip }));
  });
  box.replaceChildren(
    h("p", null, `In this search: ${text(full)}. The score is ${SCORE_NOTE}; the order is the fused ranking after every stage below.`),
    h("table", { class: "why-readers" },
      h("thead", null, h("tr", null, h("th", null, "Reader"), h("th", null, "Place"))),
      h("tbody", null, WHY_READERS.map(([reader, label], i) => h("tr", { "data-reader": reader },
        h("td", null, label), h("td", null, text(byReader[i])))))),
    h("table", { class: "why-stages" },
      h("thead", null, h("tr", null, h("th", null, "Stage"), h("th", null, "Place with it off"), h("th", null, "So the stage…"))),
      h("tbody", null, stageNames.map((stage, i) => {
        const move = moveText(full, byStage[i], view.limit);
        return h("tr", { "data-stage": stage, class: move && move !== "no change" ? "moved" : null },
          h("td", { class: "mono" }, stage), h("td", null, text(byStage[i])), h("td", null, move));
      }))),
    form);
}

function whyPanel(item, rank, asked) {
  const box = h("div", { class: "why-body" }, "Asking the search service…");
  const details = h("details", { class: "why", "data-memory-id": item.memory_id }, h("summary", null, "Why this result?"), box);
  let opened = false;
  details.addEventListener("toggle", () => {
    if (!details.open || opened) return;
    opened = true;
    explain(box, asked, item.memory_id, { rank, score: item.score }).then(
      () => details.setAttribute("data-ready", "true"),
      (error) => box.replaceChildren(errorBox(error, "Could not explain")));
  });
  return details;
}

/** One hit, at its place (1-based) in what the search `asked` ({search, view}) shows. */
function resultItem(item, rank, asked) {
  const when = item.event_at !== undefined ? `happened ${fmtWriterTime(item.event_at, item.utc_offset_minutes)}` : `learned ${fmtTime(item.gmt_created)}`;
  return h("li", { class: "hit", "data-memory-id": item.memory_id, "data-rank": rank },
    h("a", { href: `#/memories/${encodeURIComponent(item.memory_id)}`, class: "hit-content" }, item.content),
    h("div", { class: "hit-meta" },
      h("span", { class: "score", title: `${SCORE_NOTE} (the order is the fused ranking)` }, scoreText(item.score)),
      h("span", { class: `layer-tag ${item.layer}` }, item.layer),
      h("span", null, when),
      item.label ? h("span", null, item.label) : null),
    whyPanel(item, rank, asked));
}

function results(body, asked) {
  const { now, hits, found, hidden } = shownHits(body, asked.view);
  const box = h("div", { class: "results" });
  let rank = 0;
  if (now) {
    box.append(h("section", { class: "channel", "data-channel": "now" }, h("h3", null, "Now"), h("ul", { class: "hits" }, resultItem(now, ++rank, asked))));
  }
  for (const name of new Set(hits.map(({ channel }) => channel))) {
    const items = hits.filter(({ channel }) => channel === name).map(({ item }) => item);
    box.append(h("section", { class: "channel", "data-channel": name },
      h("h3", null, name, " ", h("small", null, `${items.length} · ${CHANNEL_NOTES[name] || ""}`)),
      h("ul", { class: "hits" }, items.map((item) => resultItem(item, ++rank, asked)))));
  }
  if (hidden) {
    // The dates filter the best hits the search sent: say how many of them they hid.
    box.prepend(h("p", { class: "muted", id: "date-hidden" },
      `${hidden} of the ${found} best hits fall outside these dates and are not shown.`));
  }
  if (!hits.length && !now) {
    box.append(emptyState("Nothing matched for this owner.",
      "Try the keyword reader for exact words, or widen the layer and date filters. The semantic reader leaves out hits under the model's similarity floor (min_score on the System page)."));
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
    h("label", null, "From (UTC) ", h("input", { type: "date", name: "from", id: "from", value: params.get("from") || "" })),
    h("label", null, "To (UTC) ", h("input", { type: "date", name: "to", id: "to", value: params.get("to") || "" })),
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
    ctx.go(`#/explore?${next}`);
  });

  const query = (params.get("q") || "").trim();
  if (!query) {
    out.append(emptyState(`Search the memories of ${owner.user_id}${owner.agent_id ? ` / ${owner.agent_id}` : ""}.`,
      "Results come back in channels: profile, proactive, normal (and pages and experiences once extraction writes them)."));
    return;
  }
  const limit = Math.min(100, Math.max(1, Number(params.get("limit")) || 10));
  // What the page shows of the answer: the dates filter here, then at most `limit` hits.
  const view = { from: dayStart(params.get("from")), to: dayStart(params.get("to")), limit };
  // Ask for more when dated, so the filter has something to choose from.
  const dated = view.from !== null || view.to !== null;
  const search = {
    query,
    user_id: owner.user_id,
    agent_id: owner.agent_id,
    reader: params.get("reader") || "hybrid",
    layer: params.get("layer") || "",
    limit: dated ? Math.min(100, limit * 5) : limit,
  };
  await ctx.part(out, () => api("/api/v1/search", { method: "POST", body: search }), (body) => out.append(results(body, { search, view })));
}
