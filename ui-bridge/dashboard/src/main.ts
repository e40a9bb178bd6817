// The dashboard served at /ui: health, worker, a live VRAM chart, the plan ledger,
// counters and recent request errors, from /api/events on the page's own origin.
import { ControlClient, EventStream, HeadroomApiError, type StatusInfo } from "../../src/client.js";
import { formatBytes, planSummary } from "../../src/format.js";
import type { HeadroomState } from "../../src/state.js";
import type { ServerMessage } from "../../src/types.js";
import { bands, SERIES, VramChart } from "./chart.js";
import { type ChatMessage, streamChat } from "./chat.js";
import { exitText, healthView, memoryView, noPlanText, replanSizes, workerPhaseText } from "./view.js";

const TOKEN_KEY = "headroom.token";

function $(id: string): HTMLElement {
  const el = document.getElementById(id);
  if (!el) throw new Error(`#${id} is missing from the page`);
  return el;
}

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  text?: string | number | null,
  className?: string,
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function row(cells: (string | number | null)[], className?: string): HTMLTableRowElement {
  const tr = el("tr", undefined, className);
  for (const c of cells) tr.append(el("td", c ?? "–"));
  return tr;
}

const time = (ts: number) => new Date(ts * 1000).toLocaleTimeString();

/**
 * The token from the address's fragment (`#token=...`, as `headroom token` prints it: a
 * fragment is never sent to the server), then removed from the address bar and from the
 * history entry; else this tab's storage; else null (the page then asks with its form).
 * An old-style `?token=` is read and removed the same way.
 */
