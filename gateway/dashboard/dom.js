// Small DOM helpers: elements are built from data, never from HTML strings (memory text is untrusted).

const SVG_NS = "http://www.w3.org/2000/svg";

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : String(child));
  }
}

function build(el, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "class") el.setAttribute("class", value);
    // Through the CSSOM: the page's CSP refuses style attributes.
    else if (key === "style") Object.assign(el.style, value);
    else if (key in el && !(el instanceof SVGElement) && typeof value !== "string") el[key] = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

/** An HTML element with attributes, listeners (onclick: fn) and children. */
export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element with attributes and children. */
export function s(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

/** "2026-11-30 03:12 UTC" from unix seconds or an RFC3339 string; "" when absent. */
export function fmtTime(value) {
  if (value === null || value === undefined || value === "" || value === 0) return "";
  const date = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  if (Number.isNaN(date.getTime())) return String(value);
  return date.toISOString().slice(0, 16).replace("T", " ") + " UTC";
}

const DAY_MS = 86400000;

/** A row's event or due time on its writer's clock (its `utc_offset_minutes`), from unix seconds
 * or an RFC3339 string: "2024-05-15 20:00 −08:00"; a date kept alone ("YYYY-MM-DD" is kept at
 * its UTC midnight, as shared/dates.py reads it) as that date, "2024-05-15"; "" when absent. */
export function fmtWriterTime(value, offsetMinutes) {
  if (value === null || value === undefined || value === "") return "";
  const ms = typeof value === "number" ? value * 1000 : Date.parse(value);
  if (Number.isNaN(ms)) return String(value);
  if (ms % DAY_MS === 0) return new Date(ms).toISOString().slice(0, 10);
  const offset = offsetMinutes || 0;
  const local = new Date(ms + offset * 60000).toISOString().slice(0, 16).replace("T", " ");
  const hours = String(Math.floor(Math.abs(offset) / 60)).padStart(2, "0");
  const minutes = String(Math.abs(offset) % 60).padStart(2, "0");
  return `${local} ${offset < 0 ? "\u2212" : "+"}${hours}:${minutes}`;
}

/** "30 min", "1.5 h", "24 h" from seconds (under a minute: "45 s"). */
export function fmtDuration(seconds) {
  if (seconds >= 3600) return `${Number((seconds / 3600).toFixed(1))} h`;
  if (seconds >= 60) return `${Number((seconds / 60).toFixed(1))} min`;
  return `${seconds} s`;
}

/** "1.2 MiB" from a byte count. */
export function fmtBytes(bytes) {
  if (typeof bytes !== "number") return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? value : value.toFixed(1)} ${units[unit]}`;
}

/** A number with thousands separators. */
export function fmtCount(n) {
  return typeof n === "number" ? n.toLocaleString("en-US") : String(n ?? "");
}

/** A box that says what went wrong, with the API's own error text. */
export function errorBox(error, prefix) {
  const status = error && error.status ? ` (HTTP ${error.status})` : "";
  return h("div", { class: "error", role: "alert" }, prefix ? `${prefix}: ` : "", error.message || String(error), status);
}

/** A muted note for an empty section, saying what would fill it. */
export function emptyState(...lines) {
  return h("div", { class: "empty" }, lines.map((line) => h("p", null, line)));
}

/** A labelled value pair list. */
export function facts(pairs) {
  return h("dl", { class: "facts" }, pairs.filter(Boolean).map(([k, v]) => [h("dt", null, k), h("dd", null, v === "" || v === null || v === undefined ? "—" : v)]));
}

/** A button that asks first: the question with Yes / Cancel replaces it until answered; Cancel
 * or Escape puts the button back, focused. */
export function confirmed(id, label, cls, question, yes, onYes) {
  const button = h("button", { type: "button", id, class: cls }, label);
  const cancel = () => { ask.hidden = true; button.hidden = false; button.focus(); };
  const no = h("button", { type: "button", id: `cancel-${id}`, onclick: cancel }, "Cancel");
  const ask = h("span", { class: "confirm", id: `${id}-confirm`, hidden: true, onkeydown: (e) => { if (e.key === "Escape") cancel(); } },
    `${question} `,
    h("button", { type: "button", id: `confirm-${id}`, class: cls, onclick: async (e) => {
      e.target.disabled = true;
      if (!(await onYes())) e.target.disabled = false;
    } }, yes),
    " ", no);
  // The question takes the focus (on its safe answer), so that Escape reaches it.
  button.addEventListener("click", () => { button.hidden = true; ask.hidden = false; no.focus(); });
  return [button, ask];
}

/** What an action leaves for its view's next render (a render rebuilds the whole view), shown
 * once: `leave(what)` keeps it, `take()` hands it over (null when nothing waits). */
export function notices() {
  let held = null;
  return {
    leave: (what) => { held = what; },
    take: () => { const what = held; held = null; return what; },
  };
}

export const LAYERS = ["l1_profile", "l2_raw", "l3_fact", "l4_summary", "l5_knowledge", "l6_schema", "l7_intention", "l8_entity"];
