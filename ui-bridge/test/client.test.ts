import { afterEach, beforeEach, describe, expect, it } from "vitest";
import WebSocket from "ws";
import {
  backoffDelay,
  ControlClient,
  EventStream,
  HeadroomApiError,
  type StatusInfo,
  type WebSocketCtor,
} from "../src/client.js";
import type { HealthEvent, VramEvent } from "../src/types.js";
import { FakeServer } from "./fake-server.js";

const GiB = 1 << 30;
const WS = WebSocket as unknown as WebSocketCtor;
const fastBackoff = { initialMs: 20, maxMs: 160, factor: 2, jitter: 0 };

function vram(free: number): Omit<VramEvent, "seq" | "ts"> {
  return {
    type: "vram",
    device: "sim",
    source: "simulated",
    total_bytes: 16 * GiB,
    free_bytes: free,
    ours_bytes: 2 * GiB,
    others_bytes: 14 * GiB - free,
    reserve_bytes: GiB,
    headroom_bytes: free - GiB,
    top_consumers: [],
    reason: null,
    device_limit_bytes: null,
    memory_rule: null,
    host: null,
    gpus: [],
  };
}

const health = (status: HealthEvent["status"]): Omit<HealthEvent, "seq" | "ts"> => ({
  type: "health",
  status,
  model: "m",
  reason: null,
  retry_after_s: null,
  worker_pid: 1,
  restarts: 0,
  memory: null,
});

async function until(predicate: () => boolean, timeoutMs = 5000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!predicate()) {
    if (Date.now() > end) throw new Error("timed out");
    await new Promise((r) => setTimeout(r, 5));
  }
}

let server: FakeServer;
let streams: EventStream[] = [];

function stream(opts: Partial<ConstructorParameters<typeof EventStream>[0]> = {}): EventStream {
  const s = new EventStream({ baseUrl: server.baseUrl, token: server.token, WebSocket: WS, backoff: fastBackoff, ...opts });
  streams.push(s);
  return s;
}

/** `s` connected, then dropped by a server that refuses it from then on: `waits` collects
 * the retry delays `s` announces. */
async function droppedAndRefused(s: EventStream): Promise<{ s: EventStream; waits: number[] }> {
  const waits: number[] = [];
  s.onStatus((info: StatusInfo) => {
    if (info.status === "waiting") waits.push(info.retryInMs!);
  });
  s.connect();
  await until(() => server.openSockets === 1);
  server.refuse = true;
  server.dropAll();
  return { s, waits };
}

beforeEach(async () => {
  server = new FakeServer();
  await server.start();
});

afterEach(async () => {
  for (const s of streams) s.close();
  streams = [];
  await server.stop();
});

describe("EventStream", () => {
  it("starts from the snapshot and applies typed events in order", async () => {
    server.publish(health("starting"));
    const s = stream();
    const vrams: VramEvent[] = [];
    s.on("vram", (e) => vrams.push(e)); // e is typed VramEvent
    const snapshots: number[] = [];
    s.onSnapshot((snap) => snapshots.push(snap.seq));
    s.connect();
    await until(() => s.state.epoch !== null);
    expect(snapshots).toEqual([1]);
    expect(s.state.health?.status).toBe("starting");
    expect(s.status.status).toBe("open");
    await until(() => server.openSockets === 1);
    server.publish(health("ready"));
    server.publish(vram(8 * GiB));
    server.publish(vram(7 * GiB));
    await until(() => s.state.seq === 4);
    expect(s.state.health?.status).toBe("ready");
    expect(vrams.map((v) => v.free_bytes)).toEqual([8 * GiB, 7 * GiB]);
    expect(s.state.vram?.free_bytes).toBe(7 * GiB);
    // The token went as a subprotocol, not in the URL.
    expect(server.connectUrls[0]!.searchParams.get("token")).toBeNull();
  });

  it("reconnects and resumes by last seq, getting the missed events in order", async () => {
    const s = stream();
    const seen: number[] = [];
    s.onState((_, m) => seen.push(m.seq));
    s.connect();
    await until(() => server.openSockets === 1 && s.state.epoch !== null);
    server.publish(health("ready"));
    await until(() => s.state.seq === 1);
    server.dropAll(1012, "restart");
    // Published while it is away: buffered on the server.
    for (let i = 0; i < 5; i++) server.publish(vram((8 - i) * GiB), { send: false });
    await until(() => s.state.seq === 6);
    const resumeUrl = server.connectUrls[1]!;
    expect(resumeUrl.searchParams.get("last_seq")).toBe("1");
    expect(resumeUrl.searchParams.get("epoch")).toBe(server.epoch);
    expect(seen).toEqual([0, 1, 2, 3, 4, 5, 6]); // snapshot 0, then every seq once, no second snapshot
    expect(s.state.vram?.free_bytes).toBe(4 * GiB);
  });

  it("takes a fresh snapshot when the service restarted (another epoch)", async () => {
    const s = stream();
    s.connect();
    server.publish(health("ready"));
    await until(() => s.state.seq === 1 && s.state.health !== null);
    server.restartService();
    server.publish(health("starting"), { send: false });
    await until(() => s.state.epoch === server.epoch);
    expect(s.state.seq).toBe(1);
    expect(s.state.health?.status).toBe("starting");
  });

  it("backs off exponentially while the service is away, then starts over", async () => {
    const { s, waits } = await droppedAndRefused(stream());
    await until(() => waits.length >= 5, 8000);
    expect(waits.slice(0, 5)).toEqual([20, 40, 80, 160, 160]);
    server.refuse = false;
    await until(() => s.status.status === "open", 8000);
    await until(() => server.openSockets === 1);
    server.publish(health("ready")); // it delivers: the next retry starts from the beginning
    await until(() => s.state.seq === 1 && s.status.attempts === 0);
    server.dropAll();
    await until(() => waits.length >= 6 && s.status.status === "open");
    expect(waits.at(-1)).toBe(20); // reset after a connection delivered
  });

  it("a connection open for stableMs resets the backoff even without events", async () => {
    const { waits } = await droppedAndRefused(stream({ stableMs: 100 }));
    await until(() => waits.length >= 3);
    server.refuse = false;
    await until(() => server.openSockets === 1, 8000); // resumed, nothing missed: no message
    await new Promise((r) => setTimeout(r, 150));
    const before = waits.length;
    server.dropAll();
    await until(() => waits.length > before);
    expect(waits.at(-1)).toBe(20);
  });

  it("stops retrying when the token is refused (4001)", async () => {
    const s = stream({ token: "wrong-token-xxxxxxxxxxxx" });
    s.connect();
    await until(() => s.status.status === "unauthorized");
    expect(s.status.code).toBe(4001);
    await new Promise((r) => setTimeout(r, 100));
    expect(server.connectUrls.length).toBe(1);
  });

  it("can send the token as a query parameter", async () => {
    const s = stream({ tokenVia: "query" });
    s.connect();
    await until(() => s.state.epoch !== null);
    expect(server.connectUrls[0]!.searchParams.get("token")).toBe(server.token);
  });

  it("reconnects for a snapshot when it sees a gap in seq", async () => {
    const s = stream();
    s.connect();
    await until(() => server.openSockets === 1 && s.state.epoch !== null);
    server.publish(health("ready"));
    await until(() => s.state.seq === 1);
    server.publish(vram(GiB), { send: false }); // lost in transit
    server.publish(vram(2 * GiB)); // arrives: seq 3 after 1
    await until(() => s.state.seq === 3 && server.connectUrls.length === 2);
    expect(server.connectUrls[1]!.searchParams.get("last_seq")).toBeNull(); // a snapshot, not a resume
    expect(s.state.vram?.free_bytes).toBe(2 * GiB);
  });

  it("close() stops it for good", async () => {
    const s = stream();
    s.connect();
    await until(() => server.openSockets === 1);
    s.close();
    await until(() => server.openSockets === 0);
    await new Promise((r) => setTimeout(r, 100));
    expect(server.connectUrls.length).toBe(1);
    expect(s.status.status).toBe("closed");
  });
});

