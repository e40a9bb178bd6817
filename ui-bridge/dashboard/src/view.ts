// What the dashboard says about the service's state and its memory: pure functions of
// the events, so they are tested without a browser (test/dashboard.test.ts).
import { formatBytes } from "../../src/format.js";
import type { EngineInfo, HealthEvent, ReplanEvent, VramEvent, WorkerEvent } from "../../src/types.js";
import type { VramSample } from "./chart.js";

/** How a state looks: `tone` picks the badge's colour (a CSS class). */
export type Tone = "ok" | "busy" | "wait" | "paused" | "bad" | "unknown";

export interface HealthView {
  /** The badge's text. */
  label: string;
  tone: Tone;
  /** Why, and when to expect a change (empty when there is nothing to say). */
  detail: string;
}

// The supervisor's states, today's and those of the desktop service (waiting instead of
// exiting, game mode, idle unload). Any other state is shown by its name, never hidden.
const STATES: Record<string, { label: string; tone: Tone }> = {
  ready: { label: "ready", tone: "ok" },
  starting: { label: "starting", tone: "busy" },
  restarting: { label: "restarting", tone: "busy" },
  waiting_for_memory: { label: "waiting for memory", tone: "wait" },
  waiting_for_gpu: { label: "waiting for the GPU", tone: "wait" },
  paused: { label: "paused", tone: "paused" },
  idle: { label: "idle (model unloaded)", tone: "paused" },
  failed: { label: "failed", tone: "bad" },
  stopped: { label: "stopped", tone: "bad" },
};

/** The header's badge and its detail line for the latest `health` event (its `status`
 * may be a state this page does not know: it is shown by name). */
export function healthView(health: Pick<HealthEvent, "reason" | "retry_after_s"> & { status: string } | null): HealthView {
  if (!health) return { label: "unknown", tone: "unknown", detail: "" };
  const known = STATES[health.status];
  const label = known?.label ?? health.status.replace(/_/g, " ");
  const tone = known?.tone ?? "unknown";
  const parts: string[] = [];
  if (health.reason) parts.push(...health.reason.split("; ").filter((p) => !(health.status === "paused" && RESUME_ROUTE.test(p))));
  if (health.status === "paused") parts.push("Resume loads it again");
  else if (health.retry_after_s != null && health.status !== "ready") parts.push(`retry in ~${health.retry_after_s} s`);
  return { label, tone, detail: parts.join("; ") };
}

// A paused service's reason names the control route that resumes it (for curl); the page
// has the Resume button beside it instead.
const RESUME_ROUTE = /\/api\/control\/resume/;

/** The worker's phase for people: its last event's, read with the service's state (a
 * worker whose last event is `started` is ready once the service is, and loading before). */
export function workerPhaseText(phase: string | null | undefined, status: string | null | undefined): string {
  if (!phase) return "–";
  if (phase === "started" && status === "ready") return "ready";
  if (phase === "started" && (status === "starting" || status === "restarting")) return "loading the model";
  return phase;
}

/** The plan panel's line when the engine made no memory plan: on the CPU the pool has
 * its default size (or --kv-cache's), on a GPU --kv-cache or --num-pages fixed it. */
export function noPlanText(info: Pick<EngineInfo, "device" | "num_pages" | "page_size" | "kv_cache_bytes"> | null): string {
  if (!info) return "no memory plan: the KV cache has a set size";
  const pool = `${info.num_pages} pages × ${info.page_size} tokens (${formatBytes(info.kv_cache_bytes)})`;
  if (info.device === "cpu") {
    return `no memory plan on the CPU: the KV pool is ${pool} of the host's RAM, used as it fills (--kv-cache sets its size)`;
  }
  return `no memory plan: the KV pool is set to ${pool} (--kv-cache or --num-pages)`;
}

/** The worker's last exit for people: pid, time, code or signal and why (a restart
 * asked for through the control API says so in its reason). */
export function exitText(exit: WorkerEvent | null, time: (ts: number) => string): string {
  if (!exit) return "none";
  const parts = [`pid ${exit.pid ?? "?"} at ${time(exit.ts)}`];
  if (exit.exit_code != null) parts.push(`exit code ${exit.exit_code}`);
  if (exit.reason) parts.push(exit.reason);
  else if (exit.signal != null) parts.push(`killed by ${exit.signal}`);
  return parts.join("; ");
}

export interface MemoryView {
  /** The panel's heading. */
  title: string;
  /** One line under it: the device, or in CPU mode why there is no GPU (said once). */
  detail: string;
  /** `host`: the bands are the host's RAM (no driver share, no reserve). */
  kind: "gpu" | "host" | "none";
  /** The chart's sample, or null when there is nothing to draw. */
  sample: VramSample | null;
}

/** What the memory panel shows for the latest `vram` event: the GPU's memory, or in CPU
 * mode (`source` `none`) the host's RAM that the event carries (`host`). */
export function memoryView(v: VramEvent | null): MemoryView {
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
        reserve: v.reserve_bytes,
      },
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
      reserve: 0,
    },
  };
}

/** What a replan row says moved: the GPU expert cache's slots, the decoder layers on the
 * CPU (a split's move, with the KV pool it left), else the KV pool's bytes. */
export function replanSizes(r: Pick<ReplanEvent, "before" | "after">): string {
  const { before, after } = r;
  const pool = `${formatBytes(before.kv_pool_bytes)} → ${formatBytes(after.kv_pool_bytes)}`;
  if (after.expert_cache_slots != null && before.expert_cache_slots !== after.expert_cache_slots) {
    return (
      `expert cache ${before.expert_cache_slots} → ${after.expert_cache_slots} slots (` +
      `${formatBytes(before.expert_cache_bytes ?? 0)} → ${formatBytes(after.expert_cache_bytes ?? 0)})`
    );
  }
  if (after.cpu_layers != null && before.cpu_layers !== after.cpu_layers) {
    return `decoder layers on the CPU ${before.cpu_layers ?? 0} → ${after.cpu_layers} (KV ${pool})`;
  }
  return pool;
}
