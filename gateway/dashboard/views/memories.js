// Memories: a paged list by layer, and one memory's detail with its sources, lineage, history and actions.

import { api } from "../api.js";
import { h, confirmed, errorBox, emptyState, facts, fmtCount, fmtTime, fmtWriterTime, LAYERS, notices } from "../dom.js";
import { bulkBar, pickAllCell, pickCell, plural, rowCalls, undoButton } from "./bulk.js";

const PAGE_SIZE = 50;
// Recorded as the dashboard's in each memory's history (actor "dashboard").
const ORIGIN = "dashboard";

// What the last action did.
const notice = notices();

/** The notice left for this render: its text, and a button (an undo) when one came with it. */
function takeNotice() {
  const left = notice.take();
  if (!left) return null;
  const [text, button] = Array.isArray(left) ? left : [left, null];
  const shown = h("p", { class: "notice", role: "status", tabindex: -1 }, h("span", { id: "action-notice" }, text), button ? " " : null, button);
  // The render that says what an action did replaced the button that acted: the focus goes to
  // what comes next, the undo, or else what was said (once the view holds it).
  queueMicrotask(() => (button || shown).focus());
  return shown;
}

/** Whose memories a notice said over another view speaks of. */
function memoriesOf(owner) {
  return `Memories of ${owner.user_id}${owner.agent_id ? ` / ${owner.agent_id}` : ""}`;
}

/** Says what an action did (`said`: a text, or a text and a button, an Undo): in this view,
 * rendered again with it; once the user went to another view, over that one, since rendering
 * this one would draw over it. `redraw` (an Undo pressed there) renders that view again
 * first: it may show the rows the Undo brought back. */
function sayDone(ctx, said, redraw = false) {
  const [text, button] = [said].flat();
  if (!ctx.left()) {
    notice.leave(button ? [text, button] : text);
    return ctx.refresh();
  }
  const over = `${memoriesOf(ctx.owner)}: ${text}`;
  return redraw ? ctx.tellRedrawn(over) : ctx.tell(over, button);
}

function clip(text, size = 60) {
  return text.length > size ? `${text.slice(0, size - 1)}…` : text;
}

function stateTag(item) {
  if (!item.invalid_at) return h("span", { class: "state active" }, "active");
  return h("span", { class: "state retired", title: `retired ${fmtTime(item.invalid_at)}` }, item.superseded_how || "retired");
}

/** Where the list stands, kept in the address: `before`, the API's cursor this page starts after
 * (none on the first page), and `back`, the cursors of the pages between the first and this one.
 * A cursor pins a page to its rows: rows written or deleted meanwhile do not shift it. */
function place(params) {
  const before = params.get("before") || "";
  const back = before ? params.getAll("back") : [];
  return { before, back, page: before ? back.length + 2 : 1 };
}

/** The list's address with changed params; a page cursor and its trail, or none (the first page). */
function pageHash(params, changes, cursor = "", back = []) {
  const next = new URLSearchParams(params);
  for (const key of ["page", "before", "back"]) next.delete(key);
  for (const [key, value] of Object.entries(changes)) {
    if (value === "") next.delete(key);
    else next.set(key, value);
  }
  if (cursor) {
    next.set("before", cursor);
    for (const step of back) next.append("back", step);
  }
  const text = next.toString();
  return text ? `#/memories?${text}` : "#/memories";
}

/** Whether rows older than this page's exist: on the first page the total says; past it, rows
 * written or deleted on the pages before shift the count, so the list is asked for one more. */
async function hasOlder(query, body, before) {
  if (body.memories.length < PAGE_SIZE || !body.next_before) return false;
  if (!before) return body.total > PAGE_SIZE;
  const next = await api("/api/v1/list", { method: "POST", body: { ...query, limit: 1, before: body.next_before } });
  return next.memories.length > 0;
}

