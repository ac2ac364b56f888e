(function () {
  "use strict";
  // HyAtlas memory tab for the Hermes dashboard: status, search by channel, recent memories.
  const SDK = window.__HERMES_PLUGIN_SDK__;
  if (!SDK || !window.__HERMES_PLUGINS__) return;

  const React = SDK.React;
  const h = React.createElement;
  const C = SDK.components || {};
  const Card = C.Card || "section";
  const CardContent = C.CardContent || "div";
  const LAYERS = ["", "l1_profile", "l2_raw", "l3_fact", "l4_summary", "l5_knowledge",
    "l6_schema", "l7_intention", "l8_entity"];

  function api(path) {
    // The host's fetchJSON carries the dashboard session (header or cookie).
    return SDK.fetchJSON("/api/plugins/hyatlas" + path);
  }

  const DAY_S = 86400;

  // The day a memory happened (else was recorded) as its writer lived it: on the writer's clock,
  // the row's utc_offset_minutes, but a date kept alone (at its UTC midnight) as that date: the
  // rule of as_local_date and day in shared/dates.py. UTC days from a server sending no offset.
  function day(item) {
    // An event before 1970 is a negative time, and still the day it happened.
    const t = typeof item.event_at === "number" ? item.event_at : item.gmt_created;
    if (typeof t === "number" && Number.isFinite(t)) {
      const offset = typeof item.utc_offset_minutes === "number" && t % DAY_S !== 0
        ? item.utc_offset_minutes : 0;
      return new Date((t + offset * 60) * 1000).toISOString().slice(0, 10);
    }
    if (typeof t === "string" && t.length >= 10) return t.slice(0, 10);
    return item.ts ? String(item.ts).slice(0, 10) : "undated";
  }

  function MemoryRow(props) {
    const m = props.memory;
    return h("li", { className: "hyatlas-row", style: { margin: "0.35rem 0" } },
      h("code", { style: { opacity: 0.7, marginRight: "0.5rem" } }, day(m)),
      h("span", { style: { opacity: 0.7, marginRight: "0.5rem" } }, m.layer || ""),
      typeof m.score === "number" &&
        h("span", { style: { opacity: 0.7, marginRight: "0.5rem" } }, m.score.toFixed(2)),
      h("span", null, m.content));
  }

  function Status() {
    const [status, setStatus] = React.useState(null);
    const [error, setError] = React.useState("");
    React.useEffect(function () {
      api("/status").then(setStatus).catch(function (e) { setError(String(e)); });
    }, []);
    if (error) return h("p", { className: "hyatlas-error" }, "Server unavailable: " + error);
    if (!status) return h("p", null, "Loading status…");
    const owner = status.hermes_owner || {};
    const mine = status.owner_memories || {};
    const layers = mine.layers || {};
    // The tab shows one person's memories; the server's own counts are every owner's.
    return h("div", null,
      h("p", { className: "hyatlas-owner" }, "Memories of user " + (owner.user_id || "?") +
        (owner.agent_id ? ", agent " + owner.agent_id : ", every agent") +
        " (this Hermes writes as agent " + (status.hermes_agent || "?") + "): " +
        (typeof mine.total === "number" ? mine.total : "?") + " live"),
      h("table", null, h("tbody", null, Object.keys(layers).map(function (k) {
        return h("tr", { key: k }, h("td", null, k),
          h("td", { style: { paddingLeft: "1rem", textAlign: "right" } }, String(layers[k])));
      }))),
      h("p", { className: "hyatlas-server", style: { opacity: 0.7 } },
        "Server: version " + (status.version || "?") + " · mode " + (status.mode || "?") +
        " · LLM " + (status.llm || "?") +
        (typeof status.writes === "number"
          ? " · " + status.writes + " writes since the server started" : "")));
  }

  function Search() {
    const [query, setQuery] = React.useState("");
    const [layer, setLayer] = React.useState("");
    const [answer, setAnswer] = React.useState(null);
    const [error, setError] = React.useState("");
    function run(ev) {
      ev.preventDefault();
      if (!query.trim()) return;
      setError("");
      const qs = "?q=" + encodeURIComponent(query) + (layer ? "&layer=" + layer : "");
      api("/search" + qs).then(setAnswer).catch(function (e) { setError(String(e)); });
    }
    const memories = (answer && answer.memories) || {};
    const order = (answer && answer.order) || Object.keys(memories);
    // The owner's Now page, as the agent's recall and `hermes hyatlas search` show it first.
    const now = answer && answer.now && answer.now.content ? answer.now : null;
    return h("div", null,
      h("form", { onSubmit: run, style: { display: "flex", gap: "0.5rem" } },
        h("input", { value: query, placeholder: "Search memories",
          onChange: function (e) { setQuery(e.target.value); }, style: { flex: 1 } }),
        h("select", { value: layer, onChange: function (e) { setLayer(e.target.value); } },
          LAYERS.map(function (l) { return h("option", { key: l, value: l }, l || "all layers"); })),
        h("button", { type: "submit" }, "Search")),
      error && h("p", { className: "hyatlas-error" }, error),
      now && h("div", { className: "hyatlas-now" }, h("h4", null, "now"),
        h("ul", null, h(MemoryRow, { memory: now }))),
      order.filter(function (c) { return Array.isArray(memories[c]) && memories[c].length; })
        .map(function (c) {
          return h("div", { key: c }, h("h4", null, c),
            h("ul", null, memories[c].map(function (m) {
              return h(MemoryRow, { key: m.memory_id, memory: m });
            })));
        }));
  }

  const RECENT_PAGE = 30;

  // Never a silent cut: the line says how many rows exist beyond the ones shown. The total is
  // the live rows now, so rows shown and retired since can make the shown more than it.
  function countLine(shown, total, next) {
    if (total === null) return "Showing " + shown + (next ? "+" : "") + " memories, newest first";
    if (shown <= total) return "Showing " + shown + " of " + total + " memories, newest first";
    return "Showing " + shown + " memories, newest first; " + total +
      " are live now (some shown were retired or deleted since)";
  }

  function Recent() {
    const [rows, setRows] = React.useState([]);
    const [total, setTotal] = React.useState(null);
    // The list's cursor after the last row shown, while older rows are left.
    const [next, setNext] = React.useState("");
    const [loading, setLoading] = React.useState(true);
    const [error, setError] = React.useState("");
    function load(before) {
      setLoading(true);
      // Paged by the list's cursor: rows written or retired meanwhile neither repeat nor skip.
      const after = before ? "&before=" + encodeURIComponent(before) : "";
      api("/recent?limit=" + RECENT_PAGE + after).then(function (b) {
        setRows(function (old) { return (before ? old : []).concat(b.memories || []); });
        setTotal(typeof b.total === "number" ? b.total : null);
        setNext(b.more ? b.next_before : "");
      }).catch(function (e) { setError(String(e)); })
        .finally(function () { setLoading(false); });
    }
    React.useEffect(function () { load(""); }, []);
    if (error) return h("p", { className: "hyatlas-error" }, error);
    return h("div", null,
      h("p", { className: "hyatlas-count" }, loading && !rows.length ? "Loading…"
        : countLine(rows.length, total, next)),
      h("ul", null, rows.map(function (m) {
        return h(MemoryRow, { key: m.memory_id, memory: m });
      })),
      next && h("button", { type: "button", disabled: loading,
        onClick: function () { load(next); } }, "Show " + RECENT_PAGE + " more"));
  }

  function Section(props) {
    return h(Card, { style: { marginBottom: "1rem" } },
      h(CardContent, null, h("h3", null, props.title), props.children));
  }

  function HyAtlasPage() {
    return h("div", { className: "hyatlas-page", style: { padding: "1rem" } },
      h(Section, { title: "Status" }, h(Status)),
      h(Section, { title: "Search" }, h(Search)),
      h(Section, { title: "Recent" }, h(Recent)));
  }

  window.__HERMES_PLUGINS__.register("hyatlas", HyAtlasPage);
})();
