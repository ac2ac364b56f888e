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

let tokenPrompt = null;

/** Asks for the token once, however many calls are waiting for it. */
function askToken(reason) {
  if (tokenPrompt) return tokenPrompt;
  const dialog = document.getElementById("token-dialog");
  const form = document.getElementById("token-form");
  const input = document.getElementById("token-input");
  if (reason) document.getElementById("token-reason").textContent = `${reason}. The token is kept for this browser tab only.`;
  tokenPrompt = new Promise((resolve) => {
    form.addEventListener("submit", () => {
      sessionStorage.setItem(TOKEN_KEY, input.value.trim());
      input.value = "";
      tokenPrompt = null;
      resolve();
    }, { once: true });
  });
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
      await askToken(data && data.error);
      continue;
    }
    if (!reply.ok) throw new ApiError(reply.status, (data && data.error) || `HTTP ${reply.status}`, data);
    return data;
  }
}
