/* Shared helpers of the page: DOM building (text only), the API key, calls to this server,
   safe markdown. Every URL is relative, so requests go to this page's own origin only
   (and work under --root-path). */
"use strict";
const TL = (window.TL = {});

TL.$ = (id) => document.getElementById(id);

/* An element whose text is set with textContent: model output and request ids are never HTML. */
TL.el = (tag, text, cls) => {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
};

TL.fmt = {
  num: (v, d = 0) => (v === null || v === undefined ? "–" : Number(v).toFixed(d)),
  pct: (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"),
  secs: (v) => (v === null || v === undefined ? "–" : v < 1 ? (1000 * v).toFixed(0) + " ms" : v.toFixed(2) + " s"),
};

/* The API key lives in sessionStorage (this tab only) and goes only into requests to this origin. */
TL.apiKey = () => sessionStorage.getItem("tokenloom-api-key") || "";
/* The server says on the page itself whether it wants a key (--api-key). */
TL.authRequired = document.body.dataset.auth === "required";
/* True when calls can go out: no key needed, or one was given. */
TL.ready = () => !TL.authRequired || TL.apiKey() !== "";
TL.askKey = () => {
  const d = TL.$("key-dialog");
  if (!d.open) d.showModal();
};
TL.$("key-form").addEventListener("submit", () => {
  sessionStorage.setItem("tokenloom-api-key", TL.$("key-input").value.trim());
  TL.$("key-input").value = "";
});
TL.$("key-button").addEventListener("click", TL.askKey);
TL.$("key-button").hidden = !TL.authRequired;
if (!TL.ready()) TL.askKey();

/* fetch() to this server with the key; a 401 opens the key dialog. */
TL.api = async (path, options = {}) => {
  if (/^[a-z]+:|^\/\//i.test(path)) throw new Error("only this server is called");
  const headers = Object.assign({}, options.headers || {});
  const key = TL.apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  const r = await fetch(path, Object.assign({}, options, { headers, credentials: "same-origin" }));
  if (r.status === 401) { sessionStorage.removeItem("tokenloom-api-key"); TL.askKey(); }
  return r;
};

/* The error message of a failed API response, in OpenAI's error shape or plain. */
TL.errorText = async (r) => {
  const text = await r.text();
  try { return JSON.parse(text).error.message || text; } catch (e) { return text || r.statusText; }
};

/* Markdown to sanitised HTML: raw HTML in the model's text is shown as text (escaped), and
   DOMPurify cleans what marked produced, so no script, handler or style can come through. */
TL.markdown = (() => {
  const escape = (s) => s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  const md = new marked.Marked({ gfm: true, breaks: true });
  md.use({ renderer: { html: (token) => escape(token.raw || token.text || "") } });
  return (text) => DOMPurify.sanitize(md.parse(text), { USE_PROFILES: { html: true }, FORBID_TAGS: ["style", "form", "input"] });
})();
TL.setMarkdown = (node, text) => { node.innerHTML = TL.markdown(text); };

/* Tabs. */
document.querySelectorAll("button.tab[data-view]").forEach((b) => b.addEventListener("click", () => {
  document.querySelectorAll("button.tab[data-view]").forEach((o) => o.classList.toggle("active", o === b));
  document.querySelectorAll("section.view").forEach((s) => { s.hidden = s.id !== "view-" + b.dataset.view; });
}));

/* The hover tooltip of the completions view. */
TL.tooltip = {
  show(evt, text) { const t = TL.$("tooltip"); t.textContent = text; t.hidden = false; t.style.left = evt.clientX + 12 + "px"; t.style.top = evt.clientY + 12 + "px"; },
  hide() { TL.$("tooltip").hidden = true; },
};
