// flatserve chat page. Model text only ever reaches the DOM through textContent / text nodes:
// the markdown renderer below builds elements itself, so a "<script>" in a reply shows as text.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "flatserve.key", CONV = "flatserve.conversation";
const state = { messages: [], ctrl: null, authed: false };

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// ------------------------------------------------------------------ API key and requests
class AuthError extends Error {}

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const key = sessionStorage.getItem(KEY);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function api(path, opts) {
  opts = opts || {};
  const r = await fetch(path, Object.assign({}, opts, { headers: authHeaders(opts.headers) }));
  if (r.status === 401) {
    askKey(sessionStorage.getItem(KEY) ? "That API key was refused; enter the server's key."
                                       : "This server needs an API key.");
    throw new AuthError("API key needed");
  }
  return r;
}

function askKey(message) {
  state.authed = false;
  $("key-message").textContent = message;
  $("key-dialog").hidden = false;
  $("key-input").focus();
}

async function errorText(r) {
  try {
    const j = await r.json();
    return (j.error && j.error.message) || JSON.stringify(j);
  } catch (_) {
    return "HTTP " + r.status;
  }
}

// ------------------------------------------------------------------ models and metrics
async function loadModels() {
  let r;
  try { r = await api("/v1/models"); } catch (e) { return; }
  if (!r.ok) { $("status").textContent = await errorText(r); return; }
  state.authed = true;
  const sel = $("model"), keep = sel.value;
  sel.replaceChildren();
  for (const m of (await r.json()).data) {
    const o = el("option", null, m.id);
    o.value = m.id;
    if (m.max_model_len) o.title = "max_model_len " + m.max_model_len;
    sel.append(o);
  }
  if (keep) sel.value = keep;
  refreshMetrics();
}

function metric(text, name) {
  const m = text.match(new RegExp("^" + name + " ([0-9.e+-]+)$", "m"));
  return m ? parseFloat(m[1]) : NaN;
}

async function refreshMetrics() {
  if (!state.authed) return;
  let text;
  try {
    const r = await api("/metrics");
    if (!r.ok) return;
    text = await r.text();
  } catch (_) { return; }
  const used = metric(text, "flatserve_kv_blocks_used"), total = metric(text, "flatserve_kv_blocks_total");
  const running = metric(text, "flatserve_num_requests_running");
  const waiting = metric(text, "flatserve_num_requests_waiting");
  if (!(total > 0)) return;
  $("kv-meter").value = used / total;
  $("kv-text").textContent = `${used} / ${total} blocks (${(100 * used / total).toFixed(1)} %) · `
    + `${running} running, ${waiting} waiting`;
}

// ------------------------------------------------------------------ markdown, built as DOM nodes
function safeHref(href) {
  try {
    const u = new URL(href, location.href);
    return u.protocol === "http:" || u.protocol === "https:" ? u.href : null;
  } catch (_) { return null; }
}

// Inline spans: `code`, **bold**, *italic*, [text](http(s) link); anything else is plain text.
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|\*(?=[^\s*])([^*]*?[^\s*])\*|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

function inline(text, parent) {
  let last = 0, m;
  INLINE.lastIndex = 0;
  const plain = (s) => {
    const parts = s.split("\n");
    parts.forEach((p, i) => { if (i) parent.append(el("br")); if (p) parent.append(document.createTextNode(p)); });
  };
  const matches = [];
  while ((m = INLINE.exec(text)) !== null) matches.push([m.index, m[0].length, m.slice()]);
  for (const [at, len, g] of matches) {
    plain(text.slice(last, at));
    last = at + len;
    if (g[1]) parent.append(el("code", null, g[2].trim() ? g[2].replace(/^ (.*) $/, "$1") : g[2]));
    else if (g[3] !== undefined) inline(g[3], parent.appendChild(el("strong")));
    else if (g[4] !== undefined) inline(g[4], parent.appendChild(el("em")));
    else {
      const href = safeHref(g[6]);
      if (href) {
        const a = el("a", null, g[5]);
        a.href = href; a.target = "_blank"; a.rel = "noopener noreferrer";
        parent.append(a);
      } else plain(g[0]);
    }
  }
  plain(text.slice(last));
}

