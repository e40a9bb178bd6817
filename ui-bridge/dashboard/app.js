// Built from dashboard/src by scripts/build-dashboard.mjs: do not edit.
var __defProp = Object.defineProperty;
var __defNormalProp = (obj, key, value) => key in obj ? __defProp(obj, key, { enumerable: true, configurable: true, writable: true, value }) : obj[key] = value;
var __publicField = (obj, key, value) => __defNormalProp(obj, typeof key !== "symbol" ? key + "" : key, value);

// src/state.ts
function emptyState() {
  return {
    epoch: null,
    seq: 0,
    health: null,
    worker: null,
    last_exit: null,
    engine: null,
    plan: null,
    vram: null,
    counters: null,
    request_errors: [],
    replans: []
  };
}
function stateFromSnapshot(snapshot) {
  return {
    epoch: snapshot.epoch,
    seq: snapshot.seq,
    health: snapshot.health,
    worker: snapshot.worker,
    last_exit: snapshot.last_exit,
    engine: snapshot.engine,
    plan: snapshot.plan,
    vram: snapshot.vram,
    counters: snapshot.counters,
    request_errors: [...snapshot.request_errors],
    replans: [...snapshot.replans]
  };
}
var keepLast = (items, item, keep) => {
  const out = [...items, item];
  return out.length > keep ? out.slice(out.length - keep) : out;
};
function applyMessage(state, message, options = {}) {
  if (message.type === "snapshot") {
    return { state: stateFromSnapshot(message), gap: false, duplicate: false };
  }
  if (state.epoch !== null && message.seq <= state.seq) {
    return { state, gap: false, duplicate: true };
  }
  const gap = state.epoch !== null && message.seq > state.seq + 1;
  const next = { ...state, seq: message.seq };
  const event = message;
  switch (event.type) {
    case "health":
      next.health = event;
      break;
    case "worker":
      next.worker = event;
      if (event.phase === "exited") next.last_exit = event;
      break;
    case "engine":
      next.engine = event;
      break;
    case "plan":
      next.plan = event;
      break;
    case "vram":
      next.vram = event;
      break;
    case "counters":
      next.counters = event;
      break;
    case "request_error":
      next.request_errors = keepLast(state.request_errors, event, options.keepRequestErrors ?? 50);
      break;
    case "replan":
      next.replans = keepLast(state.replans, event, options.keepReplans ?? 20);
      break;
    default: {
      const unknown = event;
      void unknown;
    }
  }
  return { state: next, gap, duplicate: false };
}

// src/types.ts
var CLOSE_CODES = {
  NORMAL: 1e3,
  GOING_AWAY: 1001,
  UNAUTHORIZED: 4001,
  ORIGIN_REFUSED: 4003,
  TOO_SLOW: 4008
};
var SUBPROTOCOL_PREFIX = "headroom.token.";