describe("backoffDelay", () => {
  it("grows by the factor up to the cap, with jitter taken off", () => {
    const b = { initialMs: 250, maxMs: 10_000, factor: 2, jitter: 0.5 };
    expect([0, 1, 2, 3, 10].map((a) => backoffDelay(a, b, () => 0))).toEqual([250, 500, 1000, 2000, 10000]);
    expect(backoffDelay(2, b, () => 1)).toBe(500);
  });
});

describe("ControlClient", () => {
  it("sends the bearer token and typed bodies", async () => {
    const c = new ControlClient({ baseUrl: server.baseUrl, token: server.token });
    expect((await c.restart()).action).toBe("restart");
    await c.setReserve("auto");
    await c.setKvCache("6GiB");
    await c.setKvCache(null);
    await c.clearPrefixCache();
    expect(server.controlCalls.map((x) => [x.path, x.body])).toEqual([
      ["/api/control/restart", null],
      ["/api/control/reserve", { reserve: "auto" }],
      ["/api/control/cache", { kv_cache: "6GiB" }],
      ["/api/control/cache", { kv_cache: null }],
      ["/api/control/cache", { clear_prefix_cache: true }],
    ]);
    expect(new Set(server.controlCalls.map((x) => x.auth))).toEqual(new Set([`Bearer ${server.token}`]));
    server.publish(health("ready"));
    const snap = await c.status();
    expect(snap.type).toBe("snapshot");
    expect(snap.health?.status).toBe("ready");
  });

  it("pauses and resumes with the token, and a service without the routes is a 404 error", async () => {
    const c = new ControlClient({ baseUrl: server.baseUrl, token: server.token });
    expect((await c.pause()).action).toBe("pause");
    expect((await c.resume()).action).toBe("resume");
    expect(server.controlCalls.map((x) => [x.path, x.auth])).toEqual([
      ["/api/control/pause", `Bearer ${server.token}`],
      ["/api/control/resume", `Bearer ${server.token}`],
    ]);
    server.missingRoutes.add("/api/control/pause");
    const err = await c.pause().catch((e: unknown) => e);
    expect(err).toBeInstanceOf(HeadroomApiError);
    expect((err as HeadroomApiError).status).toBe(404);
    expect((err as HeadroomApiError).message).toContain("/api/control/pause");
  });

  it("throws HeadroomApiError with the service's error fields", async () => {
    const c = new ControlClient({ baseUrl: server.baseUrl, token: "wrong" });
    const err = await c.restart().catch((e: unknown) => e);
    expect(err).toBeInstanceOf(HeadroomApiError);
    expect((err as HeadroomApiError).status).toBe(401);
    expect((err as HeadroomApiError).code).toBe("invalid_token");
  });
});
