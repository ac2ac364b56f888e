// Owners: every user and agent with memories, their row counts and last write; pick one to look at.

import { api, download } from "../api.js";
import { h, emptyState, errorBox, fmtCount, fmtTime } from "../dom.js";

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

function ownerRow(ctx, userId, entry, agentId) {
  const current = ctx.owner.user_id === userId && ctx.owner.agent_id === agentId;
  return h("tr", { class: agentId === "" ? "owner-user" : "owner-agent", "data-user": userId, "data-agent": agentId },
    h("td", null, agentId === "" ? h("strong", null, userId) : ""),
    h("td", null, agentId === "" ? h("span", { class: "muted" }, "all agents") : (entry.agent_id || h("span", { class: "muted" }, "(no agent)"))),
    h("td", { class: "num live" }, fmtCount(entry.live)),
    h("td", { class: "num retired" }, fmtCount(entry.retired)),
    h("td", { class: "when" }, fmtTime(entry.last_write_at)),
    h("td", null, current
      ? h("span", { class: "muted" }, "shown")
      : h("button", { type: "button", class: "pick", onclick: () => ctx.setOwner({ user_id: userId, agent_id: agentId }, "#/memories") }, "Open")),
    h("td", null, h("button", { type: "button", class: "export", onclick: (e) => exportOwner(e.currentTarget, userId, agentId) }, "Export")));
}

export async function render(root, ctx) {
  root.append(h("h1", null, "Owners"));
  const { users } = await api("/api/v1/owners");
  if (ctx.stale()) return;
  if (!users.length) {
    root.append(emptyState("No memories yet, for anyone.",
      "Memories arrive through POST /api/v1/add (the Hermes plugin sends every turn), or with New memory under Memories."));
    return;
  }
  root.append(
    h("p", { class: "muted" }, "Every user with memories and each agent that wrote for them, most recent writer first. Open one to see its memories; Export saves its memories (retired ones too, with their history) and relations as a JSONL file that POST /api/v1/import takes back."),
    h("div", { id: "owners-message", role: "status" }),
    h("table", { class: "owners", id: "owners-table" },
      h("thead", null, h("tr", null, h("th", null, "User"), h("th", null, "Agent"), h("th", null, "Live"), h("th", null, "Retired"), h("th", null, "Last write"), h("th", null, ""), h("th", null, ""))),
      h("tbody", null, users.map((user) => [
        // "" agent = every agent of the user; an agent literally named "" is shown as (no agent).
        ownerRow(ctx, user.user_id, user, ""),
        user.agents.filter((a) => a.agent_id !== "").map((a) => ownerRow(ctx, user.user_id, a, a.agent_id)),
      ]))));
}