// src/client.ts
var DEFAULT_BACKOFF = { initialMs: 250, maxMs: 1e4, factor: 2, jitter: 0.3 };
function backoffDelay(attempt, b, random = Math.random) {
  const base = Math.min(b.maxMs, b.initialMs * b.factor ** Math.max(0, attempt));
  return Math.round(base * (1 - b.jitter * random()));
}
function defaultBaseUrl() {
  const loc = globalThis.location;
  if (loc?.origin && loc.origin !== "null") return loc.origin;
  throw new Error("no baseUrl given and no page origin to default to");
}
function wsUrl(baseUrl, path) {
  const url = new URL(path, baseUrl);
  url.protocol = url.protocol === "https:" ? "wss:" : url.protocol === "http:" ? "ws:" : url.protocol;
  return url;
}
var EventStream = class {
  constructor(options) {
    __publicField(this, "opts");
    __publicField(this, "socket", null);
    __publicField(this, "timer", null);
    __publicField(this, "listeners", /* @__PURE__ */ new Map());
    __publicField(this, "_state", emptyState());
    __publicField(this, "_status", { status: "idle", attempts: 0 });
    /** Messages received on the current connection. */
    __publicField(this, "received", 0);
    __publicField(this, "openedAt", 0);
    __publicField(this, "forceSnapshot", false);
    const WS = options.WebSocket ?? globalThis.WebSocket;
    if (!WS) throw new Error("no WebSocket implementation: pass options.WebSocket (e.g. from 'ws')");
    this.opts = {
      baseUrl: options.baseUrl ?? defaultBaseUrl(),
      token: options.token,
      tokenVia: options.tokenVia ?? "subprotocol",
      WebSocket: WS,
      backoff: { ...DEFAULT_BACKOFF, ...options.backoff },
      resume: options.resume ?? true,
      path: options.path ?? "/api/events",
      stableMs: options.stableMs ?? 2e3,
      keepRequestErrors: options.keepRequestErrors ?? 50,
      keepReplans: options.keepReplans ?? 20
    };
  }
  /** The current view (replaced, never mutated, on each message). */
  get state() {
    return this._state;
  }
  get status() {
    return this._status;
  }
  /** The last `seq` applied (null before the first snapshot). */
  get lastSeq() {
    return this._state.epoch === null ? null : this._state.seq;
  }
  /** Start (or restart after close()). */
  connect() {
    if (this.socket || this.timer) return;
    this.open();
  }
  /** Stop for good: no more reconnects. */
  close() {
    this.clearTimer();
    const socket = this.socket;
    this.socket = null;
    if (socket) {
      this.detach(socket);
      socket.close(CLOSE_CODES.NORMAL, "client closed");
    }
    this.setStatus({ status: "closed", attempts: this._status.attempts });
  }
  /** Listen for events of one type; returns the function that stops listening. */
  on(type, fn) {
    return this.listen(type, fn);
  }
  /** Each snapshot (on connect, or when a resume was not possible). */
  onSnapshot(fn) {
    return this.listen("snapshot", fn);
  }
  /** The state after every message. */
  onState(fn) {
    return this.listen(
      "$state",
      ({ state, message }) => fn(state, message)
    );
  }
  /** Connection status changes. */
  onStatus(fn) {
    return this.listen("$status", fn);
  }
  // -- internals ----------------------------------------------------------------------
  listen(key, fn) {
    let set = this.listeners.get(key);
    if (!set) this.listeners.set(key, set = /* @__PURE__ */ new Set());
    set.add(fn);
    return () => set.delete(fn);
  }
  emit(key, value) {
    for (const fn of this.listeners.get(key) ?? []) {
      try {
        fn(value);
      } catch (err) {
        console.error("headroom: a listener failed", err);
      }
    }
  }
  setStatus(info) {
    this._status = info;
    this.emit("$status", info);
  }
  url() {
    const url = wsUrl(this.opts.baseUrl, this.opts.path);
    const protocols = [];
    if (this.opts.tokenVia === "query") url.searchParams.set("token", this.opts.token);
    else protocols.push(SUBPROTOCOL_PREFIX + this.opts.token);
    const last = this.lastSeq;
    if (this.opts.resume && !this.forceSnapshot && last !== null && this._state.epoch) {
      url.searchParams.set("last_seq", String(last));
      url.searchParams.set("epoch", this._state.epoch);
    }
    return { url: url.toString(), protocols };
  }
  open() {
    this.clearTimer();
    const { url, protocols } = this.url();
    this.forceSnapshot = false;
    this.received = 0;
    this.openedAt = 0;
    this.setStatus({ status: "connecting", attempts: this._status.attempts });
    let socket;
    try {
      socket = new this.opts.WebSocket(url, protocols);
    } catch (err) {
      this.scheduleRetry(0, String(err));
      return;
    }
    this.socket = socket;
    socket.onopen = () => {
      if (this.socket !== socket) return;
      this.openedAt = Date.now();
      this.setStatus({ status: "open", attempts: this._status.attempts });
    };
    socket.onmessage = (ev) => {
      if (this.socket === socket) this.handle(socket, ev.data);
    };
    socket.onerror = () => {
    };
    socket.onclose = (ev) => {
      if (this.socket !== socket) return;
      this.socket = null;
      this.detach(socket);
      const stable = this.received > 0 || this.openedAt > 0 && Date.now() - this.openedAt >= this.opts.stableMs;
      const attempts = stable ? 0 : this._status.attempts;
      if (ev.code === CLOSE_CODES.UNAUTHORIZED) {
        this.setStatus({ status: "unauthorized", code: ev.code, reason: ev.reason, attempts });
        return;
      }
      this._status = { ...this._status, attempts };
      this.scheduleRetry(ev.code, ev.reason);
    };
  }
  detach(socket) {
    socket.onopen = socket.onmessage = socket.onclose = null;
    socket.onerror = () => {
    };
  }
  handle(socket, data) {
    let message;
    try {
      const text = typeof data === "string" ? data : new TextDecoder().decode(data);
      message = JSON.parse(text);
    } catch {
      return;
    }
    if (this.received++ === 0 && this._status.attempts !== 0) {
      this.setStatus({ status: "open", attempts: 0 });
    }
    const { state, gap, duplicate } = applyMessage(this._state, message, {
      keepRequestErrors: this.opts.keepRequestErrors,
      keepReplans: this.opts.keepReplans
    });
    if (gap) {
      this.forceSnapshot = true;
      this.socket = null;
      this.detach(socket);
      socket.close(CLOSE_CODES.NORMAL, "gap in seq");
      this.open();
      return;
    }
    if (duplicate) return;
    this._state = state;
    this.emit(message.type, message);
    this.emit("$state", { state, message });
  }
  scheduleRetry(code, reason) {
    const attempts = this._status.attempts;
    const delay = backoffDelay(attempts, this.opts.backoff);
    this.setStatus({ status: "waiting", code, reason, retryInMs: delay, attempts: attempts + 1 });
    this.timer = setTimeout(() => {
      this.timer = null;
      this.open();
    }, delay);
  }
  clearTimer() {
    if (this.timer !== null) {
      clearTimeout(this.timer);
      this.timer = null;
    }
  }
};
var HeadroomApiError = class extends Error {
  constructor(status, message, type = null, code = null, param = null) {
    super(message);
    this.status = status;
    this.type = type;
    this.code = code;
    this.param = param;
    this.name = "HeadroomApiError";
  }
};
var ControlClient = class {
  constructor(options) {
    __publicField(this, "baseUrl");
    __publicField(this, "token");
    __publicField(this, "fetchFn");
    this.baseUrl = options.baseUrl ?? defaultBaseUrl();
    this.token = options.token;
    this.fetchFn = options.fetch ?? globalThis.fetch.bind(globalThis);
  }
  /** `GET /api/status`: the snapshot. */
  status() {
    return this.call("GET", "/api/status");
  }
  /** Restart the engine worker (also from `failed`). */
  restart() {
    return this.call("POST", "/api/control/restart");
  }
  /** Stop the worker and give all its memory back (game mode) until `resume()`. A
   * service without the route answers 404, thrown as a `HeadroomApiError`. */
  pause() {
    return this.call("POST", "/api/control/pause");
  }
  /** Start the worker again after `pause()`. */
  resume() {
    return this.call("POST", "/api/control/resume");
  }
  /** Keep `reserve` free for the desktop: bytes, a size such as `"1.5GiB"`, or `"auto"`. */
  setReserve(reserve) {
    return this.call("POST", "/api/control/reserve", { reserve });
  }
  /** Resize the KV pool: bytes, a size such as `"6GiB"`, or null for the plan's size. */
  setKvCache(kvCache) {
    return this.call("POST", "/api/control/cache", { kv_cache: kvCache });
  }
  /** Resize the GPU expert cache (routed experts in host memory, `--cpu-experts`): bytes
   * (whole slots), a size such as `"1GiB"`, or null for the plan's size. */
  setExpertCache(expertCache) {
    return this.call("POST", "/api/control/cache", { expert_cache: expertCache });
  }
  /** Evict the prefix cache's unused pages. */
  clearPrefixCache() {
    return this.call("POST", "/api/control/cache", { clear_prefix_cache: true });
  }
  async call(method, path, body) {
    const headers = { Authorization: `Bearer ${this.token}` };
    if (body !== void 0) headers["Content-Type"] = "application/json";
    const response = await this.fetchFn(new URL(path, this.baseUrl).toString(), {
      method,
      headers,
      body: body === void 0 ? void 0 : JSON.stringify(body)
    });
    const text = await response.text();
    let parsed = null;
    try {
      parsed = text ? JSON.parse(text) : null;
    } catch {
    }
    if (!response.ok) {
      const error = parsed?.error;
      throw new HeadroomApiError(
        response.status,
        error?.message ?? `HTTP ${response.status}: ${text.slice(0, 200)}`,
        error?.type ?? null,
        error?.code ?? null,
        error?.param ?? null
      );
    }
    return parsed;
  }
};

