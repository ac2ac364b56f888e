// The shell: hash routes to views, the owner selector every view reads, one render at a time.

import { h, errorBox } from "./dom.js";
import * as overview from "./views/overview.js";
import * as explore from "./views/explore.js";
import * as memories from "./views/memories.js";
import * as graph from "./views/graph.js";
import * as system from "./views/system.js";

const VIEWS = { overview, explore, memories, graph, system };
const OWNER_KEY = "hyatlas.owner";

function loadOwner() {
  try {
    const saved = JSON.parse(sessionStorage.getItem(OWNER_KEY) || "{}");
    return { user_id: saved.user_id || "default", agent_id: saved.agent_id || "" };
  } catch {
    return { user_id: "default", agent_id: "" };
  }
}

let owner = loadOwner();
let renderSeq = 0;
// Tells a watcher (and the browser tests) that a render finished: this load's id and a counter.
const loadId = Math.random().toString(36).slice(2);

function parseHash() {
  const [path, search] = window.location.hash.replace(/^#\/?/, "").split("?", 2);
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const name = VIEWS[parts[0]] ? parts[0] : "overview";
  return { name, arg: parts.slice(1).join("/"), params: new URLSearchParams(search || "") };
}

async function render() {
  const { name, arg, params } = parseHash();
  const seq = ++renderSeq;
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("active", link.dataset.view === name);
    if (link.dataset.view === name) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  const root = document.getElementById("view");
  const section = h("section", { class: `view view-${name}`, "data-view": name, "aria-busy": "true" });
  root.replaceChildren(section);
  const ctx = {
    owner: { ...owner },
    arg,
    params,
    stale: () => seq !== renderSeq,
    go: (hash) => { window.location.hash = hash; },
    refresh: render,
  };
  try {
    await VIEWS[name].render(section, ctx);
  } catch (error) {
    if (seq === renderSeq) section.append(errorBox(error, "This view could not load"));
  } finally {
    if (seq === renderSeq) {
      section.setAttribute("aria-busy", "false");
      document.documentElement.dataset.rendered = `${loadId}:${seq}`;
    }
  }
}

function setupOwner() {
  const form = document.getElementById("owner");
  const user = document.getElementById("owner-user");
  const agent = document.getElementById("owner-agent");
  user.value = owner.user_id;
  agent.value = owner.agent_id;
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    owner = { user_id: user.value.trim() || "default", agent_id: agent.value.trim() };
    user.value = owner.user_id;
    sessionStorage.setItem(OWNER_KEY, JSON.stringify(owner));
    // A memory's detail belongs to its owner: go back to the list when the owner changes.
    const { name } = parseHash();
    if (name === "memories" && parseHash().arg) window.location.hash = "#/memories";
    else render();
  });
}

setupOwner();
window.addEventListener("hashchange", render);
if (!window.location.hash) window.history.replaceState(null, "", "#/overview");
render();
