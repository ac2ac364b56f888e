// The Memories list's selection: a box on each row, and Forget / Restore / Delete for the rows
// ticked on the page, one API call a row (the same calls the detail view makes).

import { api } from "../api.js";
import { h, confirmed } from "../dom.js";

/** The row's box; its data says the memory and whether it is live (only those can be forgotten). */
export function pickCell(item) {
  return h("td", { class: "pick" }, h("input", {
    type: "checkbox", class: "pick-row", "aria-label": "Select this memory",
    "data-memory-id": item.memory_id, "data-live": item.invalid_at ? "0" : "1",
  }));
}

/** The header's box: ticks or clears every row of the page. */
export function pickAllCell(table) {
  return h("th", { class: "pick" }, h("input", {
    type: "checkbox", id: "pick-all", "aria-label": "Select every memory on this page",
    onchange: (e) => {
      for (const box of table.querySelectorAll("input.pick-row")) box.checked = e.target.checked;
      table.dispatchEvent(new Event("picked"));
    },
  }));
}

/** Calls `call(id)` for each id in turn: how many went through, and a sentence saying how many
 * failed and why ("" when none did). */
async function each(ids, call) {
  const failed = [];
  for (const id of ids) {
    try {
      await call(id);
    } catch (error) {
      failed.push(error.message || String(error));
    }
  }
  const done = ids.length - failed.length;
  return { done, failed: failed.length ? ` ${failed.length} failed: ${[...new Set(failed)].join("; ")}.` : "" };
}

function plural(n) {
  return `${n} ${n === 1 ? "memory" : "memories"}`;
}

/** The bar over the list: how many rows are ticked and what can be done with them. `finish`
 * shows its text as the next render's notice and renders the list again. */
export function bulkBar(table, owner, origin, finish) {
  const who = (id) => ({ id, user_id: owner.user_id, agent_id: owner.agent_id, origin });
  const ticked = (live) => [...table.querySelectorAll("input.pick-row:checked")]
    .filter((box) => live === undefined || box.dataset.live === (live ? "1" : "0"))
    .map((box) => box.dataset.memoryId);
  const count = h("span", { id: "picked-count", class: "muted" });
  const run = async (ids, call, verb) => {
    count.textContent = `Working on ${plural(ids.length)}…`;
    const { done, failed } = await each(ids, call);
    await finish(`${verb} ${plural(done)}.${failed}`);
    return true;
  };
  const [forget, forgetAsk] = confirmed("forget-picked", "Forget…", "warn", "Forget the live ones ticked? Restore brings them back.", "Yes, forget",
    () => run(ticked(true), (id) => api("/api/v1/forget", { method: "POST", body: { ...who(id), reason: "forgotten from the dashboard" } }), "Forgot"));
  const restore = h("button", { type: "button", id: "restore-picked",
    onclick: async () => { restore.disabled = true; await run(ticked(false), (id) => api("/api/v1/restore", { method: "POST", body: who(id) }), "Restored"); } }, "Restore");
  const [erase, eraseAsk] = confirmed("delete-picked", "Delete…", "danger", "Erase every memory ticked for good? Their histories stay.", "Yes, delete",
    () => run(ticked(), (id) => api("/api/v1/delete_all", { method: "POST", body: who(id) }), "Deleted"));
  const bar = h("div", { class: "toolbar bulk", id: "bulk-bar" }, count, forget, forgetAsk, restore, erase, eraseAsk);
  const update = () => {
    const live = ticked(true).length;
    const all = ticked().length;
    count.textContent = all ? `${all} selected` : "Tick memories to act on several at once";
    forget.disabled = !live;
    restore.disabled = all === live;
    erase.disabled = !all;
  };
  table.addEventListener("change", update);
  table.addEventListener("picked", update);
  update();
  return bar;
}