function listControls(ctx, body, older) {
  const { params } = ctx;
  const { before, back, page } = place(params);
  const pages = Math.max(page, Math.ceil(body.total / PAGE_SIZE));
  const go = (changes) => ctx.go(pageHash(params, changes));
  const filters = h("div", { class: "toolbar" },
    h("label", null, "Layer ", h("select", { id: "list-layer", onchange: (e) => go({ layer: e.target.value }) },
      h("option", { value: "" }, "all layers"),
      LAYERS.map((name) => h("option", { value: name, selected: params.get("layer") === name }, name)))),
    h("label", { class: "check" }, h("input", {
      type: "checkbox", id: "include-superseded", checked: params.get("superseded") === "1",
      onchange: (e) => go({ superseded: e.target.checked ? "1" : "" }),
    }), " include superseded"),
    // A change (Enter, or leaving the field) lists the rows holding the text, any case.
    h("label", null, "Holding ", h("input", {
      type: "search", id: "list-contains", value: params.get("contains") || "", maxlength: 256,
      placeholder: "any text", onchange: (e) => go({ contains: e.target.value.trim() }),
    })));
  const pager = h("nav", { class: "pager", "aria-label": "Pages" },
    h("button", { type: "button", id: "prev-page", disabled: !before,
      onclick: () => ctx.go(pageHash(params, {}, back.at(-1), back.slice(0, -1))) }, "← Newer"),
    h("span", { id: "page-info" }, `page ${fmtCount(page)} of ${fmtCount(pages)} · ${fmtCount(body.total)} rows`),
    h("button", { type: "button", id: "next-page", disabled: !older,
      onclick: () => ctx.go(pageHash(params, {}, body.next_before, before ? [...back, before] : [])) }, "Older →"));
  return { filters, pager, firstHash: pageHash(params, {}) };
}

/** Said in place of the actions to a token that only reads. */
function readOnly() {
  return h("p", { class: "muted", id: "read-only" }, "This token only reads: storing, changing, forgetting and deleting memories need one with the write scope.");
}

/** A row of the list, with its box when the rows can be acted on (`pick`). */
function row(item, pick) {
  return h("tr", { class: "memory-row", "data-memory-id": item.memory_id, "data-layer": item.layer },
    pick ? pickCell(item) : null,
    h("td", { class: "content" }, h("a", { href: `#/memories/${encodeURIComponent(item.memory_id)}` }, item.content)),
    h("td", null, h("span", { class: `layer-tag ${item.layer}` }, item.layer)),
    h("td", { class: "when" }, fmtTime(item.gmt_created)),
    h("td", null, stateTag(item),
      item.drop_reason ? h("div", { class: "muted drop-reason", title: item.drop_reason }, clip(item.drop_reason, 80)) : null));
}

async function renderList(root, ctx) {
  const { owner, params } = ctx;
  const { before } = place(params);
  // What the list shows, any page: the bulk bar may act on all of it.
  const query = {
    user_id: owner.user_id,
    agent_id: owner.agent_id,
    layer: params.get("layer") || "",
    include_superseded: params.get("superseded") === "1",
    contains: params.get("contains") || "",
  };
  const load = async () => {
    const body = await api("/api/v1/list", { method: "POST", body: { ...query, limit: PAGE_SIZE, before } });
    return { body, older: await hasOlder(query, body, before) };
  };
  const out = h("div", { id: "memory-list" });
  root.append(out);
  await ctx.part(out, load, ({ body, older }) => drawList(out, ctx, query, body, older));
}

