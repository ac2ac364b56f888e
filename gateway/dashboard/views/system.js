// System: service health, settings in force (credentials only as set / not set), data directory, snapshots.

import { api } from "../api.js";
import { h, emptyState, fmtBytes, fmtDuration, fmtTime } from "../dom.js";

/** Says when the last scheduled snapshot failed, why, and when it is tried again (null when
 * it did not fail). */
export function snapshotFailure(snaps) {
  const failure = snaps.last_failure;
  if (!failure) return null;
  return h("div", { class: "error snapshot-failed", role: "alert" }, `The last scheduled snapshot failed at ${fmtTime(failure.at)}: ${failure.reason}. Next try at ${fmtTime(failure.retry_at)}.`);
}

function value(v) {
  if (v === null || v === undefined || v === "") return "—";
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

export async function render(root, ctx) {
  root.append(h("h1", null, "System"));
  if (!ctx.reach.everyone) {
    root.append(emptyState("The services, settings and storage shown here are the whole server's: a token reaching only some owners does not see them."));
    return;
  }
  const out = h("div", { id: "system-out" });
  root.append(out);
  await ctx.part(out, () => api("/dashboard/api/system"), (sys) => out.append(...panels(sys)));
}

/** The services, data directory, snapshots and settings the system answer says. */
function panels(sys) {
  const health = h("section", { class: "panel", id: "health" }, h("h2", null, "Services"),
    h("table", { class: "services" },
      h("thead", null, h("tr", null, h("th", null, "Service"), h("th", null, "Health"), h("th", null, "Address"))),
      h("tbody", null, sys.services.map((svc) => h("tr", { "data-service": svc.name },
        h("td", null, svc.name),
        h("td", null, h("span", { class: `health ${svc.status}` }, svc.status)),
        h("td", { class: "mono" }, svc.address))))),
    h("p", { class: "muted" }, "Not every mode runs every service (off: this mode does not start it): lite runs neither the extractor nor the consolidator, pro no consolidator."));
  const storage = h("section", { class: "panel", id: "data" }, h("h2", null, "Data directory"),
    h("dl", { class: "facts" },
      h("dt", null, "Path"), h("dd", { class: "mono" }, sys.data_dir),
      h("dt", null, "Size on disk"), h("dd", null, fmtBytes(sys.data_bytes))));
  const snaps = sys.snapshots;
  const snapshots = h("section", { class: "panel", id: "snapshots" }, h("h2", null, "Snapshots"),
    snapshotFailure(snaps),
    h("p", { class: "muted" }, sys.store_backend === "postgresql" ? "Not taken: the store keeps its rows in PostgreSQL; back the database up with pg_dump." : snaps.every_s ? `Every ${fmtDuration(snaps.every_s)}, keeping ${snaps.keep}, in ${snaps.dir}` : `Off (HYATLAS_SNAPSHOT_EVERY); folder ${snaps.dir}`),
    snaps.files.length
      ? h("table", null, h("tbody", null, snaps.files.map((f) => h("tr", null, h("td", { class: "mono" }, f.name), h("td", { class: "num" }, fmtBytes(f.bytes)), h("td", null, fmtTime(f.modified))))))
      : emptyState("No snapshots yet."));
  const settings = h("section", { class: "panel", id: "settings" }, h("h2", null, "Settings in force ", h("small", null, "keys and tokens show only whether they are set")),
    h("table", { class: "settings" }, h("tbody", null, Object.entries(sys.settings).map(([key, v]) => h("tr", { "data-setting": key },
      h("th", { scope: "row", class: "mono" }, key), h("td", { class: "mono" }, value(v)))))));
  return [health, h("div", { class: "two" }, storage, snapshots), settings];
}