// src/format.ts
var KiB = 1024;
var MiB = 1024 * KiB;
var GiB = 1024 * MiB;
function formatBytes(n) {
  const a = Math.abs(n);
  if (a >= GiB) return `${(n / GiB).toFixed(2)} GiB`;
  if (a >= MiB) return `${Math.round(n / MiB)} MiB`;
  if (a >= KiB) return `${Math.round(n / KiB)} KiB`;
  return `${n} B`;
}
function planSummary(plan) {
  return `${plan.device}: ${plan.num_pages} pages × ${plan.page_size} tokens, max context ${plan.max_context_tokens} tokens` + (plan.fits ? "" : ` — does not fit: ${formatBytes(plan.shortfall_bytes)} short`) + (plan.context_note ? ` — ${plan.context_note}` : "");
}

// dashboard/src/chart.ts
var SERIES = [
  { key: "ours", label: "ours", color: "#4c8dff" },
  { key: "others", label: "others'", color: "#f0a030" },
  { key: "driver", label: "unattributed", color: "#7d8590" },
  { key: "reserve", label: "reserve (free, kept for the desktop)", color: "#a371f7" },
  { key: "headroom", label: "free (headroom)", color: "#3fb950" }
];
function bands(s) {
  const ours = Math.max(0, s.ours);
  const others = Math.max(0, s.others);
  const free = Math.max(0, s.free);
  const driver = Math.max(0, s.total - free - ours - others);
  const reserve = Math.min(Math.max(0, s.reserve), free);
  return { ours, others, driver, reserve, headroom: free - reserve };
}
var GiB2 = 1 << 30;
var VramChart = class {
  constructor(canvas, windowS = 180, maxSamples = 4e3) {
    this.canvas = canvas;
    this.windowS = windowS;
    this.maxSamples = maxSamples;
    __publicField(this, "samples", []);
    __publicField(this, "scheduled", false);
  }
  push(sample) {
    const last = this.samples.at(-1);
    if (last && sample.t < last.t) return;
    this.samples.push(sample);
    const cutoff = sample.t - this.windowS * 2;
    while (this.samples.length > this.maxSamples || this.samples[0] && this.samples[0].t < cutoff) {
      this.samples.shift();
    }
    this.canvas.dataset.samples = String(this.samples.length);
    this.requestDraw();
  }
  requestDraw() {
    if (this.scheduled) return;
    this.scheduled = true;
    requestAnimationFrame(() => {
      this.scheduled = false;
      this.draw();
    });
  }
  draw(now = Date.now() / 1e3) {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const cssW = c.clientWidth || 600;
    const cssH = c.clientHeight || 220;
    if (c.width !== Math.round(cssW * dpr) || c.height !== Math.round(cssH * dpr)) {
      c.width = Math.round(cssW * dpr);
      c.height = Math.round(cssH * dpr);
    }
    const g = c.getContext("2d");
    if (!g) return;
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, cssW, cssH);
    const left = 52;
    const right = cssW - 8;
    const top = 8;
    const bottom = cssH - 20;
    const style = getComputedStyle(c);
    const fg = style.color || "#c9d1d9";
    const total = Math.max(GiB2, ...this.samples.map((s) => s.total));
    const y = (bytes) => bottom - bytes / total * (bottom - top);
    const first = this.samples[0]?.t ?? now;
    const span = Math.min(this.windowS, Math.max(30, Math.ceil(now - first)));
    const t0 = now - span;
    const x = (t) => left + (t - t0) / span * (right - left);
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = fg;
    g.strokeStyle = "rgba(128,128,128,0.25)";
    g.lineWidth = 1;
    let step = GiB2;
    while (total / step > 6) step *= 2;
    for (let b = 0; b <= total + 1; b += step) {
      g.beginPath();
      g.moveTo(left, y(b));
      g.lineTo(right, y(b));
      g.stroke();
      g.fillText(`${Math.round(b / GiB2)} GiB`, 4, y(b) + 4);
    }
    g.fillText(`-${span} s`, left, cssH - 4);
    g.fillText("now", right - 22, cssH - 4);
    const visible = this.samples.filter((s, i) => s.t >= t0 || this.samples[i + 1]?.t >= t0);
    if (visible.length === 0) return;
    const stacks = visible.map((s) => {
      const b = bands(s);
      let acc = 0;
      const tops = {};
      for (const { key } of SERIES) {
        acc += b[key];
        tops[key] = acc;
      }
      return { t: Math.max(s.t, t0), tops };
    });
    for (let i = SERIES.length - 1; i >= 0; i--) {
      const { key, color } = SERIES[i];
      g.beginPath();
      g.moveTo(x(stacks[0].t), y(0));
      stacks.forEach((s, j) => {
        const next = stacks[j + 1]?.t ?? now;
        g.lineTo(x(s.t), y(s.tops[key]));
        g.lineTo(x(next), y(s.tops[key]));
      });
      g.lineTo(x(now), y(0));
      g.closePath();
      g.fillStyle = color;
      g.fill();
    }
  }
};