/** The list's page (`body`, and whether `older` rows exist), with its filters, pager and bulk bar. */
function drawList(root, ctx, query, body, older) {
  const { owner, params } = ctx;
  const { before } = place(params);
  const { filters, pager, firstHash } = listControls(ctx, body, older);
  const writes = ctx.reach.write;
  root.append(...[takeNotice(), filters, writes ? createForm(ctx) : readOnly()].filter(Boolean));
  if (!body.memories.length && before) {
    // The page before held the list's last rows, or deletes emptied this one.
    root.append(emptyState("No older memories: the list ends before this page.",
      h("a", { href: firstHash, id: "first-page" }, "Go to the first page")), pager);
    return;
  }
  if (!body.memories.length && params.get("contains")) {
    root.append(emptyState(`No memories here hold “${params.get("contains")}”.`,
      "The list matches the text as written, in any case; Explore finds memories by meaning."));
    return;
  }
  if (!body.memories.length) {
    root.append(emptyState(`No memories for ${owner.user_id}${owner.agent_id ? ` / ${owner.agent_id}` : ""} here.`,
      "Memories arrive through POST /api/v1/add (the Hermes plugin sends every turn); pro and ultra derive facts, summaries and intentions from them."));
    return;
  }
  const table = h("table", { class: "memories", id: "memory-table" }, h("tbody", null, body.memories.map((item) => row(item, writes))));
  table.prepend(h("thead", null, h("tr", null, writes ? pickAllCell(table) : null, h("th", null, "Content"), h("th", null, "Layer"), h("th", null, "Learned"), h("th", null, "State"))));
  // A run stops when the list is left: what it did is said over the view the user went to.
  const finish = (text, button, redraw) => sayDone(ctx, [text, button], redraw);
  root.append(...[writes ? bulkBar(table, owner, ORIGIN, finish, { total: body.total, query }, ctx.left) : null, table, pager].filter(Boolean));
}

function createForm(ctx) {
  const { owner } = ctx;
  const text = h("textarea", { id: "new-text", rows: 3, required: true, placeholder: "What should be remembered?" });
  const form = h("form", { class: "editor", id: "create-form", hidden: true },
    h("label", null, `New memory for ${owner.user_id}${owner.agent_id ? ` / ${owner.agent_id}` : ""}`, text),
    h("div", { class: "row" },
      h("button", { type: "submit", id: "create-save" }, "Store it"),
      h("button", { type: "button", id: "create-cancel", onclick: () => { form.hidden = true; open.hidden = false; } }, "Cancel")),
    h("div", { id: "create-message" }));
  const open = h("button", { type: "button", id: "create", onclick: () => { form.hidden = false; open.hidden = true; text.focus(); } }, "New memory");
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    form.querySelector("#create-save").disabled = true;
    try {
      const body = await api("/api/v1/add", { method: "POST", body: {
        text: text.value, user_id: owner.user_id, agent_id: owner.agent_id, metadata: { write_origin: ORIGIN },
      } });
      notice.leave("Stored as a new memory.");
      ctx.go(`#/memories/${encodeURIComponent(body.memory_id)}`);
    } catch (error) {
      form.querySelector("#create-save").disabled = false;
      form.querySelector("#create-message").replaceChildren(errorBox(error, "Could not store it"));
    }
  });
  return h("div", { class: "create" }, open, form);
}

function miniList(items, empty) {
  if (!items.length) return h("p", { class: "muted" }, empty);
  return h("ul", { class: "mini" }, items.map((item) => h("li", { "data-memory-id": item.memory_id },
    h("a", { href: `#/memories/${encodeURIComponent(item.memory_id)}` }, item.content),
    h("span", { class: "muted" }, ` ${item.layer} · ${fmtTime(item.created_at)}${item.superseded_how ? ` · ${item.superseded_how}` : ""}`))));
}

function historyTable(entries) {
  if (!entries.length) return h("p", { class: "muted" }, "No audit entries.");
  return h("table", { class: "history", id: "history" },
    h("thead", null, h("tr", null, h("th", null, "When"), h("th", null, "Action"), h("th", null, "By"), h("th", null, "Why"))),
    h("tbody", null, entries.map((e) => h("tr", { "data-action": e.action },
      h("td", { class: "when" }, fmtTime(e.at)), h("td", null, e.action), h("td", null, e.actor), h("td", null, e.reason || "")))));
}

