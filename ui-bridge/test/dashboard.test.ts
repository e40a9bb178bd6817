import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { bundleDashboard } from "../scripts/build-dashboard.mjs";
import { bands } from "../dashboard/src/chart.js";
import { planSummary } from "../src/format.js";
import { type ChatChunk, parseSse, streamChat } from "../dashboard/src/chat.js";
import {
  exitText,
  healthView,
  memoryView,
  noPlanText,
  replanSizes,
  workerPhaseText,
} from "../dashboard/src/view.js";
import type { MemoryPlan, VramEvent, WorkerEvent } from "../src/types.js";

const GiB = 1 << 30;

describe("dashboard", () => {
  it("dashboard/src bundles into app.js, the same text every time", async () => {
    const bundle = await bundleDashboard();
    expect(bundle).toMatch(/^\/\/ Built from dashboard\/src by scripts\/build-dashboard\.mjs: do not edit\.\n/);
    expect(bundle).toContain("new EventStream(");
    expect(bundle).not.toMatch(/^\s*import\b/m); // one file: the client is inside it
    expect(await bundleDashboard()).toBe(bundle);
  });

  it("index.html loads app.js by a relative URL and nothing from elsewhere", () => {
    const html = readFileSync(new URL("../dashboard/index.html", import.meta.url), "utf8");
    expect(html).toContain('<script type="module" src="./app.js"></script>');
    expect(html).not.toMatch(/(src|href)="(https?:)?\/\//);
  });

  it("stacks the chart's bands to the device total, reserve inside free", () => {
    const b = bands({ t: 0, total: 16 * GiB, free: 3 * GiB, ours: 6 * GiB, others: 6 * GiB, reserve: 1 * GiB });
    expect(b).toEqual({ ours: 6 * GiB, others: 6 * GiB, driver: GiB, reserve: GiB, headroom: 2 * GiB });
    const short = bands({ t: 0, total: 16 * GiB, free: GiB / 2, ours: 8 * GiB, others: 7.5 * GiB, reserve: GiB });
    expect(short.reserve).toBe(GiB / 2);
    expect(short.headroom).toBe(0);
  });

  it("the plan's summary carries the notes when fit-the-card lowered the context or the running requests", () => {
    const plan: MemoryPlan = {
      device: "NVIDIA RTX 4060", simulated: false, ledger: [], budget_bytes: 7 * GiB, fixed_bytes: 5 * GiB,
      kv_pool_bytes: GiB, num_pages: 216, kv_ring_pages: 0, page_size: 16, max_context_tokens: 3456, min_context_tokens: 2048,
      fits: true, shortfall_bytes: 0, suggestions: [], max_prefill_tokens: 2048, max_running_requests: 8,
      wanted_context_tokens: 8192, context_note: "context 8,192 -> 3,456 tokens: 1.10 GiB held by other processes",
      kv_cache_dtype: "bfloat16", kv_bytes_per_token: 114688, cpu_expert_layers: 0, expert_cache_slots: 0,
      expert_slot_bytes: 0,
      tensor_parallel_size: 1,
      kv_heads: 3,
      cpu_layers: 0,
      split_note: "",
      state_bytes_per_request: 0,
      requests_note: "",
    };
    expect(planSummary(plan)).toBe(
      "NVIDIA RTX 4060: 216 pages × 16 tokens, max context 3456 tokens — context 8,192 -> 3,456 tokens: 1.10 GiB held by other processes",
    );
    expect(planSummary({ ...plan, max_context_tokens: 8192, context_note: "" })).toBe(
      "NVIDIA RTX 4060: 216 pages × 16 tokens, max context 8192 tokens",
    );
    const note = "not 64: the linear-attention states take at most 1/8 of the budget; --max-running-requests N sets the number";
    expect(planSummary({ ...plan, max_context_tokens: 8192, context_note: "", requests_note: note })).toBe(
      `NVIDIA RTX 4060: 216 pages × 16 tokens, max context 8192 tokens — 8 running requests, ${note}`,
    );
  });
});

const vram = (over: Partial<VramEvent>): VramEvent => ({
  type: "vram",
  seq: 1,
  ts: 100,
  device: "no GPU",
  source: "none",
  total_bytes: 0,
  free_bytes: 0,
  ours_bytes: 0,
  others_bytes: 0,
  reserve_bytes: 0,
  headroom_bytes: 0,
  top_consumers: [],
  reason: "no GPU, CPU mode: NVML is not available; no NVIDIA driver or GPU",
  device_limit_bytes: null,
  memory_rule: null,
  host: null,
  gpus: [],
  ...over,
});

describe("dashboard: states", () => {
  it("shows the desktop service's states with their reason, and any unknown one by name", () => {
    const h = (status: string, reason: string | null = null, retry: number | null = null) =>
      healthView({ status, reason, retry_after_s: retry });
    expect(h("ready")).toEqual({ label: "ready", tone: "ok", detail: "" });
    const waiting = h("waiting_for_memory", "needs 2.1 GiB, 0.9 GiB free; firefox holds 3 GiB", 5);
    expect(waiting.label).toBe("waiting for memory");
    expect(waiting.tone).toBe("wait");
    expect(waiting.detail).toBe("needs 2.1 GiB, 0.9 GiB free; firefox holds 3 GiB; retry in ~5 s");
    expect(h("waiting_for_gpu", "CUDA failed to initialise (error 999)")).toMatchObject({ label: "waiting for the GPU", tone: "wait" });
    expect(h("paused", "paused through the control API")).toMatchObject({
      label: "paused", tone: "paused", detail: "paused through the control API; Resume loads it again",
    });
    expect(h("idle")).toMatchObject({ label: "idle (model unloaded)", tone: "paused" });
    expect(h("failed", "crash loop")).toMatchObject({ tone: "bad", detail: "crash loop" });
    expect(h("defragmenting_moon")).toEqual({ label: "defragmenting moon", tone: "unknown", detail: "" });
    expect(healthView(null).tone).toBe("unknown");
  });

  it("says who asked for a restart, and a crash as a crash", () => {
    const t = () => "12:00";
    const exit = (reason: string | null): WorkerEvent => ({
      type: "worker", seq: 3, ts: 1, phase: "exited", pid: 42, exit_code: null, signal: "SIGKILL",
      reason, delay_s: null, restarts: 0, last_lines: [],
    });
    expect(exitText(exit("was killed by SIGKILL: restart requested by the control API"), t)).toBe(
      "pid 42 at 12:00; was killed by SIGKILL: restart requested by the control API",
    );
    expect(exitText(exit(null), t)).toBe("pid 42 at 12:00; killed by SIGKILL");
    expect(exitText(null, t)).toBe("none");
  });
});

describe("dashboard: what a new user read wrong", () => {
  it("says ready, not started, once the worker serves", () => {
    expect(workerPhaseText("started", "ready")).toBe("ready");
    expect(workerPhaseText("started", "starting")).toBe("loading the model");
    expect(workerPhaseText("started", "restarting")).toBe("loading the model");
    expect(workerPhaseText("exited", "restarting")).toBe("exited");
    expect(workerPhaseText(null, "ready")).toBe("–");
  });

  it("names the Resume button, not the control route, beside it", () => {
    const paused = healthView({
      status: "paused", reason: "paused through the control API; POST /api/control/resume resumes it", retry_after_s: 60,
    });
    expect(paused.detail).toBe("paused through the control API; Resume loads it again");
    expect(paused.detail).not.toContain("/api/control");
    // Other states keep every word of their reason.
    expect(healthView({ status: "failed", reason: "see POST /api/control/resume; x", retry_after_s: null }).detail)
      .toBe("see POST /api/control/resume; x");
  });

  it("says what a replan moved: the expert cache, the layers on the CPU, else the KV pool", () => {
    const MiB = 1 << 20;
    const point = { kv_pool_bytes: 512 * MiB, num_pages: 100, max_prefill_tokens: 256, prefix_cache_pages: null,
      expert_cache_slots: null, expert_cache_bytes: null, cpu_layers: null };
    const moved = { before: { ...point, cpu_layers: 0 }, after: { ...point, kv_pool_bytes: 384 * MiB, cpu_layers: 8 } };
    expect(replanSizes(moved)).toBe("decoder layers on the CPU 0 → 8 (KV 512 MiB → 384 MiB)");
    expect(replanSizes({ before: point, after: { ...point, kv_pool_bytes: 256 * MiB } })).toBe("512 MiB → 256 MiB");
    const slots = { before: { ...point, expert_cache_slots: 48, expert_cache_bytes: 384 * MiB },
      after: { ...point, expert_cache_slots: 10, expert_cache_bytes: 80 * MiB } };
    expect(replanSizes(slots)).toBe("expert cache 48 → 10 slots (384 MiB → 80 MiB)");
  });

  it("counts the KV pool's pages one way, and does not call the CPU's pool fixed", () => {
    // engine.info.num_pages is usable pages, as the counters' total_pages and the plan's.
    const info = { device: "cpu", num_pages: 1455, page_size: 16, kv_cache_bytes: GiB };
    const cpu = noPlanText(info);
    expect(cpu).toContain("1455 pages × 16 tokens");
    expect(cpu).toContain("CPU");
    expect(cpu).not.toMatch(/fixed/);
    expect(noPlanText({ ...info, device: "cuda:0" })).toContain("--kv-cache or --num-pages");
    expect(noPlanText(null)).not.toMatch(/fixed/);
  });
});

describe("dashboard: memory panel", () => {
  it("shows the host's RAM in CPU mode and says why there is no GPU once", () => {
    const view = memoryView(vram({ host: { total_bytes: 16 * GiB, available_bytes: 10 * GiB, ours_bytes: 2 * GiB } }));
    expect(view.title).toBe("Host memory");
    expect(view.kind).toBe("host");
    expect(view.detail.match(/CPU mode/g)).toHaveLength(1);
    expect(view.detail).not.toMatch(/no GPU.*no GPU: CPU/);
    expect(view.sample).toEqual({ t: 100, total: 16 * GiB, free: 10 * GiB, ours: 2 * GiB, others: 4 * GiB, reserve: 0 });
    expect(bands(view.sample!)).toEqual({ ours: 2 * GiB, others: 4 * GiB, driver: 0, reserve: 0, headroom: 10 * GiB });
  });

  it("draws nothing in CPU mode until the host's memory comes, and the GPU's otherwise", () => {
    expect(memoryView(vram({}))).toMatchObject({ kind: "none", sample: null, title: "Memory" });
    expect(memoryView(null).sample).toBeNull();
    const gpu = memoryView(vram({ source: "nvml", device: "RTX 4060", total_bytes: 8 * GiB, free_bytes: 3 * GiB, ours_bytes: 4 * GiB, others_bytes: GiB, reserve_bytes: GiB, reason: null }));
    expect(gpu).toMatchObject({ title: "VRAM", kind: "gpu", detail: "RTX 4060 (nvml)" });
    expect(gpu.sample).toMatchObject({ total: 8 * GiB, free: 3 * GiB, reserve: GiB });
  });
});

const sse = (...events: unknown[]) => events.map((e) => `data: ${typeof e === "string" ? e : JSON.stringify(e)}\n\n`).join("");
const delta = (content: string, finish: string | null = null) => ({ choices: [{ index: 0, delta: { content }, finish_reason: finish }] });

describe("dashboard: chat", () => {
  it("parses OpenAI's stream, keeping an event cut in the middle for the next read", () => {
    const text = sse(delta("Hel"), delta("lo"), delta("", "stop"), "[DONE]");
    const cut = text.length - 10;
    const first = parseSse(text.slice(0, cut));
    expect(first.chunks).toEqual([
      { kind: "text", text: "Hel" },
      { kind: "text", text: "lo" },
      { kind: "done", finishReason: "stop" },
    ]);
    const second = parseSse(first.rest + text.slice(cut));
    expect(second).toEqual({ chunks: [{ kind: "done", finishReason: null }], rest: "" });
    expect(parseSse(sse({ error: { message: "the engine is restarting; retry the request" } })).chunks).toEqual([
      { kind: "error", message: "the engine is restarting; retry the request" },
    ]);
    expect(parseSse(sse({ choices: [{ delta: { reasoning_content: "hmm" } }] })).chunks).toEqual([{ kind: "reasoning", text: "hmm" }]);
  });

  it("streams a turn with fetch and reports HTTP errors as an error chunk", async () => {
    const calls: { url: string; init: RequestInit }[] = [];
    const body = sse(delta("Hi"), delta("!", "stop"), "[DONE]");
    const ok: typeof fetch = async (url, init) => {
      calls.push({ url: String(url), init: init ?? {} });
      return new Response(new Blob([body]).stream(), { status: 200, headers: { "content-type": "text/event-stream" } });
    };
    const got: ChatChunk[] = [];
    await streamChat([{ role: "user", content: "hello" }], (c) => got.push(c), { fetch: ok, apiKey: "k" });
    expect(got.filter((c) => c.kind === "text").map((c) => (c as { text: string }).text).join("")).toBe("Hi!");
    expect(got.at(-1)).toEqual({ kind: "done", finishReason: null });
    expect(calls[0]!.url).toBe("/v1/chat/completions");
    expect(JSON.parse(String(calls[0]!.init.body))).toEqual({
      model: "default", messages: [{ role: "user", content: "hello" }], stream: true, max_tokens: 512,
    });
    expect((calls[0]!.init.headers as Record<string, string>).Authorization).toBe("Bearer k");

    const refused: typeof fetch = async () =>
      new Response(JSON.stringify({ error: { message: "Invalid API key", type: "authentication_error", param: null, code: "invalid_api_key" } }), { status: 401 });
    const errors: ChatChunk[] = [];
    await streamChat([{ role: "user", content: "x" }], (c) => errors.push(c), { fetch: refused });
    expect(errors).toHaveLength(1);
    expect(errors[0]).toMatchObject({ kind: "error" });
    expect((errors[0] as { message: string }).message).toMatch(/^401: Invalid API key .*--api-key/);

    const cut: typeof fetch = async () => new Response(new Blob([sse(delta("par"))]).stream(), { status: 200 });
    const partial: ChatChunk[] = [];
    await streamChat([{ role: "user", content: "x" }], (c) => partial.push(c), { fetch: cut });
    expect(partial.at(-1)).toEqual({ kind: "error", message: "the stream ended before [DONE]" });
  });
});

describe("dashboard: page", () => {
  const html = readFileSync(new URL("../dashboard/index.html", import.meta.url), "utf8");
  it("asks for the token with a form in the page, never a blocking prompt", async () => {
    expect(html).toMatch(/<form id="token-form"[^>]*>/);
    expect(html).toContain('id="token-input" type="password"');
    expect(await bundleDashboard()).not.toMatch(/\bprompt\(/);
  });

  it("has pause and resume, and a chat panel", () => {
    for (const id of ["pause", "resume", "chat-form", "chat-input", "chat-log", "chat-send"]) expect(html).toContain(`id="${id}"`);
  });
});
