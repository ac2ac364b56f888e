// Overview: status, layer composition, writes over time, storage.

import { api, reachesEveryOwner } from "../api.js";
import { h, fmtBytes, fmtCount, fmtTime, LAYERS } from "../dom.js";
import { writesChart } from "../chart.js";
import { snapshotFailure } from "./system.js";

function card(key, label, value, detail) {
  return h("div", { class: "card", "data-stat": key },
    h("div", { class: "card-label" }, label),
    h("div", { class: "card-value" }, value === "" || value === undefined || value === null ? "—" : String(value)),
    detail ? h("div", { class: "card-detail" }, detail) : null);
}

function lastConsolidation(status) {
  if (status.last_consolidated_at) return [fmtTime(status.last_consolidated_at), `${fmtCount(status.consolidations)} passes`];
  if (status.consolidations === -1) return ["none", `${status.mode} mode has no slow path; ultra consolidates`];
  return ["never yet", "the ultra consolidation pass has not run"];
}

/** Whose rows the status counts: the whole server's for a token reaching every owner, else
 * the owners the token reaches. */
function counted(status) {
  return reachesEveryOwner(status) ? "all owners" : "owners this token reaches";
}

function statusCards(status) {
  const [consolidated, consolidatedDetail] = lastConsolidation(status);
  return h("div", { class: "cards" },
    card("mode", "Mode", status.mode, status.mode_detail),
    card("llm", "LLM", status.llm, [status.llm_model, status.llm_base].filter(Boolean).join(" @ ")),
    card("embed", "Embedder model", status.embed, status.embed_dims ? `${status.embed_dims} dimensions` : ""),
    card("unextracted", "Unextracted", fmtCount(status.unextracted), status.extract_sync),
    card("consolidation", "Last consolidation", consolidated, consolidatedDetail),
    card("total", "Live memories", fmtCount(status.vdb_points), counted(status)),
    card("pipeline", "Write pipeline", status.write_pipeline,
      // The whole server's counts: not given to a token reaching only some owners.
      reachesEveryOwner(status) ? `${fmtCount(status.writes)} writes, ${fmtCount(status.searches)} searches since start` : ""),
  );
}

function layerBars(layers) {
  const max = Math.max(1, ...LAYERS.map((name) => layers[name] || 0));
  return h("table", { class: "layers" },
    h("tbody", null, LAYERS.map((name) => {
      const count = layers[name] || 0;
      return h("tr", { "data-layer": name },
        h("th", { scope: "row" }, h("a", { href: `#/memories?layer=${name}`, "data-layer-link": name }, name)),
        h("td", { class: "bar-cell" }, h("span", { class: "bar", style: { width: `${(count / max) * 100}%` } })),
        h("td", { class: "num count" }, fmtCount(count)));
    })));
}

function storageFacts(sys) {
  return h("dl", { class: "facts" },
    h("dt", null, "Data directory"), h("dd", { class: "mono" }, sys.data_dir),
    h("dt", null, "Size on disk"), h("dd", { "data-stat": "data_bytes" }, fmtBytes(sys.data_bytes)),
    h("dt", null, "Snapshots"), h("dd", null, `${sys.snapshots.files.length} in ${sys.snapshots.dir}`, snapshotFailure(sys.snapshots)));
}

/** The status cards and the layer bars, from one status answer. */
function drawStatus(statusBox, layersBox, status) {
  statusBox.append(statusCards(status));
  layersBox.firstChild.append(" ", h("small", null, `live rows, ${counted(status)}`));
  layersBox.append(layerBars(status.layers || {}));
  const total = Object.values(status.layers || {}).reduce((a, b) => a + b, 0);
  if (total === 0) layersBox.append(h("p", { class: "muted" }, "No memories yet: every POST /api/v1/add stores a raw (L2) row; pro and ultra derive the other layers from it."));
}

export async function render(root, ctx) {
  const { owner } = ctx;
  root.append(h("h1", null, "Overview"));
  const statusBox = h("section", { class: "panel", id: "status" }, h("h2", null, "Status"));
  const layersBox = h("section", { class: "panel", id: "layers" }, h("h2", null, "Layers"));
  const ownerName = owner.agent_id ? `${owner.user_id} / ${owner.agent_id}` : owner.user_id;
  const writesBox = h("section", { class: "panel", id: "writes" }, h("h2", null, "Writes over time ", h("small", null, `owner ${ownerName}, last 28 days (UTC)`)));
  const storageBox = h("section", { class: "panel", id: "storage" }, h("h2", null, "Storage"));
  root.append(statusBox, h("div", { class: "two" }, layersBox, storageBox), writesBox);
  if (!ctx.reach.everyone) storageBox.append(h("p", { class: "muted" }, "The whole server's storage: shown to a token reaching every owner."));
  // Each panel shows what came; one the server could not give yet waits and loads by itself.
  await Promise.all([
    ctx.part([statusBox, layersBox], () => api("/api/v1/status"), (status) => drawStatus(statusBox, layersBox, status)),
    ctx.part(writesBox, () => api("/dashboard/api/writes", { query: { ...owner, days: 28 } }), (writes) => writesBox.append(writesChart(writes.days))),
    ctx.reach.everyone ? ctx.part(storageBox, () => api("/dashboard/api/system"), (sys) => storageBox.append(storageFacts(sys))) : null,
  ]);
}
