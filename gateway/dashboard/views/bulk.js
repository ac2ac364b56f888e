// The Memories list's selection: a box on each row, and Forget / Restore / Delete for the rows
// ticked on the page, or for every row the list's filters match, one API call a row (the same
// calls the detail view makes).

import { api } from "../api.js";
import { h, confirmed, fmtCount } from "../dom.js";

// Rows read a call when gathering every matching one: the most /api/v1/list gives.
const LIST_MOST = 1000;

/** The row's box; its data says the memory and whether it is live (only those can be forgotten). */
export function pickCell(item) {
  return h("td", { class: "pick" }, h("input", {
    type: "checkbox", class: "pick-row", "aria-label": "Select this memory",
    "data-memory-id": item.memory_id, "data-live": item.invalid_at ? "0" : "1",
  }));
}

/** The header's box: ticks or clears every row of the page (named in words where the other
 * headers are not shown, at phone width). */
export function pickAllCell(table) {
  return h("th", { class: "pick" }, h("label", null, h("span", { class: "pick-label" }, "Select this page "), h("input", {
    type: "checkbox", id: "pick-all", "aria-label": "Select every memory on this page",
    onchange: (e) => {
      for (const box of table.querySelectorAll("input.pick-row")) box.checked = e.target.checked;
      table.dispatchEvent(new Event("picked"));
    },
  })));
}

/** The ids of every row the list's query matches (its filters, any page) that `keep` takes,
 * read through the API's cursor, so rows written meanwhile neither repeat nor push others out. */
async function matchingIds(query, keep) {
  const ids = [];
  let before = "";
  for (;;) {
    const body = await api("/api/v1/list", { method: "POST", body: { ...query, limit: LIST_MOST, before } });
    ids.push(...body.memories.filter(keep).map((item) => item.memory_id));
    if (body.memories.length < LIST_MOST || !body.next_before) return ids;
    before = body.next_before;
  }
}

/** Calls `call(id)` for each id in turn, telling `step` how far it is, until `stop()` says to
 * stop: how many went through, their replies, how many were left, and a sentence saying how
 * many failed and why ("" when none did). */
async function each(ids, call, step = () => {}, stop = () => false) {
  const failed = [];
  const replies = [];
  let at = 0;
  for (; at < ids.length && !stop(); at += 1) {
    step(at, ids.length);
    try {
      replies.push(await call(ids[at]));
    } catch (error) {
      failed.push(error.message || String(error));
    }
  }
  const done = at - failed.length;
  return { done, replies, left: ids.length - at, failed: failed.length ? ` ${failed.length} failed: ${[...new Set(failed)].join("; ")}.` : "" };
}

/** What runs a bulk action's calls: it says in `count` how far it is, stops between two calls
 * once `halt` is pressed or the list is left (`gone()`), and hands `finish` what it did, as
 * `said(done, replies, ids)` puts it (and `after(replies)`, a button). */
function runner(count, halt, gone, finish) {
  let stopping = false;
  halt.addEventListener("click", () => { stopping = true; halt.disabled = true; });
  return async (ids, call, said, after) => {
    halt.hidden = false;
    // The answer just pressed is locked with the other actions: the focus goes to Stop.
    halt.focus();
    const step = (at, n) => { count.textContent = `Working on ${fmtCount(at + 1)} of ${plural(n)}…`; };
    const { done, replies, left, failed } = await each(ids, call, step, () => stopping || gone());
    const rest = left ? ` Stopped before the other ${plural(left)}${gone() ? " when the list was left" : ""}.` : "";
    await finish(`${said(done, replies, ids)}${failed}${rest}`, after(replies));
  };
}

/** Every row the forgets' replies say they retired (a forget also takes the value's other
 * copies), each once. */
function retiredBy(replies) {
  return [...new Set(replies.flatMap((reply) => (reply.memories || []).map((m) => m.memory_id)))];
}

/** What forgets did, in rows: those selected, and the other rows holding their values that
 * went with them (counting the calls would leave those out). */
function forgot(_done, replies, ids) {
  const rows = retiredBy(replies);
  const selected = new Set(ids);
  const more = rows.filter((id) => !selected.has(id)).length;
  if (!more) return `Forgot ${plural(rows.length)}.`;
  return `Forgot ${plural(rows.length)}: ${fmtCount(rows.length - more)} selected, and ${fmtCount(more)} more holding the same value.`;
}

/** What restores or deletes did: one row a call. */
const counted = (verb) => (done) => `${verb} ${plural(done)}.`;

export function plural(n) {
  return `${fmtCount(n)} ${n === 1 ? "memory" : "memories"}`;
}