function copyButton(getText, label) {
  const b = el("button", "copy", label || "Copy");
  b.type = "button";
  b.addEventListener("click", async () => {
    await copyText(getText());
    b.textContent = "Copied";
    setTimeout(() => { b.textContent = label || "Copy"; }, 1200);
  });
  return b;
}

async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const t = el("textarea");  // plain-http fallback off localhost
  t.value = text;
  document.body.append(t);
  t.select();
  document.execCommand("copy");
  t.remove();
}

function codeBlock(code, lang) {
  const box = el("div", "code");
  const head = el("div", "code-head");
  head.append(el("span", null, lang || "code"), copyButton(() => code));
  const pre = el("pre"), c = el("code", null, code);
  if (lang) c.dataset.lang = lang;
  pre.append(c);
  box.append(head, pre);
  return box;
}

const FENCE = /^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/, HEAD = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/, RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;

function isBlockStart(line) {
  return FENCE.test(line) || HEAD.test(line) || ITEM.test(line) || RULE.test(line) || /^\s*>/.test(line);
}

function renderMarkdown(src) {
  const frag = document.createDocumentFragment();
  const lines = src.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {  // an unclosed fence (still streaming) runs to the end
      const close = m[1][0], code = [];
      for (i++; i < lines.length && !new RegExp("^\\s{0,3}\\" + close + "{3,}\\s*$").test(lines[i]); i++) {
        code.push(lines[i]);
      }
      i++;
      frag.append(codeBlock(code.join("\n"), m[2]));
    } else if (!line.trim()) {
      i++;
    } else if ((m = line.match(HEAD))) {
      inline(m[2], frag.appendChild(el("h" + Math.min(m[1].length + 2, 6))));
      i++;
    } else if (RULE.test(line)) {
      frag.append(el("hr"));
      i++;
    } else if (/^\s*>/.test(line)) {
      const quote = [];
      for (; i < lines.length && /^\s*>/.test(lines[i]); i++) quote.push(lines[i].replace(/^\s*> ?/, ""));
      frag.appendChild(el("blockquote")).append(renderMarkdown(quote.join("\n")));
    } else if ((m = line.match(ITEM))) {
      const ordered = /\d/.test(m[1]);
      const list = frag.appendChild(el(ordered ? "ol" : "ul"));
      if (ordered && parseInt(m[1], 10) !== 1) list.start = parseInt(m[1], 10);
      for (; i < lines.length && (m = lines[i].match(ITEM)) && /\d/.test(m[1]) === ordered; i++) {
        let body = m[2];
        while (i + 1 < lines.length && /^\s{2,}\S/.test(lines[i + 1]) && !ITEM.test(lines[i + 1])) {
          body += "\n" + lines[++i].trim();
        }
        inline(body, list.appendChild(el("li")));
      }
    } else {
      const para = [];
      for (; i < lines.length && lines[i].trim() && (!para.length || !isBlockStart(lines[i])); i++) {
        para.push(lines[i]);
      }
      inline(para.join("\n"), frag.appendChild(el("p")));
    }
  }
  return frag;
}

// ------------------------------------------------------------------ conversation view
function save() {
  sessionStorage.setItem(CONV, JSON.stringify(state.messages.map((m) => ({
    role: m.role, content: m.content, stats: m.stats, stopped: m.stopped, error: m.error }))));
}

function statsText(m) {
  const s = m.stats, parts = [];
  if (s) {
    if (s.ttft !== null) parts.push(`TTFT ${(s.ttft / 1000).toFixed(2)} s`);
    if (s.tps !== null) parts.push(`${s.tps.toFixed(1)} tok/s`);
    parts.push(`${s.tokens} tokens`);
  }
  if (m.stopped) parts.push("stopped");
  return parts.join(" · ");
}

function messageView(m) {
  const box = el("article", "msg " + m.role + (m.error ? " error" : ""));
  const head = el("div", "msg-head");
  head.append(el("span", "role", m.role === "user" ? "You" : "Assistant"), copyButton(() => m.content));
  const body = el("div", "body");
  body.append(m.error ? el("p", null, m.error) : renderMarkdown(m.content));
  box.append(head, body);
  if (m.role === "assistant") box.append(el("div", "stats", statsText(m)));
  m.view = { box, body, stats: box.lastChild };
  return box;
}

