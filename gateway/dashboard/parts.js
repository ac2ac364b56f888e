// A view's parts, each loaded apart: one the server could not give for now says so in place and
// is loaded again, while the parts that loaded stay as they are.

import { isOutage, Unreachable } from "./api.js";
import { h, errorBox } from "./dom.js";

/** Takes the waiting notes out of `boxes`. */
function unmark(boxes) {
  for (const box of boxes) box.querySelectorAll(":scope > .waiting").forEach((note) => note.remove());
}

function waitingNote(error) {
  const why = error instanceof Unreachable ? "the server cannot be reached" : `the server is not ready yet: ${error.message}`;
  return h("div", { class: "error waiting", role: "status" }, `Waiting to load this: ${why}.`);
}

/** The parts of one render of a view. */
export class Parts {
  /** `stale()` says the view was rendered again since, so nothing is drawn into this one. */
  constructor(stale) {
    this.stale = stale;
    /** Each waiting part's loader, and the outage it met last. */
    this.waiting = new Map();
  }

  /** Loads a part: `fetch()` gives its data and `draw(data)` shows it in `boxes` (an element
   * or several). While the server cannot be reached or is not ready, each box says the part
   * waits, and `again()` loads it again; another error goes to `fail(error)` (by default a box
   * in each box saying it). */
  async load(boxes, fetch, draw, fail) {
    const all = [boxes].flat();
    // Two tries may overlap (Try again now pressed while one is out): the first answer that is
    // not an outage is shown, once; what comes after it is not.
    let settled = false;
    const attempt = async () => {
      let data;
      try {
        data = await fetch();
      } catch (error) {
        if (this.stale() || settled) return;
        unmark(all);
        if (isOutage(error)) {
          this.waiting.set(attempt, error);
          for (const box of all) box.append(waitingNote(error));
          return;
        }
        settled = true;
        this.waiting.delete(attempt);
        if (fail) fail(error);
        else for (const box of all) box.append(errorBox(error));
        return;
      }
      if (this.stale() || settled) return;
      settled = true;
      this.waiting.delete(attempt);
      unmark(all);
      await draw(data);
    };
    await attempt();
  }

  /** Loads every waiting part again, all at once. */
  async again() {
    await Promise.all([...this.waiting.keys()].map((attempt) => attempt()));
  }
}