/** The API call each action makes for one row (the detail view makes the same). */
export function rowCalls(owner, origin) {
  const who = (id) => ({ id, user_id: owner.user_id, agent_id: owner.agent_id, origin });
  return {
    forget: (id) => api("/api/v1/forget", { method: "POST", body: { ...who(id), reason: "forgotten from the dashboard" } }),
    restore: (id) => api("/api/v1/restore", { method: "POST", body: who(id) }),
    erase: (id) => api("/api/v1/delete_all", { method: "POST", body: who(id) }),
  };
}

/** After forgets: a button that restores every row their replies say they retired (none when
 * they retired none); `finish(text)` says what it did. */
export function undoButton(replies, restore, finish) {
  const ids = retiredBy(replies);
  if (!ids.length) return null;
  return h("button", { type: "button", id: "undo-forget", onclick: async (e) => {
    e.target.disabled = true;
    e.target.textContent = "Restoring…";
    const { done, failed } = await each(ids, restore);
    await finish(`Restored ${plural(done)}.${failed}`);
  } }, "Undo");
}

/** The bar over the list: how many rows are ticked and what can be done with them. With every
 * row of the page ticked and more matching (`matching.total` rows match `matching.query`, the
 * list's request less its page), it offers to act on all of them. `finish(text, undo, true)`
 * says what a run did, with the button given, and what an Undo did (`true`: the rows it brought
 * back may be on the view shown); `gone()` says the list was left (another view, owner
 * or page), which stops a run as Stop does. */
export function bulkBar(table, owner, origin, finish, matching, gone) {
  const one = rowCalls(owner, origin);
  const boxes = () => [...table.querySelectorAll("input.pick-row")];
  const ticked = (live) => boxes().filter((box) => box.checked)
    .filter((box) => live === undefined || box.dataset.live === (live ? "1" : "0"))
    .map((box) => box.dataset.memoryId);
  // Whether the actions take every matching row rather than the ticked ones.
  let everyMatching = false;
  const targets = (live) => everyMatching
    ? matchingIds(matching.query, (item) => live === undefined || !item.invalid_at === live)
    : ticked(live);
  const count = h("span", { id: "picked-count", class: "muted" });
  const halt = h("button", { type: "button", id: "stop-picked", hidden: true }, "Stop");
  const calls = runner(count, halt, gone, finish);
  const run = async (live, call, said, after = () => null) => {
    // One run at a time: every action, and any question asked, stays locked till the list is
    // rendered again with what it did.
    actions.disabled = true;
    count.textContent = everyMatching ? "Reading the matching memories…" : "Working…";
    let ids;
    try {
      ids = await targets(live);
    } catch (error) {
      await finish(`Nothing done: the matching memories could not be read (${error.message || error}).`);
      return true;
    }
    await calls(ids, call, said, after);
    return true;
  };
  const [forget, forgetAsk] = confirmed("forget-picked", "Forget…", "warn", "Forget the live ones ticked? Restore brings them back.", "Yes, forget",
    () => run(true, one.forget, forgot, (replies) => undoButton(replies, one.restore, (text) => finish(text, null, true))));
  const restore = h("button", { type: "button", id: "restore-picked",
    onclick: () => run(false, one.restore, counted("Restored")) }, "Restore");
  const [erase, eraseAsk] = confirmed("delete-picked", "Delete…", "danger", "Erase every memory ticked for good? Their histories stay.", "Yes, delete",
    () => run(undefined, one.erase, counted("Deleted")));
  const widen = h("button", { type: "button", id: "pick-matching",
    onclick: () => { everyMatching = !everyMatching; update(); } });
  const actions = h("fieldset", { id: "bulk-actions" }, widen, forget, forgetAsk, restore, erase, eraseAsk);
  const bar = h("div", { class: "toolbar bulk", id: "bulk-bar" }, count, halt, actions);
  const update = () => {
    // A box ticked during a run changes neither the run nor its progress.
    if (actions.disabled) return;
    const live = ticked(true).length;
    const all = ticked().length;
    const page = all > 0 && all === boxes().length;
    const whole = page && matching.total > all;
    everyMatching = everyMatching && whole;
    // The header's box says whether the whole page is ticked, however it came to be.
    const head = table.querySelector("#pick-all");
    if (head) head.checked = page;
    count.textContent = everyMatching ? `All ${plural(matching.total)} matching selected`
      : all ? `${all} selected` : "Tick memories to act on several at once";
    widen.hidden = !whole;
    widen.textContent = everyMatching ? "Select only this page" : `Select all ${plural(matching.total)} matching`;
    // The list holds retired rows only when it shows superseded ones.
    forget.disabled = !live && !everyMatching;
    restore.disabled = everyMatching ? !matching.query.include_superseded : all === live;
    erase.disabled = !all;
  };
  // A box changed by hand: back to the ticked rows.
  table.addEventListener("change", () => { everyMatching = false; update(); });
  table.addEventListener("picked", update);
  update();
  return bar;
}
