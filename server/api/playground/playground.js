// xlserve playground: generate over the websocket, read a document into a session with per-byte
// surprisal, manage the session. Plain browser JavaScript, no build step, no external resources;
// every request goes to the server that served this page.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { session: null, socket: null, running: null, models: {} };

// -- the API key: typed here, kept in this browser only --------------------------------------------

const keyInput = $("api-key");
keyInput.value = localStorage.getItem("xlserve-api-key") || "";
keyInput.addEventListener("change", () => {
  localStorage.setItem("xlserve-api-key", keyInput.value);
  // an open websocket carries the key it was opened with: the next generation opens one with this key
  if (state.socket && !state.running) { state.socket.close(); state.socket = null; }
  loadModels();
});

function headers(extra = {}) {
  const h = { ...extra };
  if (keyInput.value) h["Authorization"] = "Bearer " + keyInput.value;
  return h;
}

function status(text, isError = false) {
  const el = $("status");
  el.textContent = text;
  el.className = isError ? "error" : "muted";
}

async function api(method, path, body, raw = false) {
  const init = { method, headers: headers(body !== undefined && !raw ? { "Content-Type": "application/json" } : {}) };
  if (body !== undefined) init.body = raw ? body : JSON.stringify(body);
  const response = await fetch(path, init);
  if (!response.ok) {
    let message = response.status + " " + response.statusText;
    try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return response;
}

const json = async (method, path, body) => (await api(method, path, body)).json();

// -- models ------------------------------------------------------------------------------------

// The model a first visit starts with: the shipped Transformer-XL, whose segment memory is what
// the document panel shows best; else any Transformer-XL; else the first listed.
const PREFERRED_MODEL = "transformer-xl-stdlib";

function defaultModel(models) {
  const preferred = models.find((m) => m.id === PREFERRED_MODEL) ||
    models.find((m) => m.architecture === "transformer-xl") || models[0];
  return preferred ? preferred.id : "";
}

async function loadModels() {
  try {
    const listing = await json("GET", "/v1/models");
    const select = $("model");
    const previous = select.value;
    select.innerHTML = "";
    state.models = {};
    for (const model of listing.data) {
      state.models[model.id] = model;
      select.add(new Option(model.id, model.id));
    }
    select.value = state.models[previous] ? previous : defaultModel(listing.data);
    showModel();
    status(`${listing.data.length} model(s)`);
    await refreshSessionList();
  } catch (error) {
    status("models: " + error.message, true);
  }
}

function showModel() {
  const model = state.models[$("model").value];
  $("model-card").textContent = model ? `${model.architecture} · state ${model.state_kind}` +
    ` · context ${model.max_context === null ? "unbounded" : model.max_context}` : "";
}

$("model").addEventListener("change", () => {
  showModel();
  // a session belongs to one model: keep using it with another would only be refused, so it is
  // put aside (not deleted: "your sessions" still lists it, and picking it switches back)
  if (state.session && state.session.model !== $("model").value) {
    status(`session ${state.session.id} belongs to ${state.session.model}: put aside (pick it again under "your sessions")`);
    showSession(null);
  }
});

// -- generate over the websocket -----------------------------------------------------------------

function base64url(text) {
  const bytes = new TextEncoder().encode(text);
  let binary = "";
  for (const b of bytes) binary += String.fromCharCode(b);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

function socket() {
  // browsers cannot set headers on a websocket: the key travels as a subprotocol (docs/websocket.md)
  if (state.socket && state.socket.readyState <= 1) return Promise.resolve(state.socket);
  const protocols = ["xlserve"];
  if (keyInput.value) protocols.push("xlserve.key." + base64url(keyInput.value));
  const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/stream";
  const ws = new WebSocket(url, protocols);
  state.socket = ws;
  ws.onmessage = (message) => onFrame(JSON.parse(message.data));
  ws.onclose = () => { if (state.running) finishGeneration("connection closed", true); };
  return new Promise((resolve, reject) => {
    ws.onopen = () => resolve(ws);
    ws.onerror = () => reject(new Error("the websocket could not connect"));
  });
}

function number(id) {
  const value = $(id).value;
  return value === "" ? null : Number(value);
}

async function generate(prompt, target, stats, withSession) {
  // target: where the text streams to; stats: where its timings and finish reason go
  if (state.running) return;
  const frame = { type: "generate", id: "g" + Date.now(), model: $("model").value, prompt,
                  max_tokens: number("max-tokens"), temperature: number("temperature"), top_p: number("top-p"),
                  top_k: number("top-k") };
  if (number("seed") !== null) frame.seed = number("seed");
  target.textContent = "";
  stats.className = "muted";
  delete stats.dataset.finish;
  if (withSession) {
    frame.session_id = await ensureSession();
    frame.model = state.session.model;
  }
  state.running = { id: frame.id, target, stats, sent: performance.now(), first: null, tokens: 0 };
  $("generate").disabled = true; $("continue").disabled = true; $("cancel").disabled = false;
  stats.textContent = "generating…";
  try {
    (await socket()).send(JSON.stringify(frame));
  } catch (error) {
    finishGeneration(error.message, true);
  }
}

function onFrame(frame) {
  const running = state.running;
  // the server's refusal of the connection itself (a wrong or missing API key) names no request:
  // it is the running generation's answer, not a frame to drop
  const refusal = frame.type === "error" && frame.id === null;
  if (!running || (frame.id !== running.id && !refusal)) return;
  if (frame.type === "token") {
    if (running.first === null) running.first = performance.now();
    running.tokens += 1;
    running.target.textContent += frame.text;
    showRate(running);
  } else if (frame.type === "done") {
    running.target.textContent += frame.text || "";
    finishGeneration(frame.finish_reason);
    if (frame.session_id) refreshSession();
  } else if (frame.type === "error") {
    finishGeneration(frame.error.message, true);
  }
}

function showRate(running) {
  const ttft = running.first === null ? null : running.first - running.sent;
  const seconds = (performance.now() - (running.first || running.sent)) / 1000;
  const rate = running.tokens > 1 && seconds > 0 ? (running.tokens - 1) / seconds : null;
  running.stats.textContent = `${running.tokens} tokens · time to first token ` +
    `${ttft === null ? "–" : ttft.toFixed(0) + " ms"} · ${rate === null ? "–" : rate.toFixed(1)} tokens/s`;
}

function finishGeneration(reason, isError = false) {
  const running = state.running;
  state.running = null;
  $("generate").disabled = false; $("cancel").disabled = true;
  $("continue").disabled = !state.session;
  if (!running) return;
  showRate(running);
  const el = running.stats;
  el.textContent += ` · ${isError ? "error: " : "finished: "}${reason}`;
  el.dataset.finish = isError ? "error" : reason;
  if (isError) el.className = "error";
}

$("generate").addEventListener("click", () => {
  generate($("prompt").value, $("output"), $("generation-stats"), $("use-session").checked);
});
$("cancel").addEventListener("click", () => {
  if (state.running && state.socket) state.socket.send(JSON.stringify({ type: "cancel", id: state.running.id }));
});

// -- read a document into a session, scored --------------------------------------------------------

const documentArea = $("document");
documentArea.addEventListener("dragover", (event) => event.preventDefault());
documentArea.addEventListener("drop", async (event) => {
  event.preventDefault();
  const file = event.dataTransfer.files[0];
  if (file) documentArea.value = await file.text();
});

function chunksOf(text, bytes) {
  // cut at character boundaries, about `bytes` UTF-8 bytes each
  const chunks = [];
  let current = "", size = 0;
  for (const character of text) {
    const width = new TextEncoder().encode(character).length;
    if (size + width > bytes && current) { chunks.push(current); current = ""; size = 0; }
    current += character; size += width;
  }
  if (current) chunks.push(current);
  return chunks;
}

// a token that adds part of a character is named by its bytes' escapes ("<0xC3>"): one byte each
const BYTE_ESCAPES = /^(?:<0x[0-9A-Fa-f]{2}>)+$/;

function tokenBytes(token) {
  return BYTE_ESCAPES.test(token) ? token.length / 6 : new TextEncoder().encode(token).length;
}

async function scoreChunk(chunk, sessionId) {
  // echo with per-token log-probs and no new tokens; with a session the chunk joins its memory.
  // Each token's text is the chunk's, cut at the answer's text offsets (a byte of a character
  // adds no character of its own: its name is an escape, its text empty, the last byte's the character)
  const body = { model: $("model").value, prompt: chunk, max_tokens: 0, echo: true, logprobs: 0 };
  if (sessionId) body.session_id = sessionId; else body.prefix_cache = false;
  const result = await json("POST", "/v1/completions", body);
  // text_offset counts characters (code points), as the server's text is cut; a JS string's
  // indices count UTF-16 units, which split a character past U+FFFF (𝄞) in two
  const characters = Array.from(result.choices[0].text), logprobs = result.choices[0].logprobs;
  const offsets = logprobs.text_offset;
  return logprobs.tokens.map((token, i) => ({
    token, text: characters.slice(offsets[i], i + 1 < offsets.length ? offsets[i + 1] : characters.length).join(""),
    bits: logprobs.token_logprobs[i] === null ? null : -logprobs.token_logprobs[i] / Math.LN2,
    bytes: tokenBytes(token) || 1 }));
}

function colour(bitsPerByte) {
  // 0 bits: white, 8 bits or more: deep red
  const t = Math.max(0, Math.min(1, bitsPerByte / 8));
  return `rgb(255, ${Math.round(255 - 200 * t)}, ${Math.round(255 - 220 * t)})`;
}

const curves = { with: [], without: [] };
// the legend's colours; "with memory" is drawn last so that where the curves meet it stays visible
const CURVE_STYLES = [["without", "#d62728", 1.5], ["with", "#1f77b4", 2.5]];

function niceStep(range, count) {
  // a step of 1, 2 or 5 times a power of ten that cuts `range` into about `count` parts
  const raw = range / count, magnitude = 10 ** Math.floor(Math.log10(raw)), norm = raw / magnitude;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * magnitude;
}

function tickLabel(value, step) {
  if (value >= 1000 && step >= 100) return (value / 1000).toFixed(step >= 1000 ? 0 : 1) + "k";
  return value.toFixed(step < 1 ? Math.min(3, -Math.floor(Math.log10(step))) : 0);
}

function drawCurves() {
  // the backing store follows the canvas's CSS size, so text stays sharp and legible at any width
  const canvas = $("curve"), ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 600, height = canvas.clientHeight || 240;
  canvas.width = Math.round(width * ratio); canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const all = [...curves.with, ...curves.without];
  if (!all.length) return;

  const left = 46, right = width - 14, top = 20, bottom = height - 34;
  const maxX = Math.max(1, ...all.map((p) => p[0])), topY = Math.max(1, ...all.map((p) => p[1]));
  const xStep = niceStep(maxX, Math.max(2, Math.floor((right - left) / 90)));
  const yStep = niceStep(topY, 5), maxY = Math.ceil(topY / yStep) * yStep;
  const x = (v) => left + (right - left) * v / maxX, y = (v) => bottom - (bottom - top) * v / maxY;

  ctx.font = "11px system-ui, sans-serif"; ctx.lineWidth = 1;
  // y: bits per byte, gridlines at each tick
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (let v = 0; v <= maxY + yStep / 2; v += yStep) {
    ctx.strokeStyle = "#eee"; ctx.beginPath(); ctx.moveTo(left, y(v)); ctx.lineTo(right, y(v)); ctx.stroke();
    ctx.strokeStyle = "#999"; ctx.beginPath(); ctx.moveTo(left - 4, y(v)); ctx.lineTo(left, y(v)); ctx.stroke();
    ctx.fillStyle = "#666"; ctx.fillText(tickLabel(v, yStep), left - 6, y(v));
  }
  // x: bytes read so far
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  for (let v = 0; v <= maxX; v += xStep) {
    ctx.strokeStyle = "#999"; ctx.beginPath(); ctx.moveTo(x(v), bottom); ctx.lineTo(x(v), bottom + 4); ctx.stroke();
    ctx.fillStyle = "#666"; ctx.fillText(tickLabel(v, xStep), x(v), bottom + 6);
  }
  ctx.strokeStyle = "#999"; ctx.beginPath();
  ctx.moveTo(left, top); ctx.lineTo(left, bottom); ctx.lineTo(right, bottom); ctx.stroke();
  // the units
  ctx.fillStyle = "#333";
  ctx.textAlign = "left"; ctx.textBaseline = "bottom"; ctx.fillText("bits/byte", 4, top - 6);
  ctx.textAlign = "right"; ctx.textBaseline = "bottom"; ctx.fillText("bytes read", right, height - 2);

  for (const [name, colourName, lineWidth] of CURVE_STYLES) {
    const points = curves[name];
    if (!points.length) continue;
    ctx.strokeStyle = colourName; ctx.lineWidth = lineWidth; ctx.lineJoin = "round"; ctx.beginPath();
    points.forEach(([px, py], i) => (i ? ctx.lineTo(x(px), y(py)) : ctx.moveTo(x(px), y(py))));
    ctx.stroke();
  }
  canvas.dataset.withPoints = curves.with.length;
  canvas.dataset.withoutPoints = curves.without.length;
}
window.addEventListener("resize", drawCurves);

function runningCurve(scored, into) {
  let bits = 0, bytes = 0, position = 0;
  for (const item of scored) {
    position += item.bytes;
    if (item.bits === null) continue;
    bits += item.bits; bytes += item.bytes;
    into.push([position, bits / bytes]);
  }
}

$("read").addEventListener("click", async () => {
  const text = documentArea.value;
  if (!text) return;
  const chunks = chunksOf(text, number("chunk-bytes") || 128);
  $("read").disabled = true;
  $("coloured").innerHTML = "";
  curves.with = []; curves.without = [];
  const withMemory = [], withoutMemory = [];
  try {
    await newSession();
    for (let i = 0; i < chunks.length; i++) {
      $("document-stats").textContent = `chunk ${i + 1} of ${chunks.length}…`;
      const scored = await scoreChunk(chunks[i], state.session.id);
      withMemory.push(...scored);
      for (const item of scored) {
        const span = document.createElement("span");
        span.textContent = item.text;
        span.style.background = item.bits === null ? "transparent" : colour(item.bits / item.bytes);
        span.title = item.bits === null ? "no context" : `${item.bits.toFixed(2)} bits`;
        $("coloured").appendChild(span);
      }
      withoutMemory.push(...await scoreChunk(chunks[i], null));
      curves.with = []; curves.without = [];
      runningCurve(withMemory, curves.with); runningCurve(withoutMemory, curves.without);
      drawCurves();
    }
    const total = (items) => { const s = items.filter((t) => t.bits !== null);
      return s.reduce((a, t) => a + t.bits, 0) / s.reduce((a, t) => a + t.bytes, 0); };
    const stats = $("document-stats");
    stats.textContent = `${chunks.length} chunks · with memory ${total(withMemory).toFixed(3)} bits/byte · ` +
      `without memory ${total(withoutMemory).toFixed(3)} bits/byte`;
    stats.dataset.bytes = withMemory.reduce((sum, item) => sum + item.bytes, 0);  // the bytes read
    stats.dataset.done = "true";
    await refreshSession();
  } catch (error) {
    $("document-stats").textContent = "error: " + error.message;
    $("document-stats").className = "error";
  } finally {
    $("read").disabled = false;
    $("continue").disabled = !state.session;
  }
});

$("continue").addEventListener("click", () => {
  generate("", $("continuation"), $("continuation-stats"), true);
});

// -- the session ---------------------------------------------------------------------------------

function showSession(info) {
  state.session = info;
  $("session-id").textContent = info ? info.id : "–";
  $("session-model").textContent = info ? info.model : "–";
  $("session-tokens").textContent = info ? info.tokens : "–";
  $("session-bytes").textContent = info ? info.state_bytes.toLocaleString() : "–";
  $("session-tier").textContent = info ? info.tier : "–";
  $("session-version").textContent = info ? info.version : "–";
  $("continue").disabled = !info || Boolean(state.running);
  if (info && state.models[info.model] && $("model").value !== info.model) {
    // a session answers only to its own model: the selector follows it
    $("model").value = info.model;
    showModel();
  }
  const list = $("session-list");
  if (info) {
    const listed = [...list.options].find((o) => o.value === info.id);
    if (listed) listed.text = sessionOption(info).text; else list.add(sessionOption(info), 1);
  }
  list.value = info ? info.id : "";
}

function sessionOption(info) {
  return new Option(`${info.id} · ${info.model} · ${info.tokens} tokens`, info.id);
}

async function refreshSessionList() {
  // the caller's own sessions, newest first (GET /v1/sessions), to pick one up again
  const listing = await json("GET", "/v1/sessions?limit=100");
  const list = $("session-list");
  list.innerHTML = "";
  list.add(new Option("(none)", ""));
  for (const info of listing.data) list.add(sessionOption(info));
  list.value = state.session ? state.session.id : "";
}

$("session-list").addEventListener("change", guarded(async () => {
  const id = $("session-list").value;
  showSession(id ? await json("GET", `/v1/sessions/${encodeURIComponent(id)}`) : null);
  status(state.session ? `session ${state.session.id} of ${state.session.model}` : "no session");
}));

async function newSession() {
  showSession(await json("POST", "/v1/sessions", { model: $("model").value }));
  return state.session.id;
}

async function ensureSession() {
  return state.session ? state.session.id : newSession();
}

async function refreshSession() {
  if (state.session) showSession(await json("GET", `/v1/sessions/${state.session.id}`));
}

function guarded(action) {
  return async () => { try { await action(); } catch (error) { status(error.message, true); } };
}

$("new-session").addEventListener("click", guarded(newSession));
$("refresh-session").addEventListener("click", guarded(refreshSession));
$("fork-session").addEventListener("click", guarded(async () => {
  if (state.session) showSession(await json("POST", `/v1/sessions/${state.session.id}/fork`));
}));
$("delete-session").addEventListener("click", guarded(async () => {
  if (!state.session) return;
  await api("DELETE", `/v1/sessions/${state.session.id}`);
  showSession(null);
  await refreshSessionList();
}));
$("export-session").addEventListener("click", guarded(async () => {
  if (!state.session) return;
  const blob = await (await api("GET", `/v1/sessions/${state.session.id}/state`)).blob();
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = state.session.id + ".safetensors";
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10000);
}));
$("import-session").addEventListener("change", guarded(async (event) => {
  const file = $("import-session").files[0];
  if (!file) return;
  const response = await api("POST", "/v1/sessions/import", await file.arrayBuffer(), true);
  showSession(await response.json());
  $("import-session").value = "";
}));

loadModels();