// dashboard/src/chat.ts
function parseSse(buffer) {
  const chunks = [];
  const blocks = buffer.replace(/\r\n/g, "\n").split("\n\n");
  const rest = blocks.pop() ?? "";
  for (const block of blocks) {
    const data = block.split("\n").filter((line) => line.startsWith("data:")).map((line) => line.slice(5).trimStart()).join("\n");
    if (!data) continue;
    if (data === "[DONE]") {
      chunks.push({ kind: "done", finishReason: null });
      continue;
    }
    let event;
    try {
      event = JSON.parse(data);
    } catch {
      chunks.push({ kind: "error", message: `the service sent an event that is not JSON: ${data.slice(0, 80)}` });
      continue;
    }
    if (event.error) {
      chunks.push({ kind: "error", message: event.error.message ?? "the service reported an error" });
      continue;
    }
    const choice = event.choices?.[0];
    if (choice?.delta?.reasoning_content) chunks.push({ kind: "reasoning", text: choice.delta.reasoning_content });
    if (choice?.delta?.content) chunks.push({ kind: "text", text: choice.delta.content });
    if (choice?.finish_reason) chunks.push({ kind: "done", finishReason: choice.finish_reason });
  }
  return { chunks, rest };
}
function chatBody(messages, maxTokens) {
  return { model: "default", messages, stream: true, max_tokens: maxTokens };
}
async function httpError(response) {
  const text = await response.text();
  let message = text.slice(0, 300);
  try {
    message = JSON.parse(text).error?.message ?? message;
  } catch {
  }
  const hint = response.status === 401 ? " (this service was started with --api-key: enter the key)" : "";
  return `${response.status}: ${message}${hint}`;
}
async function streamChat(messages, onChunk, options = {}) {
  const headers = { "Content-Type": "application/json" };
  if (options.apiKey) headers.Authorization = `Bearer ${options.apiKey}`;
  const fetchFn = options.fetch ?? globalThis.fetch.bind(globalThis);
  const response = await fetchFn("/v1/chat/completions", {
    method: "POST",
    headers,
    body: JSON.stringify(chatBody(messages, options.maxTokens ?? 512)),
    signal: options.signal
  });
  if (!response.ok || !response.body) {
    onChunk({ kind: "error", message: await httpError(response) });
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let ended = false;
  for (; ; ) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value, { stream: !done });
    const { chunks, rest } = parseSse(done ? `${buffer}

` : buffer);
    buffer = rest;
    for (const chunk of chunks) {
      if (chunk.kind === "done" && chunk.finishReason === null) ended = true;
      onChunk(chunk);
    }
    if (done) break;
  }
  if (!ended) onChunk({ kind: "error", message: "the stream ended before [DONE]" });
}

