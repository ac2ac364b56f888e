// The shell: hash routes to views, the owner selector every view reads, one render at a time.

import { api, askTokenAgain, onTokenGiven, reachesEveryOwner, Unreachable } from "./api.js";
import { h, errorBox } from "./dom.js";
import { Parts } from "./parts.js";
import * as overview from "./views/overview.js";
import * as owners from "./views/owners.js";
import * as explore from "./views/explore.js";
import * as memories from "./views/memories.js";
import * as graph from "./views/graph.js";
import * as system from "./views/system.js";

const VIEWS = { overview, owners, explore, memories, graph, system };
const OWNER_KEY = "hyatlas.owner";

function savedOwner() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(OWNER_KEY) || "{}");
    return saved.user_id ? { user_id: saved.user_id, agent_id: saved.agent_id || "" } : null;
  } catch {
    return null;
  }
}

let owner = savedOwner() || { user_id: "default", agent_id: "" };
let knownOwners = [];
// Whether the owners, and what the token may do, were read (not so when the server could not
// be reached at load).
let ownersRead = false;
let reachRead = false;
// What the tab's token may do, as the status says: change memories (write), import (admin), and
// see the whole server's figures (it reaches every owner). Everything, till the status is read.
let reach = { write: true, admin: true, everyone: true };
let renderSeq = 0;
// The user's moves to another view, owner or address (a view rendering itself again is none).
let moves = 0;
// The parts of a view that could not reach the server, or found it not ready, load again by
// themselves: after the server's Retry-After, or when it gave none after a wait doubling each
// time.
const RETRY_FIRST_S = 2;
const RETRY_MOST_S = 30;
// A server's Retry-After is followed within these bounds: never sooner (a 0 would retry at
// once, again and again), never later (a restart is usually over by then).
const WAIT_LEAST_S = 1;
const WAIT_MOST_S = 30;
let retryS = RETRY_FIRST_S;
let retryTimer = null;
// Tells a watcher (and the browser tests) that a render, or a round of loading waiting parts
// again, finished: this load's id and a counter.
const loadId = Math.random().toString(36).slice(2);
let marks = 0;

