// The client of headroom's control plane: the /api/events stream and the control calls.
import { applyMessage, emptyState, type HeadroomState } from "./state.js";
import {
  CLOSE_CODES,
  SUBPROTOCOL_PREFIX,
  type ControlResponse,
  type EventOf,
  type EventType,
  type ServerMessage,
  type Snapshot,
} from "./types.js";

// -- WebSocket, the parts we use (the browser's, or `ws` in Node) ---------------------------

export interface WebSocketLike {
  readonly readyState: number;
  readonly protocol: string;
  onopen: ((ev: unknown) => void) | null;
  onmessage: ((ev: { data: unknown }) => void) | null;
  onclose: ((ev: { code: number; reason: string }) => void) | null;
  onerror: ((ev: unknown) => void) | null;
  close(code?: number, reason?: string): void;
}

export type WebSocketCtor = new (url: string, protocols?: string | string[]) => WebSocketLike;

export interface BackoffOptions {
  /** First retry after about this long (ms). */
  initialMs: number;
  /** Never wait longer than this (ms). */
  maxMs: number;
  /** Each failed attempt multiplies the wait by this. */
  factor: number;
  /** Up to this share of each wait is taken off at random (0: none), so many clients
   * do not reconnect in lockstep. */
  jitter: number;
}

export const DEFAULT_BACKOFF: BackoffOptions = { initialMs: 250, maxMs: 10_000, factor: 2, jitter: 0.3 };

/** The wait before reconnect attempt `attempt` (0-based), in ms. */
export function backoffDelay(attempt: number, b: BackoffOptions, random: () => number = Math.random): number {
  const base = Math.min(b.maxMs, b.initialMs * b.factor ** Math.max(0, attempt));
  return Math.round(base * (1 - b.jitter * random()));
}

function defaultBaseUrl(): string {
  const loc = (globalThis as { location?: { origin?: string } }).location;
  if (loc?.origin && loc.origin !== "null") return loc.origin;
  throw new Error("no baseUrl given and no page origin to default to");
}

function wsUrl(baseUrl: string, path: string): URL {
  const url = new URL(path, baseUrl);
  url.protocol = url.protocol === "https:" ? "wss:" : url.protocol === "http:" ? "ws:" : url.protocol;
  return url;
}

// -- the event stream -----------------------------------------------------------------------

export type ConnectionStatus =
  | "idle" // not started
  | "connecting" // first attempt or a retry under way
  | "open" // receiving
  | "waiting" // waiting to retry (see `retryInMs`)
  | "unauthorized" // the token was refused (close 4001): no more retries
  | "closed"; // close() was called

export interface StatusInfo {
  status: ConnectionStatus;
  /** The last close code seen, if any. */
  code?: number;
  reason?: string;
  /** Set while `waiting`. */
  retryInMs?: number;
  /** Consecutive attempts that did not deliver a message. */
  attempts: number;
}

export interface EventStreamOptions {
  /** The service, e.g. `http://127.0.0.1:8427`; default: the page's origin. */
  baseUrl?: string;
  /** The local token. */
  token: string;
  /** How the token travels: a subprotocol (default; kept out of URLs and logs) or `?token=`. */
  tokenVia?: "subprotocol" | "query";
  /** The WebSocket class; default the global one (browsers, Node >= 22). */
  WebSocket?: WebSocketCtor;
  backoff?: Partial<BackoffOptions>;
  /** Resume by `last_seq` after a reconnect (default true). */
  resume?: boolean;
  /** Path of the socket (default `/api/events`). */
  path?: string;
  /** A connection open this long (ms) counts as good even if no event came (a resume
   * with nothing missed): the backoff starts over after it. Default 2000. */
  stableMs?: number;
  keepRequestErrors?: number;
  keepReplans?: number;
}

type Listener<T> = (value: T) => void;

/**
 * A live view of the service. Connects to `/api/events`, starts from the snapshot, applies
 * every event in order, and reconnects with exponential backoff, resuming from the last
 * `seq` (the server sends the missed events, or a fresh snapshot when they are gone).
 *
 * ```ts
 * const stream = new EventStream({ token });
 * stream.on("vram", (e) => chart.push(e));
 * stream.onState((s) => render(s));
 * stream.connect();
 * ```
 */
export class EventStream {
  private readonly opts: Required<Omit<EventStreamOptions, "backoff" | "baseUrl" | "WebSocket">> & {
    baseUrl: string;
    WebSocket: WebSocketCtor;
    backoff: BackoffOptions;
  };
  private socket: WebSocketLike | null = null;
  private timer: ReturnType<typeof setTimeout> | null = null;
  private readonly listeners = new Map<string, Set<Listener<never>>>();
  private _state: HeadroomState = emptyState();
  private _status: StatusInfo = { status: "idle", attempts: 0 };
  /** Messages received on the current connection. */
  private received = 0;
  private openedAt = 0;
  private forceSnapshot = false;

