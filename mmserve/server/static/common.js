// Shared by the playground and the dashboard: the API key (asked for, kept in this tab only), fetch with the
// key, DOM building and number formatting. The pages never contain the key: the server has no way to put it there.

const KEY_STORAGE = "mmserve.apiKey"; // sessionStorage: forgotten when the tab closes

/** Build an element: el("div", {class: "x", text: "hi", title: "..."}, child, "text", ...). */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") node.className = value;
    else if (name === "text") node.textContent = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

let configPromise = null;

/** What the server tells a page before it has a key: {auth_required, version}. */
export function uiConfig() {
  configPromise ??= fetch("/ui/api/config").then((r) => r.json());
  return configPromise;
}

function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

/** fetch() with the API key (when one was entered). A 401 forgets the key: the caller asks again. */
export async function apiFetch(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const key = storedKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) sessionStorage.removeItem(KEY_STORAGE);
  return response;
}

/** Resolves when API calls can be made: at once without --api-key, else once the user entered a key the
 * server accepts. `reason` is shown in the dialog (e.g. after a 401). */
export async function ensureKey(reason = "") {
  const config = await uiConfig();
  if (!config.auth_required || (storedKey() && !reason)) return;
  await askForKey(reason);
}

/** Forget the key and ask for another one. */
export function changeKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  return askForKey("");
}

let pendingAsk = null;

function askForKey(reason) {
  pendingAsk ??= new Promise((resolve) => {
    const input = el("input", {
      type: "password", id: "key-input", autocomplete: "off", placeholder: "API key", "aria-label": "API key",
    });
    const error = el("p", { class: "error", id: "key-error", role: "alert", text: reason });
    const submit = el("button", { type: "submit", class: "primary", id: "key-submit", text: "Unlock" });
    const form = el("form", {},
      el("h2", { text: "API key required" }),
      el("p", { text: "This server was started with --api-key. The key stays in this browser tab only and is "
        + "sent as a Bearer token with each API call." }),
      input, error, el("div", { class: "actions" }, submit));
    const dialog = el("dialog", { class: "key-dialog", id: "key-dialog" }, form);
    dialog.addEventListener("cancel", (event) => event.preventDefault()); // nothing works without it
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      submit.disabled = true;
      error.textContent = "Checking…";
      const ok = await checkKey(key);
      submit.disabled = false;
      if (!ok) {
        error.textContent = "The server refused this key.";
        input.select();
        return;
      }
      sessionStorage.setItem(KEY_STORAGE, key);
      dialog.close();
      dialog.remove();
      pendingAsk = null;
      resolve();
    });
    document.body.append(dialog);
    dialog.showModal();
    input.focus();
  });
  return pendingAsk;
}

async function checkKey(key) {
  try {
    const response = await fetch("/v1/models", { headers: { Authorization: `Bearer ${key}` } });
    return response.ok;
  } catch {
    return false;
  }
}

/** The served model's name (the first of /v1/models), or "" when the call fails. */
export async function servedModel() {
  try {
    const response = await apiFetch("/v1/models");
    if (!response.ok) return "";
    const body = await response.json();
    return body.data?.[0]?.id ?? "";
  } catch {
    return "";
  }
}

/** Seconds as "840 µs", "12.3 ms" or "1.42 s". */
export function fmtSeconds(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return "–";
  if (seconds === 0) return "0 ms";
  if (seconds < 0.001) return `${Math.round(seconds * 1e6)} µs`;
  if (seconds < 1) return `${(seconds * 1000).toFixed(seconds < 0.1 ? 1 : 0)} ms`;
  return `${seconds.toFixed(2)} s`;
}

export function fmtMs(ms) {
  return ms === null || ms === undefined ? "–" : fmtSeconds(ms / 1000);
}

export function fmtPercent(fraction, digits = 0) {
  return fraction === null || fraction === undefined ? "–" : `${(100 * fraction).toFixed(digits)}%`;
}

export function fmtNumber(n, digits = 0) {
  if (n === null || n === undefined) return "–";
  return Number(n).toLocaleString("en-US", { maximumFractionDigits: digits });
}

export function fmtBytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log2(n) / 10));
  return `${(n / 2 ** (10 * i)).toFixed(i ? 1 : 0)} ${units[i]}`;
}