function parseHash() {
  const [path, search] = window.location.hash.replace(/^#\/?/, "").split("?", 2);
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const name = VIEWS[parts[0]] ? parts[0] : "overview";
  return { name, arg: parts.slice(1).join("/"), params: new URLSearchParams(search || "") };
}

/** The owner an address names (its `user` and `agent`), or null when it names none. */
function ownerIn(params) {
  const user = params.get("user");
  return user ? { user_id: user, agent_id: params.get("agent") || "" } : null;
}

/** The address with the owner in it, so that going back to it, or pasting it in another tab,
 * opens that owner's view (a memory's id alone is another owner's "not found"). */
function withOwner(hash, who) {
  const [path, search] = hash.replace(/^#\/?/, "").split("?", 2);
  const params = new URLSearchParams(search || "");
  params.set("user", who.user_id);
  if (who.agent_id) params.set("agent", who.agent_id);
  else params.delete("agent");
  return `#/${path}?${params}`;
}

async function render() {
  const { name, arg, params } = parseHash();
  // The owner the address names is the view's; an address naming none (a link a view wrote)
  // is the current owner's, and says so from now on.
  const named = ownerIn(params);
  if (named) adopt(named);
  else window.history.replaceState(null, "", withOwner(window.location.hash, owner));
  // What a view left behind said is for the view shown after it, not those after that.
  told().replaceChildren();
  told().hidden = true;
  const seq = ++renderSeq;
  const at = moves;
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("active", link.dataset.view === name);
    if (link.dataset.view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const root = document.getElementById("view");
  const section = h("section", { class: `view view-${name}`, "data-view": name, "aria-busy": "true" });
  root.replaceChildren(section);
  const stale = () => seq !== renderSeq;
  const parts = new Parts(stale);
  const ctx = {
    owner: { ...owner },
    arg,
    params,
    stale,
    left: () => at !== moves,
    go,
    refresh: render,
    setOwner: (next, hash) => pickOwner(next, hash),
    tell,
    tellRedrawn,
    reach: { ...reach },
    part: (boxes, fetch, draw, fail) => parts.load(boxes, fetch, draw, fail),
  };
  clearTimeout(retryTimer);
  try {
    await VIEWS[name].render(section, ctx);
  } catch (error) {
    if (seq === renderSeq) section.append(errorBox(error, "This view could not load"));
  }
  if (seq !== renderSeq) return;
  section.setAttribute("aria-busy", "false");
  waitForServer(section, parts);
}

/** Tells a watcher that the view shown is drawn as far as the server let it. */
function marked() {
  marks += 1;
  document.documentElement.dataset.rendered = `${loadId}:${marks}`;
}

function told() {
  return document.getElementById("told");
}

/** Says over the view shown what an action of a view left since did (with its button, an
 * undo), till the next render. */
function tell(text, button) {
  told().replaceChildren(h("span", { id: "told-text" }, text), button ? " " : null, button || null);
  told().hidden = false;
}

/** Says over the view shown, after an Undo in the notice, what it did; the view is drawn
 * again first, as it may show the rows the Undo brought back. */
async function tellRedrawn(text) {
  await render();
  tell(text);
}

/** What an outage says of the server: it cannot be reached, or it is not ready yet and why. */
function outageText(error) {
  return error instanceof Unreachable ? error.message
    : `The HyAtlas server at ${window.location.origin} is not ready yet (${error.message})`;
}

/** How long to wait before trying again what met `errors` (outages), and whether the server
 * asked for it: what its Retry-After asks (the longest when several did), within WAIT_LEAST_S
 * and WAIT_MOST_S; `backoffS` when a call got no answer or no Retry-After. */
function waitAfter(errors, backoffS) {
  const asked = errors.map((error) => error.retryAfterS ?? null);
  if (asked.includes(null)) return { waitS: backoffS, asked: false };
  return { waitS: Math.min(WAIT_MOST_S, Math.max(WAIT_LEAST_S, ...asked)), asked: true };
}

/** While parts of the view (`parts`) wait for the server, says so over it and loads them again
 * after a wait (as long as the server's Retry-After asks, else doubling up to RETRY_MOST_S), or
 * at once with "Try again now"; the parts that loaded stay. */
function waitForServer(section, parts) {
  section.querySelector(":scope > #unreachable")?.remove();
  const errors = [...parts.waiting.values()];
  if (!errors.length) {
    retryS = RETRY_FIRST_S;
    marked();
    return;
  }
  const { waitS, asked } = waitAfter(errors, retryS);
  if (!asked) retryS = Math.min(retryS * 2, RETRY_MOST_S);
  const seq = renderSeq;
  const retry = async () => {
    clearTimeout(retryTimer);
    // Owners or a reach read only now may change what the view shows: it was rendered again.
    if (!(ownersRead && reachRead) && (await lookAgain())) return;
    if (seq !== renderSeq) return;
    await parts.again();
    if (seq === renderSeq) waitForServer(section, parts);
  };
  section.prepend(h("div", { class: "error", role: "alert", id: "unreachable" },
    `${outageText(errors[0])}. Trying again in ${waitS} s. `,
    h("button", { type: "button", id: "retry", onclick: retry }, "Try again now")));
  clearTimeout(retryTimer);
  retryTimer = setTimeout(retry, waitS * 1000);
  marked();
}

/** Fills the owner fields' suggestions: every user, and the agents of the chosen one. */
function suggestOwners() {
  const users = document.getElementById("owner-users");
  const agents = document.getElementById("owner-agents");
  users.replaceChildren(...knownOwners.map((u) => h("option", { value: u.user_id }, `${u.live} live`)));
  const chosen = knownOwners.find((u) => u.user_id === document.getElementById("owner-user").value.trim());
  // An empty field already means every agent: rows written with none are not offered apart.
  const named = (chosen ? chosen.agents : []).filter((a) => a.agent_id !== "");
  agents.replaceChildren(...named.map((a) => h("option", { value: a.agent_id }, `${a.live} live`)));
}

/** Makes `next` the owner every view reads, in the header's fields and kept for the tab. */
function adopt(next) {
  owner = { user_id: next.user_id || "default", agent_id: next.agent_id || "" };
  document.getElementById("owner-user").value = owner.user_id;
  document.getElementById("owner-agent").value = owner.agent_id;
  sessionStorage.setItem(OWNER_KEY, JSON.stringify(owner));
  suggestOwners();
}

/** Opens an address as the current owner's; the one shown already renders again. */
function go(hash) {
  const target = withOwner(hash, owner);
  if (target === window.location.hash) render();
  else window.location.hash = target;
}

function pickOwner(next, hash) {
  moves += 1;
  adopt(next);
  // A memory's detail belongs to its owner: go back to the list when the owner changes.
  const { name, arg } = parseHash();
  go(hash || (name === "memories" && arg ? "#/memories" : window.location.hash));
}

function setupOwner() {
  const form = document.getElementById("owner");
  const user = document.getElementById("owner-user");
  const agent = document.getElementById("owner-agent");
  user.value = owner.user_id;
  agent.value = owner.agent_id;
  user.addEventListener("input", suggestOwners);
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    askTokenAgain();
    pickOwner({ user_id: user.value.trim(), agent_id: agent.value.trim() });
  });
}

/** The owner the gateway acts for when a request names none: a token's one user (and agent),
 * else "default"; null when it cannot be asked. */
async function tokenOwner() {
  try {
    const { user_id, agent_id } = await api("/dashboard/api/writes", { query: { days: 1 } });
    return { user_id, agent_id };
  } catch {
    return null;
  }
}

/** The owners the server knows; without a saved choice, the most recently written user, or
 * with none written yet the owner the token acts for. */
async function loadOwners() {
  try {
    knownOwners = (await api("/api/v1/owners")).users;
    ownersRead = true;
  } catch {
    knownOwners = [];  // the views say what is wrong; the picker just offers nothing
  }
  if (!savedOwner()) {
    const first = knownOwners.length ? { user_id: knownOwners[0].user_id, agent_id: "" } : await tokenOwner();
    if (first) {
      owner = first;
      document.getElementById("owner-user").value = owner.user_id;
      document.getElementById("owner-agent").value = owner.agent_id;
    }
  }
  suggestOwners();
}

/** Reads what the token may do; a failure leaves it as it was (the views say what is wrong). */
async function loadReach() {
  try {
    const status = await api("/api/v1/status");
    const { scopes } = status;
    reach = { write: scopes.includes("write"), admin: scopes.includes("admin"), everyone: reachesEveryOwner(status) };
    reachRead = true;
  } catch {
    return;
  }
  // The System view holds only the whole server's figures: not offered to a token for some owners.
  document.querySelector("#nav a[data-view=system]").hidden = !reach.everyone;
}

/** What the page learns of the tab's token: the owners and what it may do. */
async function lookUp() {
  await Promise.all([loadOwners(), loadReach()]);
}

/** Looks the token up again; when the owner or what the token may do changed, renders the view
 * again as that (true then). */
async function lookAgain() {
  const [was, could] = [owner, JSON.stringify(reach)];
  await lookUp();
  if (owner.user_id === was.user_id && owner.agent_id === was.agent_id && JSON.stringify(reach) === could) return false;
  // The owner the page fell back to, in the address, gives way to the token's.
  window.history.replaceState(null, "", withOwner(window.location.hash, owner));
  render();
  return true;
}

setupOwner();
window.addEventListener("hashchange", () => {
  moves += 1;
  askTokenAgain();
  render();
});
if (!window.location.hash) window.history.replaceState(null, "", "#/overview");
// A token given after the first lookup (the dialog was dismissed at load, or the token
// rejected since) may act for another owner: look again, and show the view as that owner's.
let looked = false;
onTokenGiven(() => looked && lookAgain());
lookUp().then(() => {
  looked = true;
  render();
});
