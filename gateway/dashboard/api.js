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

const TOKEN_TEXT = "This server needs its access token (HYATLAS_TOKEN). It is kept for this browser tab only.";
const NO_TOKEN = "No access token given: reload the page, or open another view, to enter it";

let tokenPrompt = null;
// Set when the user dismissed the dialog: calls fail at once until the user moves on.
let declined = false;

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
    }, { once: true });
  });
  dialog.returnValue = "";
  dialog.showModal();
  input.focus();
  return tokenPrompt;
}

/** Calls the gateway and returns the decoded JSON; throws ApiError on any non-2xx answer. */
export async function api(path, { method = "GET", body, query } = {}) {
  const url = new URL(path, window.location.origin);
  for (const [key, value] of Object.entries(query || {})) {
    if (value !== "" && value !== null && value !== undefined) url.searchParams.set(key, String(value));
  }
  for (;;) {
    const headers = { Accept: "application/json" };
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (token) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const reply = await fetch(url, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "omit",
      cache: "no-store",
    });
    let data = null;
    try {
      data = await reply.json();
    } catch {
      data = null;
    }
    if (reply.status === 401) {
      if (token) sessionStorage.removeItem(TOKEN_KEY);
      if (!declined && (await askToken(Boolean(token)))) continue;
      throw new ApiError(401, NO_TOKEN, data);
    }
    if (!reply.ok) throw new ApiError(reply.status, (data && data.error) || `HTTP ${reply.status}`, data);
    return data;
  }
}
