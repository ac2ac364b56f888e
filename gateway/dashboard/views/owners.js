// Owners: every user and agent with memories, their row counts and last write; pick one to look at.

import { api, download, upload } from "../api.js";
import { h, emptyState, errorBox, fmtCount, fmtTime, notices } from "../dom.js";

const SHOWN_ERRORS = 5;

// What the last import did (the next render lists its owners too).
const notice = notices();

/** What an import's answer says: the counts, the first lines refused with why, and whether an
 * export's file was whole (its end line came). */
function importReport(status, data) {
  const lines = (n) => `${fmtCount(n || 0)} ${n === 1 ? "line" : "lines"}`;
  const counts = `${lines(data.imported)} imported, ${lines(data.skipped)} skipped (their ids are here already), ${lines(data.refused)} refused`;
  const errors = (data.errors || []).slice(0, SHOWN_ERRORS).map((e) => h("li", null, `line ${e.line}: ${e.error}`));
  // A reply without the counts refused the request as a whole.
  const stopped = Boolean(data.stopped) || !("errors" in data);
  const cut = data.complete === false;
  return h("div", { class: stopped || cut || data.refused ? "error" : "notice", id: "import-report", role: "status" },
    h("p", null, `${stopped ? "Import stopped" : cut ? "Import of an incomplete file done" : "Import done"}: ${counts}.`),
    stopped && data.error ? h("p", null, `${data.error} (HTTP ${status})${data.imported ? "; the lines before it were written, so sending the file again skips them" : ""}.`) : null,
    !stopped && cut && data.error ? h("p", { id: "import-incomplete" }, `${data.error}. Get the whole export and import it again: the lines written now are skipped.`) : null,
    errors.length ? h("ul", null, errors) : null);
}

/** A file picker that posts an export (or minimal memory lines) to `POST /api/v1/import`. */
function importForm(ctx) {
  const file = h("input", { type: "file", id: "import-file", accept: ".jsonl,.ndjson,application/x-ndjson,application/json" });
  const send = h("button", { type: "submit", id: "import-send" }, "Import");
  const form = h("form", { class: "toolbar", id: "import-form" }, h("label", null, "Import a file ", file), send);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (!file.files.length) return;
    send.disabled = true;
    form.append(h("span", { class: "muted", id: "import-working" }, "Importing…"));
    try {
      const { status, data } = await upload("/api/v1/import", file.files[0]);
      notice.leave(importReport(status, data));
    } catch (error) {
      notice.leave(errorBox(error, "Could not import"));
    }
    await ctx.refresh();
  });
  return form;
}

/** A file name from the owner's ids, with anything but letters, digits, ".", "_" and "-" as "_". */
function exportName(userId, agentId) {
  const safe = (id) => id.replace(/[^A-Za-z0-9._-]/g, "_");
  return `hyatlas-${safe(userId)}${agentId ? `-${safe(agentId)}` : ""}.jsonl`;
}

/** Downloads the owner's export (`GET /api/v1/export`: rows with history, vectors and keys). */
async function exportOwner(button, userId, agentId) {
  const said = document.getElementById("owners-message");
  const who = agentId ? `${userId} / ${agentId}` : userId;
  const name = exportName(userId, agentId);
  button.disabled = true;
  said.replaceChildren(`Exporting ${who}…`);
  try {
    await download("/api/v1/export", { user_id: userId, agent_id: agentId }, name);
    said.replaceChildren(`Exported ${who} as ${name}.`);
  } catch (error) {
    said.replaceChildren(errorBox(error, `Could not export ${who}`));
  } finally {
    button.disabled = false;
  }
}

function counts(entry) {
  return [
    h("td", { class: "num live" }, fmtCount(entry.live)),
    h("td", { class: "num retired" }, fmtCount(entry.retired)),
    h("td", { class: "when" }, fmtTime(entry.last_write_at)),
  ];
}

/** A user's row (`agentId` "": every agent of theirs) or one agent's, with Open and Export. */
function ownerRow(ctx, userId, entry, agentId) {
  const current = ctx.owner.user_id === userId && ctx.owner.agent_id === agentId;
  return h("tr", { class: agentId === "" ? "owner-user" : "owner-agent", "data-user": userId, "data-agent": agentId },
    h("td", null, agentId === "" ? h("strong", null, userId) : ""),
    h("td", null, agentId === "" ? h("span", { class: "muted" }, "all agents") : entry.agent_id),
    counts(entry),
    h("td", null, current
      ? h("span", { class: "muted" }, "shown")
      : h("button", { type: "button", class: "pick", onclick: () => ctx.setOwner({ user_id: userId, agent_id: agentId }, "#/memories") }, "Open")),
    h("td", null, h("button", { type: "button", class: "export", onclick: (e) => exportOwner(e.currentTarget, userId, agentId) }, "Export")));
}

/** The rows written with no agent: counted, but they open and export with the user's (an
 * agent "" asks for every agent). */
function noAgentRow(userId, entry) {
  return h("tr", { class: "owner-agent no-agent", "data-user": userId },
    h("td", null, ""),
    h("td", null, h("span", { class: "muted" }, "(no agent)")),
    counts(entry),
    h("td", { colspan: 2, class: "muted" }, "with all agents"));
}

export async function render(root, ctx) {
  root.append(h("h1", null, "Owners"), ctx.reach.admin ? importForm(ctx)
    : h("p", { class: "muted", id: "import-needs-admin" }, "Importing a file needs a token with the admin scope."));
  const report = notice.take();
  if (report) root.append(report);
  const out = h("div", { id: "owners-out" });
  root.append(out);
  await ctx.part(out, () => api("/api/v1/owners"), ({ users }) => out.append(...ownersTable(ctx, users)));
}

/** Every user and agent with memories, or what fills the list when there is none. */
function ownersTable(ctx, users) {
  if (!users.length) {
    return [emptyState("No memories yet, for anyone.",
      "Memories arrive through POST /api/v1/add (the Hermes plugin sends every turn), with New memory under Memories, or from a file imported above.")];
  }
  return [
    h("p", { class: "muted" }, "Every user with memories and each agent that wrote for them, most recent writer first. Open one to see its memories; Export saves its memories (retired ones too, with their history) and relations as a JSONL file that POST /api/v1/import takes back."),
    h("div", { id: "owners-message", role: "status" }),
    h("table", { class: "owners", id: "owners-table" },
      h("thead", null, h("tr", null, h("th", null, "User"), h("th", null, "Agent"), h("th", null, "Live"), h("th", null, "Retired"), h("th", null, "Last write"), h("th", null, ""), h("th", null, ""))),
      h("tbody", null, users.map((user) => [
        ownerRow(ctx, user.user_id, user, ""),
        user.agents.map((a) => a.agent_id === "" ? noAgentRow(user.user_id, a) : ownerRow(ctx, user.user_id, a, a.agent_id)),
      ]))),
  ];
}
