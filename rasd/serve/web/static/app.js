// rasd document-QA page: no framework, no build step. Talks to the service's own HTTP API.
"use strict";

// Where a committed token came from: a draft node's source when verification accepted it, "bonus" for the
// target's own token after the accepted path, "prefill" for the first token (the prompt's forward).
const SOURCES = {
  documents: { color: "#b6e3a8", label: "documents (retrieved for this question)" },
  datastore: { color: "#a9c9ff", label: "datastore (the whole index)" },
  context: { color: "#ffd59e", label: "context (prompt + answer so far)" },
  draft: { color: "#e4bdf2", label: "draft model" },
  eagle: { color: "#f2c4d8", label: "EAGLE head (the target's draft head)" },
  recycling: { color: "#a6e4dc", label: "token recycling" },
  history: { color: "#f5e3a1", label: "history (earlier answers)" },
  bonus: { color: "#e3e6eb", label: "target model (bonus token)" },
  prefill: { color: "#cfd4da", label: "target model (first token, prefill)" },
};
const KEY_STORAGE = "rasd.apiKey";
// why an answer ended, in words (the API's finish_reason)
const FINISHED = { stop: "end of answer", length: "max tokens reached",
                   repetition: "stopped where the answer began to repeat itself" };

const $ = (id) => document.getElementById(id);
const state = { controller: null, counts: {}, steps: [], tokens: 0, firstAt: 0, lastAt: 0, plain: null };

function colorOf(source) {
  if (!SOURCES[source]) {          // a source this page does not know yet: a stable colour from its name
    let h = 0;
    for (const c of source) h = (h * 31 + c.charCodeAt(0)) % 360;
    SOURCES[source] = { color: `hsl(${h}, 70%, 82%)`, label: source };
  }
  return SOURCES[source].color;
}

// ------------------------------------------------------------------ HTTP
class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = `Bearer ${key}`;
  return h;
}

async function raiseFor(response) {
  if (response.ok) return response;
  let message = response.statusText || "request failed";
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || body.detail || JSON.stringify(body);
  } catch (_) { /* not JSON */ }
  throw new ApiError(response.status, message);
}

async function getJSON(path) {
  return (await raiseFor(await fetch(path, { headers: headers(false) }))).json();
}

async function postJSON(path, body, signal) {
  return raiseFor(await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal }));
}

// Server-sent events from a fetch response (EventSource cannot POST): yields parsed objects, null for [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const chunk = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = chunk.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data === "[DONE]" ? null : JSON.parse(data);
    }
  }
}

// ------------------------------------------------------------------ errors
function showError(err) {
  const box = $("error");
  const status = err instanceof ApiError ? `Error ${err.status}: ` : "Error: ";
  box.textContent = status + (err.message || String(err));
  box.hidden = false;
}
function clearError() { $("error").hidden = true; $("error").textContent = ""; }

// ------------------------------------------------------------------ service info
// Each call supersedes the ones before it: an answer to a request sent with an older key (the page's first
// load, before a key was typed) may arrive late and must not show its 401 over a newer, working state.
let infoCalls = 0;
async function loadInfo() {
  const call = ++infoCalls;
  try {
    const info = await getJSON("/v1/info");
    if (call !== infoCalls) return null;
    const index = info.index ? `${info.index.num_documents} documents, ${info.index.num_chunks} chunks` : "no index";
    $("info").textContent = `${info.model} · ${index}`;
    const select = $("method");
    if (!select.options.length) {
      for (const m of info.methods) select.add(new Option(m, m, false, m === info.docqa_method));
    }
    return info;
  } catch (err) {
    if (call !== infoCalls) return null;
    $("info").textContent = "";
    showError(err);
    return null;
  }
}

// ------------------------------------------------------------------ rendering
function renderLegend(final) {
  const list = $("legend");
  list.textContent = "";
  const names = Object.keys(SOURCES);
  for (const s of Object.keys(state.counts)) if (!names.includes(s)) names.push(s);
  const accepted = final ? final.rasd.accepted_by_source || {} : null;
  for (const name of names) {
    const count = state.counts[name] || 0;
    const li = document.createElement("li");
    li.dataset.source = name;
    li.dataset.count = String(count);
    if (!count) li.className = "empty";
    const sw = document.createElement("span");
    sw.className = "swatch";
    sw.style.background = colorOf(name);
    const label = document.createElement("span");
    label.className = "name";
    label.textContent = SOURCES[name].label;
    const n = document.createElement("span");
    n.className = "count";
    n.textContent = String(count);
    li.append(sw, label, n);
    if (accepted && name !== "prefill" && (accepted[name] || 0) !== count) {
      const note = document.createElement("span");
      note.className = "note";
      note.title = "the verifier accepted more; a stop condition cut them off before they were returned";
      note.textContent = `(${accepted[name] || 0} accepted)`;
      li.append(note);
    }
    list.append(li);
  }
}