// dashboard/src/view.ts
var STATES = {
  ready: { label: "ready", tone: "ok" },
  starting: { label: "starting", tone: "busy" },
  restarting: { label: "restarting", tone: "busy" },
  waiting_for_memory: { label: "waiting for memory", tone: "wait" },
  waiting_for_gpu: { label: "waiting for the GPU", tone: "wait" },
  paused: { label: "paused", tone: "paused" },
  idle: { label: "idle (model unloaded)", tone: "paused" },
  failed: { label: "failed", tone: "bad" },
  stopped: { label: "stopped", tone: "bad" }
};
function healthView(health) {
  if (!health) return { label: "unknown", tone: "unknown", detail: "" };
  const known = STATES[health.status];
  const label = known?.label ?? health.status.replace(/_/g, " ");
  const tone = known?.tone ?? "unknown";
  const parts = [];
  if (health.reason) parts.push(health.reason);
  if (health.retry_after_s != null && health.status !== "ready") parts.push(`retry in ~${health.retry_after_s} s`);
  return { label, tone, detail: parts.join("; ") };
}
function exitText(exit, time2) {
  if (!exit) return "none";
  const parts = [`pid ${exit.pid ?? "?"} at ${time2(exit.ts)}`];
  if (exit.exit_code != null) parts.push(`exit code ${exit.exit_code}`);
  if (exit.reason) parts.push(exit.reason);
  else if (exit.signal != null) parts.push(`killed by ${exit.signal}`);
  return parts.join("; ");
}
function memoryView(v) {
  if (!v) return { title: "Memory", detail: "no data yet", kind: "none", sample: null };
  if (v.source !== "none") {
    return {
      title: "VRAM",
      detail: `${v.device} (${v.source})`,
      kind: "gpu",
      sample: {
        t: v.ts,
        total: v.total_bytes,
        free: v.free_bytes,
        ours: v.ours_bytes,
        others: v.others_bytes,
        reserve: v.reserve_bytes
      }
    };
  }
  const why = v.reason || "no GPU, CPU mode";
  const host = v.host ?? null;
  if (!host) return { title: "Memory", detail: why, kind: "none", sample: null };
  return {
    title: "Host memory",
    detail: `${why}; the engine runs in the host's RAM`,
    kind: "host",
    sample: {
      t: v.ts,
      total: host.total_bytes,
      free: host.available_bytes,
      ours: host.ours_bytes,
      others: Math.max(0, host.total_bytes - host.available_bytes - host.ours_bytes),
      reserve: 0
    }
  };
}