/** The edit form; `close()` takes it away (Cancel). */
function editForm(ctx, memory, say, close) {
  const { owner } = ctx;
  const text = h("textarea", { id: "edit-text", rows: 4, required: true }, memory.content);
  const form = h("form", { class: "editor", id: "edit-form" },
    h("label", null, "New text (stored as a new version; this one is kept as replaced)", text),
    h("div", { class: "row" },
      h("button", { type: "submit", id: "edit-save" }, "Save"),
      h("button", { type: "button", id: "edit-cancel", onclick: close }, "Cancel")));
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    form.querySelector("#edit-save").disabled = true;
    try {
      const body = await api("/api/v1/update", { method: "POST", body: {
        id: memory.memory_id, text: text.value, user_id: owner.user_id, agent_id: owner.agent_id, origin: ORIGIN,
      } });
      if (body.changed === false) {
        notice.leave("Nothing saved: the text is unchanged.");
        await ctx.refresh();
        return;
      }
      notice.leave("Saved as a new version. The old text is kept, retired as replaced, with its history.");
      ctx.go(`#/memories/${encodeURIComponent(body.memory_id)}`);
    } catch (error) {
      form.querySelector("#edit-save").disabled = false;
      say(errorBox(error, "Save failed"));
    }
  });
  return form;
}

/** What a forget did (it takes every live row holding the value), with an Undo that brings
 * back every row it took. */
function forgotten(memory, reply, restore, finish) {
  const copies = reply.forgotten > 1 ? ` (${plural(reply.forgotten)} held its value: all are forgotten)` : "";
  return [`Forgotten: “${clip(memory.content)}”${copies}.`, undoButton([reply], restore, finish)];
}

function actions(ctx, memory, say) {
  const one = rowCalls(ctx.owner, ORIGIN);
  const id = memory.memory_id;
  // Once the view was left while a call was out, what was done is said over the view the user
  // went to.
  const finish = (said) => sayDone(ctx, said);
  // Runs one action; on success the view re-renders with what `done(reply)` says (a text, or a
  // text and a button), on failure it says why.
  const act = async (call, done, failed) => {
    say(null);
    let reply;
    try {
      reply = await call();
    } catch (error) {
      say(errorBox(error, failed));
      return false;
    }
    await finish(done(reply));
    return true;
  };
  const box = h("div", { class: "actions", id: "actions" });
  if (memory.status === "active") {
    const edit = h("button", { type: "button", id: "edit" }, "Edit…");
    // The focus goes with what is shown: to the text, and back to Edit when it is closed.
    edit.addEventListener("click", () => {
      const form = editForm(ctx, memory, say, () => { form.remove(); box.hidden = false; edit.focus(); });
      box.hidden = true;
      box.after(form);
      form.querySelector("#edit-text").focus();
    });
    box.append(edit, ...confirmed("forget", "Forget…", "warn", "Forget this memory, and any other holding its value? Search stops finding them; Undo brings them back.", "Yes, forget",
      () => act(() => one.forget(id), (reply) => forgotten(memory, reply, one.restore, (text) => sayDone(ctx, text, true)), "Forget failed")));
  } else {
    const restore = h("button", { type: "button", id: "restore" }, "Restore");
    restore.addEventListener("click", async () => {
      restore.disabled = true;
      if (!(await act(() => one.restore(id),
        () => "Restored: search finds it again, and extraction may take its value from its turns again.", "Restore failed"))) restore.disabled = false;
    });
    box.append(restore);
  }
  box.append(...confirmed("delete", "Delete…", "danger", "Erase this memory for good? Its history stays.", "Yes, delete", async () => {
    try {
      await one.erase(id);
    } catch (error) {
      say(errorBox(error, "Delete failed"));
      return false;
    }
    const said = `Deleted: “${clip(memory.content)}”. Its history stays in the audit log.`;
    if (ctx.left()) ctx.tell(`${memoriesOf(ctx.owner)}: ${said}`);
    else {
      notice.leave(said);
      ctx.go("#/memories");
    }
    return true;
  }));
  return box;
}

/** Why no row shows as the one that replaced this one. */
function noReplacement(memory) {
  if (memory.status === "active") return "Nothing: it is current.";
  // A replaced row's newer version is missing only once it was deleted.
  if (memory.superseded_how === "replaced") return "Its newer version was deleted.";
  return "Nothing replaced it (it was retired on its own).";
}