function readToken(): string | null {
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

/** Ask for the token with the page's form (not a blocking prompt): resolves with what
 * was entered, kept in this tab's storage. */
function askForToken(note: string): Promise<string> {
  const form = $("token-form") as HTMLFormElement;
  const input = $("token-input") as HTMLInputElement;
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

function renderHealth(s: HeadroomState): void {
  // A string, not the schema's union: a newer service may send states this page predates.
  const status: string = s.health?.status ?? "unknown";
  const view = healthView(s.health);
  const badge = $("health");
  badge.textContent = view.label;
  badge.className = `badge ${view.tone}`;
  document.body.dataset.health = status;
  $("model").textContent = s.health?.model ?? "–";
  $("health-reason").textContent = view.detail;
  $("pause").hidden = status === "paused" || status === "idle";
  $("resume").hidden = !($("pause").hidden);
}

function renderWorker(s: HeadroomState): void {
  const w = s.worker;
  document.body.dataset.worker = w?.phase ?? "unknown";
  $("worker-phase").textContent = workerPhaseText(w?.phase, s.health?.status);
  $("worker-pid").textContent = w?.pid != null ? String(w.pid) : s.health?.worker_pid != null ? String(s.health.worker_pid) : "–";
  $("worker-restarts").textContent = String(s.health?.restarts ?? w?.restarts ?? 0);
  const parts: string[] = [];
  if (w?.phase === "restarting" && w.delay_s != null) parts.push(`next try in ${w.delay_s.toFixed(1)} s`);
  if (w?.phase === "failed" && w.reason) parts.push(w.reason);
  $("worker-detail").textContent = parts.join("; ");
  const x = s.last_exit;
  $("worker-exit").textContent = exitText(x, time);
  $("worker-lines").textContent = (x?.last_lines ?? []).join("\n");
  $("worker-when").textContent = w ? time(w.ts) : "";
  const info = s.engine?.info;
  $("engine").textContent = info
    ? `${info.architecture} on ${info.device} (${info.dtype}); context ${info.max_context_tokens} tokens ` +
      `(model ${info.model_context_tokens}); KV ${info.num_pages} pages × ${info.page_size} = ${formatBytes(info.kv_cache_bytes)}; ` +
      `weights ${formatBytes(info.weight_bytes)}`
    : "–";
}

// In host mode there is no unattributed driver share and no reserve, and the free band
// is what the host has available.
const HOST_LABELS: Partial<Record<string, string>> = { headroom: "available" };

function renderVramLegend(s: HeadroomState): void {
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
    const item = el("span", undefined, "legend-item");
    const swatch = el("i", undefined, "swatch");
    swatch.style.background = color;
    const name = view.kind === "host" ? (HOST_LABELS[key] ?? label) : label;
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

function renderPlan(s: HeadroomState): void {
  const plan = s.plan?.plan ?? null;
  const body = $("plan-ledger");
  body.replaceChildren();
  $("plan-summary").textContent = !s.plan
    ? "no plan yet"
    : !plan
      ? noPlanText(s.engine?.info ?? null)
      : planSummary(plan);
  if (!plan) return;
  for (const e of plan.ledger) {
    body.append(row([e.sign === "+" ? "" : e.sign, e.name, formatBytes(e.bytes), e.source], e.sign === "=" ? "subtotal" : undefined));
  }
  const sugg = $("plan-suggestions");
  sugg.replaceChildren(
    ...plan.suggestions.map((x) => el("li", `${x.flag} ${x.current} → ${x.proposed} frees ${formatBytes(x.saves_bytes)}`)),
  );
}

function renderCounters(s: HeadroomState): void {
  const c = s.counters;
  const e = c?.engine;
  const items: [string, string | number][] = [
    ["in flight", c?.in_flight ?? 0],
    ["running", e?.running ?? "–"],
    ["waiting", e?.waiting ?? "–"],
    ["KV pages free", e ? `${e.free_pages} / ${e.total_pages}` : "–"],
    ["prefix-cached pages", e?.cached_pages ?? "–"],
    ["finished", e?.finished ?? "–"],
    ["failed", e?.failed ?? "–"],
    ["OOM steps (rolled back)", c?.oom_steps ?? 0],
    ["requests failed by OOM", c?.oom_failed_requests ?? 0],
    ["replans", c?.replans ?? 0],
  ];
  $("counters").replaceChildren(...items.map(([k, v]) => {
    const d = el("div", undefined, "counter");
    d.append(el("span", k, "k"), el("span", v, "v"));
    return d;
  }));
}

function renderErrors(s: HeadroomState): void {
  const rows = [...s.request_errors].reverse().map((e) =>
    row([
      time(e.ts),
      e.request_id,
      e.phase,
      e.code,
      e.action,
      e.bytes_asked != null ? formatBytes(e.bytes_asked) : null,
      e.headroom_bytes != null ? formatBytes(e.headroom_bytes) : null,
      e.message,
    ]),
  );
  $("errors").replaceChildren(...rows);
  $("errors-empty").hidden = rows.length > 0;
  const replans = [...s.replans].reverse().map((r) =>
    row([
      time(r.ts),
      r.action,
      replanSizes(r),
      `${r.before.max_prefill_tokens} → ${r.after.max_prefill_tokens}`,
      r.duration_s != null ? `${(r.duration_s * 1000).toFixed(0)} ms` : null,
      r.reason,
    ]),
  );
  $("replans").replaceChildren(...replans);
  $("replans-empty").hidden = replans.length > 0;
}

function renderConnection(info: StatusInfo): void {
  const text =
    info.status === "waiting"
      ? `reconnecting in ${((info.retryInMs ?? 0) / 1000).toFixed(1)} s (attempt ${info.attempts})`
      : info.status === "unauthorized"
        ? "the token was refused: reload and enter the right one"
        : info.status;
  $("connection").textContent = text;
  document.body.dataset.connection = info.status;
  if (info.status === "unauthorized") sessionStorage.removeItem(TOKEN_KEY);
}

/** The chat panel: the conversation stays in the page; each turn streams into the log. */
function setUpChat(): void {
  const messages: ChatMessage[] = [];
  const form = $("chat-form") as HTMLFormElement;
  const input = $("chat-input") as HTMLTextAreaElement;
  const log = $("chat-log");
  const send = $("chat-send") as HTMLButtonElement;
  let controller: AbortController | null = null;
  $("chat-clear").addEventListener("click", () => {
    controller?.abort();
    messages.length = 0;
    log.replaceChildren();
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault(); // Enter sends, Shift+Enter breaks the line
      form.requestSubmit();
    }
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    if (controller) {
      controller.abort(); // the button reads "Stop" while a reply streams
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
        { apiKey: ($("chat-key") as HTMLInputElement).value.trim() || undefined, signal: controller.signal },
      );
    } catch (err) {
      note.textContent = controller.signal.aborted ? "(stopped)" : String(err);
    } finally {
      if (answer) messages.push({ role: "assistant", content: answer });
      else messages.pop(); // a failed turn is not part of the conversation
      controller = null;
      send.textContent = "Send";
    }
  });
}

async function main(): Promise<void> {
  setUpChat();
  const token =
    readToken() ??
    (await askForToken("Enter headroom's local token: `headroom token` prints it (and the link that fills it in)."));
  start(token);
}

function start(token: string): void {
  const chart = new VramChart($("vram-chart") as HTMLCanvasElement);
  const stream = new EventStream({ token });
  const control = new ControlClient({ token });
  const debug = { stream, chart, messages: 0 };
  (window as unknown as { __headroom: typeof debug }).__headroom = debug;

  const renderAll = (s: HeadroomState) => {
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
  stream.onState((s: HeadroomState, m: ServerMessage) => {
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
        renderWorker(s);
        break;
      case "engine":
        renderWorker(s);
        renderPlan(s); // without a plan, its line reads the engine's pool
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
  setInterval(() => chart.requestDraw(), 1000); // time moves even when memory does not

  const say = (text: string, bad = false) => {
    const out = $("control-result");
    out.textContent = text;
    out.className = bad ? "bad" : "";
  };
  const act = (button: string, run: () => Promise<{ message: string | null; action: string }>) => {
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
  // The service answers 404 where it has no game mode yet; the error is shown.
  act("pause", () => control.pause());
  act("resume", () => control.resume());
  act("clear-cache", () => control.clearPrefixCache());
  act("set-reserve", () => control.setReserve(( $("reserve") as HTMLInputElement).value.trim() || "auto"));
  stream.connect();
}

void main();