function renderChart() {
  const svg = $("chart");
  const W = svg.clientWidth || 320, H = svg.clientHeight || 120, pad = 16;
  const steps = state.steps;
  const top = Math.max(4, ...steps.map((s) => s.length));
  const bw = steps.length ? Math.min(14, (W - pad - 4) / steps.length) : 14;
  const y = (v) => H - pad - (v * (H - pad - 6)) / top;
  const parts = [];
  for (let v = 1; v <= top; v += top > 8 ? 2 : 1) {
    parts.push(`<line x1="${pad}" x2="${W}" y1="${y(v)}" y2="${y(v)}" stroke="#eef0f3"/>`);
    parts.push(`<text x="2" y="${y(v) + 3}">${v}</text>`);
  }
  steps.forEach((sources, i) => {
    const x = pad + i * bw;
    sources.forEach((src, j) => {   // stacked: the accepted draft tokens from the bottom, the bonus on top
      parts.push(`<rect class="seg" x="${x + 0.5}" y="${y(j + 1)}" width="${Math.max(bw - 1, 1)}" ` +
                 `height="${y(j) - y(j + 1) - 0.5}" fill="${colorOf(src)}" stroke="rgba(0,0,0,.18)" stroke-width=".5"/>`);
    });
    parts.push(`<rect class="step" data-length="${sources.length}" x="${x}" y="${y(sources.length)}" width="${bw}" ` +
               `height="${y(0) - y(sources.length)}" fill="transparent"><title>step ${i + 1}: ${sources.length} ` +
               `tokens (${sources.join(", ")})</title></rect>`);
  });
  parts.push(`<line x1="${pad}" x2="${W}" y1="${y(0)}" y2="${y(0)}" stroke="#9aa0a6"/>`);
  parts.push(`<text x="${pad}" y="${H - 3}">${steps.length} steps</text>`);
  svg.innerHTML = parts.join("");
}

function fmtRate(v) { return v ? `${v.toFixed(1)} tok/s` : "–"; }

function renderSpeed(final) {
  let live = 0;
  if (final && final.rasd.tokens_per_s) live = final.rasd.tokens_per_s;
  else if (state.tokens > 1 && state.lastAt > state.firstAt) live = (state.tokens - 1) / ((state.lastAt - state.firstAt) / 1000);
  const plain = state.plain ? state.plain.tokens_per_s : 0;
  $("live-tps").textContent = fmtRate(live) + (final ? " (server, decode)" : "");
  $("plain-tps").textContent = fmtRate(plain);
  $("speedup").textContent = live && plain ? `${(live / plain).toFixed(2)}×` : "–";
  const steps = state.steps.length;
  const mean = final ? final.rasd.mean_accepted_tokens
    : steps ? state.steps.reduce((a, s) => a + s.length, 0) / steps : 0;
  $("mean-accepted").textContent = mean ? mean.toFixed(2) : "–";
}

function renderSources(sources) {
  const list = $("sources");
  list.textContent = "";
  for (const s of sources) {
    const li = document.createElement("li");
    const title = document.createElement("span");
    title.className = "title";
    title.textContent = s.title || s.source || s.doc_id || "untitled";
    const score = document.createElement("span");
    score.className = "score";
    score.textContent = typeof s.score === "number" ? `score ${s.score.toFixed(3)}` : "";
    const text = document.createElement("div");
    text.className = "text";
    text.textContent = s.text || "";
    li.append(title, score, text);
    list.append(li);
  }
}

function appendPieces(pieces) {
  const answer = $("answer");
  for (const p of pieces) {
    if (!p.text) continue;
    const span = document.createElement("span");
    span.className = "tok";
    span.dataset.source = p.source;
    span.style.background = colorOf(p.source);
    span.title = p.source;
    span.textContent = p.text;
    answer.append(span);
  }
}

// ------------------------------------------------------------------ asking
function resetAnswer() {
  Object.assign(state, { counts: {}, steps: [], tokens: 0, firstAt: 0, lastAt: 0, plain: null });
  $("answer").textContent = "";
  $("sources").textContent = "";
  $("raw-stats").textContent = "";
  $("legend-check").textContent = "";
  renderLegend(null);
  renderChart();
  renderSpeed(null);
}

function onTokens(event) {
  const sources = event.token_sources || [];
  const now = performance.now();
  if (sources.length) {
    if (!state.tokens) state.firstAt = now;
    state.lastAt = now;
    state.tokens += sources.length;
    for (const s of sources) state.counts[s] = (state.counts[s] || 0) + 1;
  }
  if (event.step_sources) state.steps.push(event.step_sources);   // one verification step per later block
  if (event.plain_decoding) state.plain = event.plain_decoding;
  appendPieces(event.pieces || (event.delta ? [{ text: event.delta, source: "bonus" }] : []));
  $("status").textContent = `streaming… ${state.tokens} tokens`;
  renderLegend(null);
  renderChart();
  renderSpeed(null);
}