async function renderDetail(root, ctx) {
  const { owner, arg } = ctx;
  const query = { id: arg, user_id: owner.user_id, agent_id: owner.agent_id };
  const out = h("div", { id: "memory-out" });
  root.append(h("p", null, h("a", { href: "#/memories", id: "back" }, "← All memories")), out);
  await ctx.part(out, () => api("/dashboard/api/memory", { query }), (detail) => drawDetail(out, ctx, detail, query));
}

/** A memory's detail (`detail`, the dashboard's memory answer), its history read apart. */
async function drawDetail(root, ctx, detail, query) {
  const { memory, sources, missing_sources: missing, replaced, replaced_by: replacedBy } = detail;
  const historyBox = h("section", { class: "panel", id: "history-panel" }, h("h2", null, "History"));
  const message = h("div", { id: "action-message" });
  const say = (node) => message.replaceChildren(...(node ? [node] : []));
  root.append(
    h("article", { class: "detail", id: "memory-detail", "data-memory-id": memory.memory_id, "data-status": memory.status },
      h("div", { class: "detail-head" }, h("span", { class: `layer-tag ${memory.layer}` }, memory.layer), " ", stateTag(memory),
        memory.label ? h("span", { class: "muted" }, ` ${memory.label}`) : null),
      h("blockquote", { class: "memory-content", id: "memory-content" }, memory.content),
      takeNotice(),
      ctx.reach.write ? actions(ctx, memory, say) : readOnly(),
      message,
      h("div", { class: "two" },
        h("section", { class: "panel" }, h("h2", null, "Owner"), facts([
          ["User", memory.user_id], ["Agent", memory.agent_id], ["Session", memory.session_id], ["Id", h("code", null, memory.memory_id)],
        ])),
        h("section", { class: "panel" }, h("h2", null, "Time"), facts([
          ["Learned (created)", fmtTime(memory.created_at)],
          ["Last changed", fmtTime(memory.updated_at)],
          ["True from (event)", fmtWriterTime(memory.event_at, memory.utc_offset_minutes)],
          ["True until", fmtTime(memory.valid_to)],
          memory.due_at ? ["Due", fmtWriterTime(memory.due_at, memory.utc_offset_minutes)] : null,
          memory.invalid_at ? ["Retired", `${fmtTime(memory.invalid_at)} by ${memory.retired_by || "?"} (${memory.superseded_how})${memory.drop_reason ? `: ${memory.drop_reason}` : ""}`] : null,
        ]))),
      h("section", { class: "panel" }, h("h2", null, "Where it came from"),
        memory.layer === "l2_raw" ? h("p", { class: "muted" }, "This is a raw turn: it is its own source.") : miniList(sources, "No source rows recorded."),
        missing.length ? h("p", { class: "muted" }, `${missing.length} source row(s) no longer exist.`) : null),
      h("div", { class: "two" },
        h("section", { class: "panel", id: "replaced-by" }, h("h2", null, "Replaced by"),
          replacedBy ? miniList([replacedBy], "") : h("p", { class: "muted" }, noReplacement(memory))),
        h("section", { class: "panel", id: "replaced" }, h("h2", null, "What it replaced"),
          miniList(replaced, "Nothing."))),
      historyBox,
      Object.keys(memory.metadata || {}).length
        ? h("section", { class: "panel" }, h("h2", null, "Metadata"), h("pre", { class: "mono" }, JSON.stringify(memory.metadata, null, 2)))
        : null));
  await ctx.part(historyBox, () => api("/api/v1/history", { query }), (body) => historyBox.append(historyTable(body.history)));
}

export async function render(root, ctx) {
  const { owner } = ctx;
  root.append(h("h1", null, ctx.arg ? "Memory" : "Memories", " ", h("small", null, owner.agent_id ? `${owner.user_id} / ${owner.agent_id}` : owner.user_id)));
  if (ctx.arg) await renderDetail(root, ctx);
  else await renderList(root, ctx);
}