  constructor(options: EventStreamOptions) {
    const WS = options.WebSocket ?? (globalThis as { WebSocket?: WebSocketCtor }).WebSocket;
    if (!WS) throw new Error("no WebSocket implementation: pass options.WebSocket (e.g. from 'ws')");
    this.opts = {
      baseUrl: options.baseUrl ?? defaultBaseUrl(),
      token: options.token,
      tokenVia: options.tokenVia ?? "subprotocol",
      WebSocket: WS,
      backoff: { ...DEFAULT_BACKOFF, ...options.backoff },
      resume: options.resume ?? true,
      path: options.path ?? "/api/events",
      stableMs: options.stableMs ?? 2000,
      keepRequestErrors: options.keepRequestErrors ?? 50,
      keepReplans: options.keepReplans ?? 20,
    };
  }

  /** The current view (replaced, never mutated, on each message). */
  get state(): HeadroomState {
    return this._state;
  }

  get status(): StatusInfo {
    return this._status;
  }

  /** The last `seq` applied (null before the first snapshot). */
  get lastSeq(): number | null {
    return this._state.epoch === null ? null : this._state.seq;
  }

  /** Start (or restart after close()). */
  connect(): void {
    if (this.socket || this.timer) return;
    this.open();
  }

  /** Stop for good: no more reconnects. */
  close(): void {
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
  on<K extends EventType>(type: K, fn: Listener<EventOf<K>>): () => void {
    return this.listen(type, fn);
  }

  /** Each snapshot (on connect, or when a resume was not possible). */
  onSnapshot(fn: Listener<Snapshot>): () => void {
    return this.listen("snapshot", fn);
  }

  /** The state after every message. */
  onState(fn: (state: HeadroomState, message: ServerMessage) => void): () => void {
    return this.listen("$state", ({ state, message }: { state: HeadroomState; message: ServerMessage }) =>
      fn(state, message),
    );
  }

  /** Connection status changes. */
  onStatus(fn: Listener<StatusInfo>): () => void {
    return this.listen("$status", fn);
  }

  // -- internals ----------------------------------------------------------------------

  private listen<T>(key: string, fn: Listener<T>): () => void {
    let set = this.listeners.get(key);
    if (!set) this.listeners.set(key, (set = new Set()));
    set.add(fn as Listener<never>);
    return () => set!.delete(fn as Listener<never>);
  }

  private emit(key: string, value: unknown): void {
    for (const fn of this.listeners.get(key) ?? []) {
      try {
        (fn as Listener<unknown>)(value);
      } catch (err) {
        console.error("headroom: a listener failed", err);
      }
    }
  }

  private setStatus(info: StatusInfo): void {
    this._status = info;
    this.emit("$status", info);
  }

  private url(): { url: string; protocols: string[] } {
    const url = wsUrl(this.opts.baseUrl, this.opts.path);
    const protocols: string[] = [];
    if (this.opts.tokenVia === "query") url.searchParams.set("token", this.opts.token);
    else protocols.push(SUBPROTOCOL_PREFIX + this.opts.token);
    const last = this.lastSeq;
    if (this.opts.resume && !this.forceSnapshot && last !== null && this._state.epoch) {
      url.searchParams.set("last_seq", String(last));
      url.searchParams.set("epoch", this._state.epoch);
    }
    return { url: url.toString(), protocols };
  }

  private open(): void {
    this.clearTimer();
    const { url, protocols } = this.url();
    this.forceSnapshot = false;
    this.received = 0;
    this.openedAt = 0;
    this.setStatus({ status: "connecting", attempts: this._status.attempts });
    let socket: WebSocketLike;
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
      /* onclose follows */
    };
    socket.onclose = (ev) => {
      if (this.socket !== socket) return;
      this.socket = null;
      this.detach(socket);
      const stable =
        this.received > 0 || (this.openedAt > 0 && Date.now() - this.openedAt >= this.opts.stableMs);
      const attempts = stable ? 0 : this._status.attempts;
      if (ev.code === CLOSE_CODES.UNAUTHORIZED) {
        this.setStatus({ status: "unauthorized", code: ev.code, reason: ev.reason, attempts });
        return;
      }
      this._status = { ...this._status, attempts };
      this.scheduleRetry(ev.code, ev.reason);
    };
  }

  private detach(socket: WebSocketLike): void {
    socket.onopen = socket.onmessage = socket.onclose = null;
    // Node's `ws` reports closing a socket that is still connecting as an error event;
    // with no listener it would be an unhandled error. A browser's does not.
    socket.onerror = () => {};
  }

