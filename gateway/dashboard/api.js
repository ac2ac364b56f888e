// The REST client: same origin only, the bearer token from sessionStorage, JSON errors as ApiError.

const TOKEN_KEY = "hyatlas.token";

/** A failed API call: the HTTP status and the API's `error` text. */
export class ApiError extends Error {
  constructor(status, message, body) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.body = body;
  }
}

/** The server did not answer at all: it is stopped or restarting, or the network is down. */
export class Unreachable extends Error {
  constructor() {
    super(`The HyAtlas server cannot be reached at ${window.location.origin}: it may be stopped or restarting, or the network is down`);
    this.name = "Unreachable";
  }
}

/** The server answered that it is not ready yet (503: a backing service is unavailable, as
 * while it restarts, or too many requests in flight); `retryAfterS` is how long its Retry-After
 * asks the client to wait (null when it says nothing readable). */
export class NotReady extends ApiError {
  constructor(message, body, retryAfterS) {
    super(503, message, body);
    this.name = "NotReady";
    this.retryAfterS = retryAfterS;
  }
}

/** The seconds a Retry-After header asks for (a number of seconds or an HTTP date), or null. */
function retryAfterOf(reply) {
  const value = (reply.headers.get("Retry-After") || "").trim();
  if (/^\d+$/.test(value)) return Number(value);
  const at = Date.parse(value);
  return Number.isNaN(at) ? null : Math.max(0, Math.ceil((at - Date.now()) / 1000));
}

/** Whether an error says the server is down for now (it is worth trying again) rather than
 * what is wrong with the call. */
export function isOutage(error) {
  return error instanceof Unreachable || error instanceof NotReady;
}

/** Whether the status answer says the tab's token reaches every owner (the server's own counts
 * and settings are for such a token only). */
export function reachesEveryOwner(status) {
  return status.reaches_every_owner === true;
}

const TOKEN_TEXT = "This server needs its access token (HYATLAS_TOKEN). It is kept for this browser tab only.";
const NO_TOKEN = "No access token given: reload the page, or open another view, to enter it";

let tokenPrompt = null;
// Set when the user dismissed the dialog: calls fail at once until the user moves on.
let declined = false;

// Told each time the user gives a token in the dialog (it may reach other owners).
let tokenGiven = () => {};

/** Calls `listener` each time the user gives a token in the dialog. */
export function onTokenGiven(listener) {
  tokenGiven = listener;
}

/** Lets the next call that needs the token ask for it again (after the user navigates). */
export function askTokenAgain() {
  declined = false;
}

/** Asks for the token once, however many calls are waiting for it; resolves false on Escape. */
function askToken(rejected) {
  if (tokenPrompt) return tokenPrompt;
  const dialog = document.getElementById("token-dialog");
  const input = document.getElementById("token-input");
  document.getElementById("token-reason").textContent = rejected ? `That token was rejected. ${TOKEN_TEXT}` : TOKEN_TEXT;
  tokenPrompt = new Promise((resolve) => {
    // The form (method=dialog) closes it with the button's value; Escape closes it with "".
    dialog.addEventListener("close", () => {
      const given = dialog.returnValue === "continue" && input.value.trim() !== "";
      if (given) sessionStorage.setItem(TOKEN_KEY, input.value.trim());
      input.value = "";
      tokenPrompt = null;
      declined = !given;
      resolve(given);
      if (given) tokenGiven();
    }, { once: true });
  });
  dialog.returnValue = "";
  dialog.showModal();
  input.focus();
  return tokenPrompt;
}

/** fetch, with a failure to reach the server (fetch's TypeError) as Unreachable. */
async function reach(url, init) {
  try {
    return await fetch(url, init);
  } catch (error) {
    if (!(error instanceof TypeError)) throw error;
    throw new Unreachable();
  }
}

/** Sends one request with the tab's token, asking for it again on a 401; the reply otherwise.
 * `body` goes as it is (a string, or a File, which is read again for a second try). */
async function send(path, { method = "GET", body, query, accept = "application/json", type = "application/json" } = {}) {
  const url = new URL(path, window.location.origin);
  for (const [key, value] of Object.entries(query || {})) {
    if (value !== "" && value !== null && value !== undefined) url.searchParams.set(key, String(value));
  }
  for (;;) {
    const headers = { Accept: accept };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = type;
    const reply = await reach(url, { method, headers, body, credentials: "omit", cache: "no-store" });
    if (reply.status !== 401) return reply;
    if (token) sessionStorage.removeItem(TOKEN_KEY);
    if (!declined && (await askToken(Boolean(token)))) continue;
    throw new ApiError(401, NO_TOKEN, await jsonOf(reply));
  }
}

async function jsonOf(reply) {
  try {
    return await reply.json();
  } catch {
    return null;
  }
}

async function refusal(reply) {
  const data = await jsonOf(reply);
  const message = (data && data.error) || `HTTP ${reply.status}`;
  return reply.status === 503 ? new NotReady(message, data, retryAfterOf(reply)) : new ApiError(reply.status, message, data);
}

/** Calls the gateway and returns the decoded JSON; throws ApiError on any non-2xx answer. */
export async function api(path, { body, ...options } = {}) {
  const reply = await send(path, { ...options, body: body === undefined ? undefined : JSON.stringify(body) });
  if (!reply.ok) throw await refusal(reply);
  return jsonOf(reply);
}

/** Posts a file as JSON lines; the answer's status and JSON whatever the status (an import
 * that stopped part-way still says what it wrote). */
export async function upload(path, file) {
  const reply = await send(path, { method: "POST", body: file, type: "application/x-ndjson" });
  return { ok: reply.ok, status: reply.status, data: (await jsonOf(reply)) || {} };
}

/** Fetches what a route streams (with the token, which a plain link cannot send) and saves it
 * as `filename`; throws ApiError on a refusal, and an Error when the stream was cut short. */
export async function download(path, query, filename) {
  const reply = await send(path, { query, accept: "application/x-ndjson" });
  if (!reply.ok) throw await refusal(reply);
  let blob;
  try {
    blob = await reply.blob();
  } catch {
    // The server ended the stream early (a store failing part-way leaves it unended).
    throw new Error("the server cut the file short, so nothing was saved; try again");
  }
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = filename;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
}
