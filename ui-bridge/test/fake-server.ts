// A small stand-in for the service's control plane, speaking the same protocol as
// service/control/socket.py: snapshot on connect, resume by last_seq + epoch from a bounded
// buffer, 4001 for a bad token, bearer-protected control routes.
import { createServer, type IncomingMessage, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { WebSocketServer, type WebSocket } from "ws";
import type { EventMessage, ServerMessage, Snapshot } from "../src/types.js";
import { CLOSE_CODES, SUBPROTOCOL_PREFIX } from "../src/types.js";

type NewEvent = EventMessage extends infer E ? (E extends EventMessage ? Omit<E, "seq" | "ts"> : never) : never;

export interface ControlCall {
  method: string;
  path: string;
  auth: string | undefined;
  body: unknown;
}

export class FakeServer {
  readonly token: string;
  epoch = "epoch-1";
  seq = 0;
  buffer: EventMessage[] = [];
  bufferSize = 64;
  /** Every socket URL a client opened (to check the resume parameters). */
  readonly connectUrls: URL[] = [];
  readonly controlCalls: ControlCall[] = [];
  /** Control paths answered 404, as by a service that does not have them yet. */
  readonly missingRoutes = new Set<string>();
  /** While true, new sockets are refused (the handshake fails). */
  refuse = false;
  private http: Server;
  private wss: WebSocketServer;
  private sockets = new Set<WebSocket>();
  port = 0;

  constructor(token = "tok-0123456789abcdef0123") {
    this.token = token;
    this.http = createServer((req, res) => void this.onHttp(req, res));
    this.wss = new WebSocketServer({
      noServer: true,
      handleProtocols: (protocols) => {
        for (const p of protocols) if (p.startsWith(SUBPROTOCOL_PREFIX)) return p;
        return false;
      },
    });
    this.http.on("upgrade", (req, socket, head) => {
      if (this.refuse) {
        socket.end("HTTP/1.1 503 Service Unavailable\r\n\r\n");
        return;
      }
      this.wss.handleUpgrade(req, socket, head, (ws) => this.onSocket(ws, req));
    });
  }

  async start(): Promise<string> {
    await new Promise<void>((resolve) => this.http.listen(0, "127.0.0.1", resolve));
    this.port = (this.http.address() as AddressInfo).port;
    return this.baseUrl;
  }

  get baseUrl(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  get openSockets(): number {
    return this.sockets.size;
  }

  snapshot(): Snapshot {
    const latest = (type: string) => [...this.buffer].reverse().find((e) => e.type === type) ?? null;
    return {
      type: "snapshot",
      seq: this.seq,
      ts: Date.now() / 1000,
      epoch: this.epoch,
      health: latest("health") as Snapshot["health"],
      worker: latest("worker") as Snapshot["worker"],
      last_exit: ([...this.buffer].reverse().find((e) => e.type === "worker" && e.phase === "exited") ??
        null) as Snapshot["last_exit"],
      engine: latest("engine") as Snapshot["engine"],
      plan: latest("plan") as Snapshot["plan"],
      vram: latest("vram") as Snapshot["vram"],
      counters: latest("counters") as Snapshot["counters"],
      request_errors: this.buffer.filter((e) => e.type === "request_error") as Snapshot["request_errors"],
      replans: this.buffer.filter((e) => e.type === "replan") as Snapshot["replans"],
    };
  }

  publish(event: NewEvent, { send = true }: { send?: boolean } = {}): EventMessage {
    const stamped = { ...event, seq: ++this.seq, ts: Date.now() / 1000 } as EventMessage;
    this.buffer.push(stamped);
    if (this.buffer.length > this.bufferSize) this.buffer.shift();
    if (send) for (const ws of this.sockets) ws.send(JSON.stringify(stamped));
    return stamped;
  }

  /** Send a raw frame to every socket (to fake a broken server). */
  sendRaw(message: ServerMessage): void {
    for (const ws of this.sockets) ws.send(JSON.stringify(message));
  }

  /** Close every socket with `code`. */
  dropAll(code = 1012, reason = "restart"): void {
    for (const ws of this.sockets) ws.close(code, reason);
  }

  /** A new service run: new epoch, seq from 0, empty buffer. */
  restartService(): void {
    this.epoch = `epoch-${Math.random().toString(36).slice(2)}`;
    this.seq = 0;
    this.buffer = [];
    this.dropAll(1001, "going away");
  }

  async stop(): Promise<void> {
    for (const ws of this.sockets) ws.terminate();
    await new Promise<void>((resolve) => this.wss.close(() => resolve()));
    await new Promise<void>((resolve) => this.http.close(() => resolve()));
  }

  private onSocket(ws: WebSocket, req: IncomingMessage): void {
    const url = new URL(req.url ?? "/", this.baseUrl);
    this.connectUrls.push(url);
    const presented = ws.protocol
      ? ws.protocol.slice(SUBPROTOCOL_PREFIX.length)
      : (url.searchParams.get("token") ?? "");
    if (url.pathname !== "/api/events" || presented !== this.token) {
      ws.close(CLOSE_CODES.UNAUTHORIZED, "a valid token is required");
      return;
    }
    this.sockets.add(ws);
    ws.on("close", () => this.sockets.delete(ws));
    const lastSeqText = url.searchParams.get("last_seq");
    const lastSeq = lastSeqText === null ? null : Number(lastSeqText);
    const epoch = url.searchParams.get("epoch");
    const first = this.buffer[0]?.seq ?? this.seq + 1;
    const canResume =
      lastSeq !== null &&
      Number.isInteger(lastSeq) &&
      (epoch === null || epoch === this.epoch) &&
      lastSeq <= this.seq &&
      lastSeq >= first - 1;
    if (canResume) {
      for (const e of this.buffer) if (e.seq > lastSeq) ws.send(JSON.stringify(e));
    } else {
      ws.send(JSON.stringify(this.snapshot()));
    }
  }

  private async onHttp(req: import("node:http").IncomingMessage, res: import("node:http").ServerResponse) {
    const chunks: Buffer[] = [];
    for await (const c of req) chunks.push(c as Buffer);
    const raw = Buffer.concat(chunks).toString();
    const path = new URL(req.url ?? "/", this.baseUrl).pathname;
    const reply = (status: number, body: unknown) => {
      res.writeHead(status, { "content-type": "application/json" });
      res.end(JSON.stringify(body));
    };
    if (req.method === "GET" && path === "/api/status") return reply(200, this.snapshot());
    if (req.method === "POST" && this.missingRoutes.has(path)) {
      return reply(404, { error: { message: `no route ${path}`, type: "not_found_error", param: null, code: null } });
    }
    if (req.method === "POST" && path.startsWith("/api/control/")) {
      const auth = req.headers.authorization;
      this.controlCalls.push({ method: req.method, path, auth, body: raw ? JSON.parse(raw) : null });
      if (auth !== `Bearer ${this.token}`) {
        return reply(401, {
          error: { message: "the local token is required", type: "authentication_error", param: null, code: "invalid_token" },
        });
      }
      return reply(202, { ok: true, action: path.split("/").pop(), message: null });
    }
    reply(404, { error: { message: "no route", type: "not_found_error", param: null, code: null } });
  }
}