  private handle(socket: WebSocketLike, data: unknown): void {
    let message: ServerMessage;
    try {
      const text = typeof data === "string" ? data : new TextDecoder().decode(data as ArrayBuffer);
      message = JSON.parse(text) as ServerMessage;
    } catch {
      return; // not ours
    }
    if (this.received++ === 0 && this._status.attempts !== 0) {
      this.setStatus({ status: "open", attempts: 0 }); // it delivers: the backoff starts over
    }
    const { state, gap, duplicate } = applyMessage(this._state, message, {
      keepRequestErrors: this.opts.keepRequestErrors,
      keepReplans: this.opts.keepReplans,
    });
    if (gap) {
      // Events were lost (should not happen on one connection): start over from a snapshot.
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

  private scheduleRetry(code: number, reason: string): void {
    // Every close but 4001 is retried (4008, dropped for reading too slowly, included:
    // the resume fetches what the dropped queue held).
    const attempts = this._status.attempts;
    const delay = backoffDelay(attempts, this.opts.backoff);
    this.setStatus({ status: "waiting", code, reason, retryInMs: delay, attempts: attempts + 1 });
    this.timer = setTimeout(() => {
      this.timer = null;
      this.open();
    }, delay);
  }

  private clearTimer(): void {
    if (this.timer !== null) {
      clearTimeout(this.timer);
      this.timer = null;
    }
  }
}

// -- control calls ------------------------------------------------------------------------

/** An error answer of the service: `{"error": {message, type, param, code}}`. */
export class HeadroomApiError extends Error {
  constructor(
    readonly status: number,
    message: string,
    readonly type: string | null = null,
    readonly code: string | null = null,
    readonly param: string | null = null,
  ) {
    super(message);
    this.name = "HeadroomApiError";
  }
}

export interface ControlClientOptions {
  /** The service, e.g. `http://127.0.0.1:8427`; default: the page's origin. */
  baseUrl?: string;
  token: string;
  fetch?: typeof fetch;
}

/** The HTTP control routes, with the token as `Authorization: Bearer`. */
export class ControlClient {
  private readonly baseUrl: string;
  private readonly token: string;
  private readonly fetchFn: typeof fetch;

  constructor(options: ControlClientOptions) {
    this.baseUrl = options.baseUrl ?? defaultBaseUrl();
    this.token = options.token;
    this.fetchFn = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  /** `GET /api/status`: the snapshot. */
  status(): Promise<Snapshot> {
    return this.call<Snapshot>("GET", "/api/status");
  }

  /** Restart the engine worker (also from `failed`). */
  restart(): Promise<ControlResponse> {
    return this.call("POST", "/api/control/restart");
  }

  /** Stop the worker and give all its memory back (game mode) until `resume()`. A
   * service without the route answers 404, thrown as a `HeadroomApiError`. */
  pause(): Promise<ControlResponse> {
    return this.call("POST", "/api/control/pause");
  }

  /** Start the worker again after `pause()`. */
  resume(): Promise<ControlResponse> {
    return this.call("POST", "/api/control/resume");
  }

  /** Keep `reserve` free for the desktop: bytes, a size such as `"1.5GiB"`, or `"auto"`. */
  setReserve(reserve: number | string): Promise<ControlResponse> {
    return this.call("POST", "/api/control/reserve", { reserve });
  }

  /** Resize the KV pool: bytes, a size such as `"6GiB"`, or null for the plan's size. */
  setKvCache(kvCache: number | string | null): Promise<ControlResponse> {
    return this.call("POST", "/api/control/cache", { kv_cache: kvCache });
  }

  /** Resize the GPU expert cache (routed experts in host memory, `--cpu-experts`): bytes
   * (whole slots), a size such as `"1GiB"`, or null for the plan's size. */
  setExpertCache(expertCache: number | string | null): Promise<ControlResponse> {
    return this.call("POST", "/api/control/cache", { expert_cache: expertCache });
  }

  /** Evict the prefix cache's unused pages. */
  clearPrefixCache(): Promise<ControlResponse> {
    return this.call("POST", "/api/control/cache", { clear_prefix_cache: true });
  }

  private async call<T>(method: string, path: string, body?: unknown): Promise<T> {
    const headers: Record<string, string> = { Authorization: `Bearer ${this.token}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await this.fetchFn(new URL(path, this.baseUrl).toString(), {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await response.text();
    let parsed: unknown = null;
    try {
      parsed = text ? JSON.parse(text) : null;
    } catch {
      /* not JSON */
    }
    if (!response.ok) {
      const error = (parsed as { error?: { message?: string; type?: string; code?: string; param?: string } } | null)
        ?.error;
      throw new HeadroomApiError(
        response.status,
        error?.message ?? `HTTP ${response.status}: ${text.slice(0, 200)}`,
        error?.type ?? null,
        error?.code ?? null,
        error?.param ?? null,
      );
    }
    return parsed as T;
  }
}
