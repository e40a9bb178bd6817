// The UI's view of the service: a snapshot, then every event applied in `seq` order.
import type { EventMessage, ServerMessage, Snapshot } from "./types.js";

/** Everything the dashboard shows: the fields of a `Snapshot` (what each holds), with
 * `epoch` null before the first snapshot; `seq` is the last event applied,
 * `request_errors` and `replans` keep the newest (`ApplyOptions`), newest last. */
export interface HeadroomState extends Omit<Snapshot, "type" | "ts" | "epoch"> {
  epoch: string | null;
}

export interface ApplyOptions {
  keepRequestErrors?: number;
  keepReplans?: number;
}

/** What applying one message did. `gap`: an event skipped ahead of `seq + 1` (some were
 * lost: start over from a snapshot); `duplicate`: it was already applied (ignored). */
export interface ApplyResult {
  state: HeadroomState;
  gap: boolean;
  duplicate: boolean;
}

export function emptyState(): HeadroomState {
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
    replans: [],
  };
}

export function stateFromSnapshot(snapshot: Snapshot): HeadroomState {
  const { type: _type, ts: _ts, ...fields } = snapshot;
  return { ...fields, request_errors: [...fields.request_errors], replans: [...fields.replans] };
}

const keepLast = <T>(items: T[], item: T, keep: number): T[] => {
  const out = [...items, item];
  return out.length > keep ? out.slice(out.length - keep) : out;
};

/** The state after `message` (a new object; `state` is not changed). */
export function applyMessage(
  state: HeadroomState,
  message: ServerMessage,
  options: ApplyOptions = {},
): ApplyResult {
  if (message.type === "snapshot") {
    return { state: stateFromSnapshot(message), gap: false, duplicate: false };
  }
  if (state.epoch !== null && message.seq <= state.seq) {
    return { state, gap: false, duplicate: true };
  }
  const gap = state.epoch !== null && message.seq > state.seq + 1;
  const next: HeadroomState = { ...state, seq: message.seq };
  const event: EventMessage = message;
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
      const unknown: never = event;
      void unknown; // a type this client does not know yet: only its seq counts
    }
  }
  return { state: next, gap, duplicate: false };
}