// dashboard/src/main.ts
var TOKEN_KEY = "headroom.token";
function $(id) {
  const el2 = document.getElementById(id);
  if (!el2) throw new Error(`#${id} is missing from the page`);
  return el2;
}
function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== void 0 && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}
function row(cells, className) {
  const tr = el("tr", void 0, className);
  for (const c of cells) tr.append(el("td", c ?? "–"));
  return tr;
}
var time = (ts) => new Date(ts * 1e3).toLocaleTimeString();
function readToken() {
  const url = new URL(location.href);
  const fragment = new URLSearchParams(url.hash.replace(/^#/, ""));
  const fromUrl = fragment.get("token") || url.searchParams.get("token");
  if (fromUrl) {
    sessionStorage.setItem(TOKEN_KEY, fromUrl);
    fragment.delete("token");
    url.searchParams.delete("token");
    const rest = fragment.toString();
    url.hash = rest ? `#${rest}` : "";
    history.replaceState(null, "", url.toString());
    return fromUrl;
  }
  return sessionStorage.getItem(TOKEN_KEY);
}
function askForToken(note) {
  const form = $("token-form");
  const input = $("token-input");
  $("token-note").textContent = note;
  form.hidden = false;
  input.focus();
  return new Promise((resolve) => {
    form.addEventListener("submit", function onSubmit(event) {
      event.preventDefault();
      const typed = input.value.trim();
      if (!typed) return;
      form.removeEventListener("submit", onSubmit);
      form.hidden = true;
      input.value = "";
      sessionStorage.setItem(TOKEN_KEY, typed);
      resolve(typed);
    });
  });
}
function renderHealth(s) {
  const status = s.health?.status ?? "unknown";
  const view = healthView(s.health);
  const badge = $("health");
  badge.textContent = view.label;
  badge.className = `badge ${view.tone}`;
  document.body.dataset.health = status;
  $("model").textContent = s.health?.model ?? "–";
  $("health-reason").textContent = view.detail;
  $("pause").hidden = status === "paused" || status === "idle";
  $("resume").hidden = !$("pause").hidden;
}
function renderWorker(s) {
  const w = s.worker;
  document.body.dataset.worker = w?.phase ?? "unknown";
  $("worker-phase").textContent = w?.phase ?? "–";
  $("worker-pid").textContent = w?.pid != null ? String(w.pid) : s.health?.worker_pid != null ? String(s.health.worker_pid) : "–";
  $("worker-restarts").textContent = String(s.health?.restarts ?? w?.restarts ?? 0);
  const parts = [];
  if (w?.phase === "restarting" && w.delay_s != null) parts.push(`next try in ${w.delay_s.toFixed(1)} s`);
  if (w?.phase === "failed" && w.reason) parts.push(w.reason);
  $("worker-detail").textContent = parts.join("; ");
  const x = s.last_exit;
  $("worker-exit").textContent = exitText(x, time);
  $("worker-lines").textContent = (x?.last_lines ?? []).join("\n");
  $("worker-when").textContent = w ? time(w.ts) : "";
  const info = s.engine?.info;
  $("engine").textContent = info ? `${info.architecture} on ${info.device} (${info.dtype}); context ${info.max_context_tokens} tokens (model ${info.model_context_tokens}); KV ${info.num_pages} pages × ${info.page_size} = ${formatBytes(info.kv_cache_bytes)}; weights ${formatBytes(info.weight_bytes)}` : "–";
}
var HOST_LABELS = { headroom: "available" };
function renderVramLegend(s) {
  const v = s.vram;
  const view = memoryView(v);
  const legend = $("vram-legend");
  legend.replaceChildren();
  $("vram-title").textContent = view.title;
  $("vram-device").textContent = view.detail;
  document.body.dataset.memory = view.kind;
  $("vram-chart").hidden = view.sample === null;
  if (!v || !view.sample) return;
  const b = bands(view.sample);
  for (const { key, label, color } of SERIES) {
    if (view.kind === "host" && (key === "driver" || key === "reserve")) continue;
    const item = el("span", void 0, "legend-item");
    const swatch = el("i", void 0, "swatch");
    swatch.style.background = color;
    const name = view.kind === "host" ? HOST_LABELS[key] ?? label : label;
    item.append(swatch, el("span", `${name}: ${formatBytes(b[key])}`));
    legend.append(item);
  }
  if (view.kind === "gpu") {
    const headroom = el("span", `headroom ${formatBytes(v.headroom_bytes)} of ${formatBytes(v.total_bytes)}`, "legend-item strong");
    if (v.headroom_bytes < 0) headroom.classList.add("bad");
    legend.append(headroom);
  } else {
    legend.append(el("span", `${formatBytes(view.sample.free)} of ${formatBytes(view.sample.total)} available`, "legend-item strong"));
  }
  const top = $("vram-top");
  top.replaceChildren(...v.top_consumers.map((c) => row([c.pid, c.name, formatBytes(c.bytes)])));
}
function renderPlan(s) {
  const plan = s.plan?.plan ?? null;
  const body = $("plan-ledger");
  body.replaceChildren();
  $("plan-summary").textContent = !s.plan ? "no plan yet" : !plan ? "the KV cache size is fixed (no plan made)" : planSummary(plan);
  if (!plan) return;
  for (const e of plan.ledger) {
    body.append(row([e.sign === "+" ? "" : e.sign, e.name, formatBytes(e.bytes), e.source], e.sign === "=" ? "subtotal" : void 0));
  }
  const sugg = $("plan-suggestions");
  sugg.replaceChildren(
    ...plan.suggestions.map((x) => el("li", `${x.flag} ${x.current} → ${x.proposed} frees ${formatBytes(x.saves_bytes)}`))
  );
}
function renderCounters(s) {
  const c = s.counters;
  const e = c?.engine;
  const items = [
    ["in flight", c?.in_flight ?? 0],
    ["running", e?.running ?? "–"],
    ["waiting", e?.waiting ?? "–"],
    ["KV pages free", e ? `${e.free_pages} / ${e.total_pages}` : "–"],
    ["prefix-cached pages", e?.cached_pages ?? "–"],
    ["finished", e?.finished ?? "–"],
    ["failed", e?.failed ?? "–"],
    ["OOM steps (rolled back)", c?.oom_steps ?? 0],
    ["requests failed by OOM", c?.oom_failed_requests ?? 0],
    ["replans", c?.replans ?? 0]
  ];
  $("counters").replaceChildren(...items.map(([k, v]) => {
    const d = el("div", void 0, "counter");
    d.append(el("span", k, "k"), el("span", v, "v"));
    return d;
  }));
}
function renderErrors(s) {
  const rows = [...s.request_errors].reverse().map(
    (e) => row([
      time(e.ts),
      e.request_id,
      e.phase,
      e.code,
      e.action,
      e.bytes_asked != null ? formatBytes(e.bytes_asked) : null,
      e.headroom_bytes != null ? formatBytes(e.headroom_bytes) : null,
      e.message
    ])
  );
  $("errors").replaceChildren(...rows);
  $("errors-empty").hidden = rows.length > 0;
  const replans = [...s.replans].reverse().map(
    (r) => row([
      time(r.ts),
      r.action,
      r.after.expert_cache_slots != null && r.before.expert_cache_slots !== r.after.expert_cache_slots ? `expert cache ${r.before.expert_cache_slots} → ${r.after.expert_cache_slots} slots (${formatBytes(r.before.expert_cache_bytes ?? 0)} → ${formatBytes(r.after.expert_cache_bytes ?? 0)})` : `${formatBytes(r.before.kv_pool_bytes)} → ${formatBytes(r.after.kv_pool_bytes)}`,
      `${r.before.max_prefill_tokens} → ${r.after.max_prefill_tokens}`,
      r.duration_s != null ? `${(r.duration_s * 1e3).toFixed(0)} ms` : null,
      r.reason
    ])
  );
  $("replans").replaceChildren(...replans);
  $("replans-empty").hidden = replans.length > 0;
}
function renderConnection(info) {
  const text = info.status === "waiting" ? `reconnecting in ${((info.retryInMs ?? 0) / 1e3).toFixed(1)} s (attempt ${info.attempts})` : info.status === "unauthorized" ? "the token was refused: reload and enter the right one" : info.status;
  $("connection").textContent = text;
  document.body.dataset.connection = info.status;
  if (info.status === "unauthorized") sessionStorage.removeItem(TOKEN_KEY);
}
function setUpChat() {
  const messages = [];
  const form = $("chat-form");
  const input = $("chat-input");
  const log = $("chat-log");
  const send = $("chat-send");
  let controller = null;
  $("chat-clear").addEventListener("click", () => {
    controller?.abort();
    messages.length = 0;
    log.replaceChildren();
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (controller) {
      controller.abort();
      return;
    }
    const text = input.value.trim();
    if (!text) return;
    input.value = "";
    messages.push({ role: "user", content: text });
    log.append(el("div", text, "chat-user"));
    const reply = el("div", "", "chat-assistant");
    const note = el("div", "", "muted");
    log.append(reply, note);
    controller = new AbortController();
    send.textContent = "Stop";
    let answer = "";
    try {
      await streamChat(
        messages,
        (chunk) => {
          if (chunk.kind === "text") answer += chunk.text;
          else if (chunk.kind === "reasoning") note.textContent += chunk.text;
          else if (chunk.kind === "error") {
            note.textContent = chunk.message;
            note.className = "bad";
          } else if (chunk.finishReason === "length") note.textContent = "(cut at the token limit)";
          reply.textContent = answer;
          log.scrollTop = log.scrollHeight;
        },
        { apiKey: $("chat-key").value.trim() || void 0, signal: controller.signal }
      );
    } catch (err) {
      note.textContent = controller.signal.aborted ? "(stopped)" : String(err);
    } finally {
      if (answer) messages.push({ role: "assistant", content: answer });
      else messages.pop();
      controller = null;
      send.textContent = "Send";
    }
  });
}
async function main() {
  setUpChat();
  const token = readToken() ?? await askForToken("Enter headroom's local token: `headroom token` prints it (and the link that fills it in).");
  start(token);
}
function start(token) {
  const chart = new VramChart($("vram-chart"));
  const stream = new EventStream({ token });
  const control = new ControlClient({ token });
  const debug = { stream, chart, messages: 0 };
  window.__headroom = debug;
  const renderAll = (s) => {
    renderHealth(s);
    renderWorker(s);
    renderVramLegend(s);
    renderPlan(s);
    renderCounters(s);
    renderErrors(s);
  };
  stream.onStatus((info) => {
    renderConnection(info);
    if (info.status === "unauthorized") {
      stream.close();
      void askForToken("The token was refused: enter the right one.").then(() => location.reload());
    }
  });
  stream.onState((s, m) => {
    debug.messages++;
    if (m.type === "snapshot") {
      const sample = memoryView(s.vram).sample;
      if (sample) chart.push(sample);
      renderAll(s);
      return;
    }
    switch (m.type) {
      case "vram": {
        const sample = memoryView(m).sample;
        if (sample) chart.push(sample);
        renderVramLegend(s);
        break;
      }
      case "health":
        renderHealth(s);
        renderWorker(s);
        break;
      case "worker":
      case "engine":
        renderWorker(s);
        break;
      case "plan":
        renderPlan(s);
        break;
      case "counters":
        renderCounters(s);
        break;
      case "request_error":
      case "replan":
        renderErrors(s);
        break;
    }
  });
  setInterval(() => chart.requestDraw(), 1e3);
  const say = (text, bad = false) => {
    const out = $("control-result");
    out.textContent = text;
    out.className = bad ? "bad" : "";
  };
  const act = (button, run) => {
    $(button).addEventListener("click", async () => {
      try {
        const r = await run();
        say(`${r.action}: ${r.message ?? "done"}`);
      } catch (err) {
        say(err instanceof HeadroomApiError ? `${err.status}: ${err.message}` : String(err), true);
      }
    });
  };
  act("restart", () => control.restart());
  act("pause", () => control.pause());
  act("resume", () => control.resume());
  act("clear-cache", () => control.clearPrefixCache());
  act("set-reserve", () => control.setReserve($("reserve").value.trim() || "auto"));
  stream.connect();
}
void main();