function render() {
  $("log").replaceChildren(...state.messages.map(messageView));
  $("empty").hidden = state.messages.length > 0;
  updateButtons();
  $("log").scrollTop = $("log").scrollHeight;
}

function updateButtons() {
  const busy = state.ctrl !== null;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("regenerate").disabled = busy || !state.messages.some((m) => m.role === "user");
}

// ------------------------------------------------------------------ generation
function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of state.messages) if (!m.error) messages.push({ role: m.role, content: m.content });
  const body = { messages, stream: true, stream_options: { include_usage: true },
                 temperature: parseFloat($("temperature").value), top_p: parseFloat($("top-p").value) };
  if ($("model").value) body.model = $("model").value;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  return body;
}

async function generate() {
  const body = requestBody();
  const msg = { role: "assistant", content: "" };
  state.messages.push(msg);
  render();
  const ctrl = (state.ctrl = new AbortController());
  updateButtons();
  const t0 = performance.now();
  let tFirst = null, tLast = null, chunks = 0, usage = null, pending = false;
  const paint = () => {
    pending = false;
    msg.view.body.replaceChildren(renderMarkdown(msg.content));
    $("log").scrollTop = $("log").scrollHeight;
  };
  try {
    const r = await api("/v1/chat/completions", { method: "POST", signal: ctrl.signal,
      headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
    if (!r.ok) throw new Error(await errorText(r));
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      const lines = buf.split("\n");
      buf = lines.pop();
      for (const line of lines) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") continue;
        const ev = JSON.parse(data);
        if (ev.error) throw new Error(ev.error.message || "server error");
        if (ev.usage) usage = ev.usage;
        const ch = ev.choices && ev.choices[0];
        if (ch && ch.finish_reason === "abort") msg.stopped = true;
        const delta = ch && ch.delta && ch.delta.content;
        if (delta) {
          const now = performance.now();
          if (tFirst === null) tFirst = now;
          tLast = now;
          chunks++;
          msg.content += delta;
          if (!pending) { pending = true; requestAnimationFrame(paint); }
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else if (!(e instanceof AuthError) || !msg.content) msg.error = e.message;
  } finally {
    state.ctrl = null;
    const tokens = usage ? usage.completion_tokens : chunks;
    // Decode speed over the tokens after the first (the first one's time is TTFT).
    msg.stats = { ttft: tFirst === null ? null : tFirst - t0, tokens,
                  tps: tokens > 1 && tLast > tFirst ? (tokens - 1) / ((tLast - tFirst) / 1000) : null };
    render();
    save();
    refreshMetrics();
  }
}

function send(ev) {
  if (ev) ev.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.ctrl) return;
  $("input").value = "";
  state.messages.push({ role: "user", content: text });
  generate();
}

function regenerate() {
  if (state.ctrl) return;
  while (state.messages.length && state.messages[state.messages.length - 1].role !== "user") {
    state.messages.pop();
  }
  if (state.messages.length) generate();
}

function clearChat() {
  if (state.ctrl) state.ctrl.abort();
  state.messages = [];
  save();
  render();
}

// ------------------------------------------------------------------ wiring
function restore() {
  try { state.messages = JSON.parse(sessionStorage.getItem(CONV) || "[]"); } catch (_) { state.messages = []; }
}

function bindRange(id) {
  const input = $(id), out = $(id + "-out");
  const show = () => { out.textContent = input.value; };
  input.addEventListener("input", show);
  show();
}

document.addEventListener("DOMContentLoaded", () => {
  bindRange("temperature");
  bindRange("top-p");
  $("composer").addEventListener("submit", send);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) send(e);
  });
  $("stop").addEventListener("click", () => { if (state.ctrl) state.ctrl.abort(); });
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", clearChat);
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("key-input").value = "";
    $("key-dialog").hidden = true;
    loadModels();
  });
  restore();
  render();
  loadModels();
  setInterval(refreshMetrics, 2000);
});
