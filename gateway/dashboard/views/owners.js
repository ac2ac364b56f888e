// Owners: every user and agent with memories, their row counts and last write; pick one to look at.

import { api } from "../api.js";
import { h, emptyState, fmtCount, fmtTime } from "../dom.js";

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
      : h("button", { type: "button", class: "pick", onclick: () => ctx.setOwner({ user_id: userId, agent_id: agentId }, "#/memories") }, "Open")));
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
    h("p", { class: "muted" }, "Every user with memories and each agent that wrote for them, most recent writer first. Open one to see its memories."),
    h("table", { class: "owners", id: "owners-table" },
      h("thead", null, h("tr", null, h("th", null, "User"), h("th", null, "Agent"), h("th", null, "Live"), h("th", null, "Retired"), h("th", null, "Last write"), h("th", null, ""))),
      h("tbody", null, users.map((user) => [
        // "" agent = every agent of the user; an agent literally named "" is shown as (no agent).
        ownerRow(ctx, user.user_id, user, ""),
        user.agents.filter((a) => a.agent_id !== "").map((a) => ownerRow(ctx, user.user_id, a, a.agent_id)),
      ]))));
}