function onFinal(final) {
  if (final.plain_decoding) state.plain = final.plain_decoding;
  $("raw-stats").textContent = JSON.stringify(final, null, 2);
  renderLegend(final);
  renderChart();
  renderSpeed(final);
  const api = final.rasd.committed_by_source || {};
  const names = new Set([...Object.keys(api), ...Object.keys(state.counts)]);
  const same = [...names].every((n) => (api[n] || 0) === (state.counts[n] || 0));
  $("legend-check").textContent = same ? "✓ counts match the statistics returned by the API"
    : "✗ counts differ from the API's statistics";
  $("legend-check").dataset.match = String(same);
  const r = final.rasd;
  $("status").dataset.finish = final.finish_reason;
  $("status").textContent = `done (${FINISHED[final.finish_reason] || final.finish_reason}): ` +
    `${final.usage.completion_tokens} tokens in ` +
    `${r.total_time_s.toFixed(2)} s, ${r.steps} steps, mean accepted ${r.mean_accepted_tokens.toFixed(2)}, ` +
    `method ${r.method}, prompt ${final.usage.prompt_tokens} tokens ` +
    `(${(final.usage.prompt_tokens_details || {}).cached_tokens || 0} from the prefix cache)`;
}

async function ask(ev) {
  ev.preventDefault();
  if (state.controller) return;
  clearError();
  resetAnswer();
  const answer = $("answer");
  const controller = new AbortController();
  state.controller = controller;
  $("ask").disabled = true;
  $("stop").disabled = false;
  answer.dataset.state = "waiting";
  $("status").textContent = "retrieving…";
  const body = { question: $("question").value, stream: true, max_tokens: Number($("max-tokens").value) || 128,
                 top_k_sources: Number($("top-k").value) || 4 };
  if ($("method").value) body.method = $("method").value;
  try {
    const response = await postJSON("/v1/docqa", body, controller.signal);
    answer.dataset.state = "streaming";
    for await (const event of sseEvents(response)) {
      if (event === null) break;
      if (event.error) throw new ApiError(event.error.code || 500, event.error.message);
      if (event.sources && !("delta" in event)) renderSources(event.sources);
      else if ("answer" in event) onFinal(event);
      else onTokens(event);
    }
    answer.dataset.state = "done";
  } catch (err) {
    answer.dataset.state = err.name === "AbortError" ? "stopped" : "error";
    if (err.name === "AbortError") $("status").textContent = `stopped after ${state.tokens} tokens`;
    else { $("status").textContent = ""; showError(err); }
  } finally {
    state.controller = null;
    $("ask").disabled = false;
    $("stop").disabled = true;
  }
}

// ------------------------------------------------------------------ documents
function readFile(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve({ title: file.name.replace(/\.[^.]+$/, ""), source: `upload:${file.name}`,
                                    text: String(reader.result) });
    reader.onerror = () => reject(reader.error);
    reader.readAsText(file);
  });
}

// A large upload becomes an ingest job (202): its status is polled and its progress shown until it ends.
async function followJob(accepted, result) {
  const bar = $("docs-progress");
  bar.hidden = false;
  bar.value = 0;
  try {
    for (let wait = 250; ; wait = Math.min(wait * 1.5, 3000)) {
      const job = await getJSON(accepted.status_url);
      bar.value = job.progress;
      result.textContent = `ingest job ${job.status}: ${job.stage}, ${Math.round(job.progress * 100)}%`;
      if (job.status === "done") return job.result;
      if (job.status === "failed") throw new ApiError(job.error.code || 500, job.error.message);
      await new Promise((resolve) => setTimeout(resolve, wait));
    }
  } finally {
    bar.hidden = true;
  }
}

async function addDocuments() {
  clearError();
  const result = $("docs-result");
  const docs = [];
  const text = $("doc-text").value;
  if (text.trim()) docs.push({ title: $("doc-title").value.trim(), source: "paste", text });
  for (const file of $("doc-files").files) docs.push(await readFile(file));
  if (!docs.length) { showError(new Error("paste a document or choose files first")); return; }
  $("add-docs").disabled = true;
  result.textContent = `adding ${docs.length} document(s)…`;
  try {
    const response = await raiseFor(await fetch("/v1/documents", {
      method: "POST", body: JSON.stringify({ documents: docs }),
      headers: { ...headers(true), "Idempotency-Key": `rasd-page-${Date.now()}-${Math.random().toString(16).slice(2)}` } }));
    let out = await response.json();
    if (response.status === 202) out = await followJob(out, result);
    result.textContent = `added ${out.added}; the index now has ${out.num_documents} documents, ${out.num_chunks} chunks`;
    $("doc-text").value = "";
    $("doc-title").value = "";
    $("doc-files").value = "";
    loadInfo();
  } catch (err) {
    result.textContent = "";
    showError(err);
  } finally {
    $("add-docs").disabled = false;
  }
}

// ------------------------------------------------------------------ start
function init() {
  const keyInput = $("api-key");
  keyInput.value = localStorage.getItem(KEY_STORAGE) || "";
  keyInput.addEventListener("change", () => {
    localStorage.setItem(KEY_STORAGE, keyInput.value.trim());
    clearError();
    loadInfo();
  });
  $("ask-form").addEventListener("submit", ask);
  $("question").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("ask-form").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("add-docs").addEventListener("click", addDocuments);
  renderLegend(null);
  renderChart();
  loadInfo();
}

init();
