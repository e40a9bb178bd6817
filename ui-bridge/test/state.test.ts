import { describe, expect, it } from "vitest";
import { applyMessage, emptyState, type HeadroomState } from "../src/state.js";
import type { RequestErrorEvent, Snapshot } from "../src/types.js";

const snapshot: Snapshot = { ...emptyState(), type: "snapshot", seq: 10, ts: 1, epoch: "e" };

const requestError = (seq: number): RequestErrorEvent => ({
  type: "request_error",
  seq,
  ts: seq,
  request_id: `r${seq}`,
  code: "out_of_memory",
  message: "m",
  action: "failed",
  phase: "prefill",
  bytes_asked: null,
  headroom_bytes: null,
});

describe("applyMessage", () => {
  it("starts from a snapshot, applies the next seq, flags duplicates and gaps", () => {
    let state: HeadroomState = applyMessage(emptyState(), snapshot).state;
    expect(state.seq).toBe(10);
    const step = applyMessage(state, requestError(11));
    expect(step.gap).toBe(false);
    state = step.state;
    expect(state.request_errors.map((e) => e.request_id)).toEqual(["r11"]);
    expect(applyMessage(state, requestError(11)).duplicate).toBe(true);
    expect(applyMessage(state, requestError(13)).gap).toBe(true);
  });

  it("keeps only the newest request errors", () => {
    let state = applyMessage(emptyState(), snapshot).state;
    for (let seq = 11; seq < 20; seq++) state = applyMessage(state, requestError(seq), { keepRequestErrors: 3 }).state;
    expect(state.request_errors.map((e) => e.seq)).toEqual([17, 18, 19]);
  });

  it("never mutates the state it is given", () => {
    const before = applyMessage(emptyState(), snapshot).state;
    const frozen = JSON.stringify(before);
    applyMessage(before, requestError(11));
    expect(JSON.stringify(before)).toBe(frozen);
  });
});
