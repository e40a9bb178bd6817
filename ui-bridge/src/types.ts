// Generated from schema/events.schema.json by scripts/gen-types.mjs: do not edit.
// Regenerate with `npm run gen` after `python -m service.events.export_schema`.

/**
 * Body of `POST /api/control/cache`. `kv_cache`: the KV pool's size (bytes or
 * text such as `"6GiB"`; null: back to the plan's size; absent: unchanged).
 * `clear_prefix_cache`: true evicts every prefix-cache page no running request holds
 * (done last, after any size change: a refused size leaves the cache as it was; false,
 * the default, leaves it).
 * `expert_cache`: the GPU expert cache's size, for routed experts in host memory
 * (`--cpu-experts`; bytes or text, whole slots; null: the plan's size; absent:
 * unchanged); done before `kv_cache`. `cpu_layers`: the last decoder layers the
 * CPU runs (`--cpu-layers auto` and a model that can split; null: the start's split;
 * absent: unchanged); done first.
 */
export interface CacheRequest {
  kv_cache?: number | string | null;
  expert_cache?: number | string | null;
  cpu_layers?: number | null;
  clear_prefix_cache?: boolean;
}

/**
 * A process holding device memory: `pid`, process `name`, `bytes`.
 */
export interface Consumer {
  pid: number;
  name: string;
  bytes: number;
}

/**
 * What a control route answers: `action` done (`restart`, `pause`,
 * `resume`, `reserve`, `cache`), and the target's `message`.
 */
export interface ControlResponse {
  ok: boolean;
  action: string;
  message: string | null;
}

/**
 * Counters: the engine's (`engine`, null when no worker answers) and the
 * service's: sequences in flight, out-of-memory steps (each rolled back), requests
 * they failed, replans.
 */
export interface CountersEvent {
  type: "counters";
  seq: number;
  ts: number;
  engine: EngineStats | null;
  in_flight: number;
  oom_steps: number;
  oom_failed_requests: number;
  replans: number;
}

/**
 * Facts about a loaded engine, sent once in the worker's readiness message.
 *
 * `max_context_tokens` is what one request can really use: the smaller of the model's
 * context length and what the KV pool holds for one request. Sizes are in bytes.
 * `num_pages` is the KV pool's usable pages (its null page apart,
 * :func:`engine.memory.kv_fit.usable_pages`), as the plan, the engine's counters
 * (`total_pages`), replan events, the control API and the log count them;
 * `kv_cache_bytes` their bytes, as the plan's `kv_pool_bytes` counts them (a
 * sliding-window ring pool apart). `kv_buffer_bytes` is every buffer the KV cache
 * holds: the KV pool's null page and a sliding-window ring pool (with its own null
 * page) included.
 */
export interface EngineInfo {
  model_name: string;
  model_dir: string;
  architecture: string;
  vocab_size: number;
  max_context_tokens: number;
  model_context_tokens: number;
  eos_token_ids: number[];
  device: string;
  dtype: string;
  page_size: number;
  num_pages: number;
  kv_cache_bytes: number;
  weight_bytes: number;
  max_prefill_tokens: number;
  max_running_requests: number;
  plan: MemoryPlan | null;
  kv_cache_dtype: string;
  kv_bytes_per_token: number;
  kv_buffer_bytes: number;
  parameter_count: number;
  weight_format: string;
}

/**
 * Facts about the engine a worker loaded (model, device, dtype, context, KV pages),
 * sent when a worker becomes ready. Publish it with `info.plan` set to None: the
 * plan travels in `plan` events.
 */
export interface EngineInfoEvent {
  type: "engine";
  seq: number;
  ts: number;
  info: EngineInfo;
}

/**
 * Engine counters at one instant.
 */
export interface EngineStats {
  running: number;
  waiting: number;
  free_pages: number;
  total_pages: number;
  cached_pages: number;
  prefix_hit_tokens: number;
  prefix_lookup_tokens: number;
  finished: number;
  aborted: number;
  failed: number;
  expert_cache_hits: number;
  expert_cache_misses: number;
  expert_copies: number;
  expert_cpu_runs: number;
  expert_bus_reads: number;
  expert_cache_slots: number;
}

/**
 * One GPU's memory, in bytes, as in :class:`VramEvent`: `rank` is the
 * tensor-parallel rank whose device it is (0 for a single GPU), the other fields mean
 * what :class:`VramEvent`'s of the same names mean, for this card.
 */
export interface GpuMemory {
  rank: number;
  device: string;
  total_bytes: number;
  free_bytes: number;
  ours_bytes: number;
  others_bytes: number;
  reserve_bytes: number;
  headroom_bytes: number;
  device_limit_bytes: number | null;
}

/**
 * The service's readiness, as `/api/health` reports it.
 *
 * `status`: `ready` only while a worker serves. `reason` says why for
 * `failed`, `waiting_for_memory`, `waiting_for_gpu` (with what helps),
 * `paused` and `idle`; `retry_after_s` is the expected wait (whole seconds)
 * while starting, restarting, waiting, paused or idle. `memory` is set in
 * `waiting_for_memory`. `model` is the served model's name once one was loaded.
 */
export interface HealthEvent {
  type: "health";
  seq: number;
  ts: number;
  status: "failed" | "idle" | "paused" | "ready" | "restarting" | "starting" | "stopped" | "waiting_for_gpu" | "waiting_for_memory";
  model: string | null;
  reason: string | null;
  retry_after_s: number | null;
  worker_pid: number | null;
  restarts: number;
  memory: MemoryNeed | null;
}

/**
 * The host's RAM, in bytes: `total_bytes`, `available_bytes` (what new
 * allocations can take without swapping) and `ours_bytes` (the resident set of this
 * service's processes).
 */
export interface HostMemory {
  total_bytes: number;
  available_bytes: number;
  ours_bytes: number;
}

/**
 * One line of the ledger: `sign` is `+` for what the device offers, `-` for
 * what is taken from it, `=` for a subtotal.
 */
export interface LedgerEntry {
  name: string;
  bytes: number;
  sign: string;
  source: string;
}

/**
 * What `waiting_for_memory` waits for, in bytes: `needed_bytes` free on the card
 * for the plan to fit, `free_bytes` now, `short_bytes` the difference, the largest
 * other consumers now, and `waiting_s` seconds waited so far.
 */
export interface MemoryNeed {
  needed_bytes: number;
  free_bytes: number;
  short_bytes: number;
  top_consumers: Consumer[];
  waiting_s: number;
}

/**
 * The ledger and what it gives. Sizes in bytes, contexts in tokens.
 *
 * `wanted_context_tokens` is the context asked for (the model's, capped by
 * `--max-model-len`); `max_context_tokens` what one request gets (lower when the
 * pool cannot hold the wanted one); `context_note` says why it is lower ("" when it
 * is not). `kv_bytes_per_token` is what one token of context costs in the KV cache
 * (all layers, keys and values) in its storage dtype `kv_cache_dtype`.
 */
export interface MemoryPlan {
  device: string;
  simulated: boolean;
  ledger: LedgerEntry[];
  budget_bytes: number;
  fixed_bytes: number;
  kv_pool_bytes: number;
  num_pages: number;
  kv_ring_pages: number;
  page_size: number;
  max_context_tokens: number;
  min_context_tokens: number;
  fits: boolean;
  shortfall_bytes: number;
  suggestions: Suggestion[];
  max_prefill_tokens: number;
  max_running_requests: number;
  wanted_context_tokens: number;
  context_note: string;
  kv_cache_dtype: string;
  kv_bytes_per_token: number;
  cpu_expert_layers: number;
  expert_cache_slots: number;
  expert_slot_bytes: number;
  tensor_parallel_size: number;
  kv_heads: number;
  cpu_layers: number;
  split_note: string;
  state_bytes_per_request: number;
  requests_note: string;
}

/**
 * The worker's memory plan (the ledger of every byte); `plan` is null when the
 * KV cache size was fixed by a flag and no plan was made.
 */
export interface PlanEvent {
  type: "plan";
  seq: number;
  ts: number;
  plan: MemoryPlan | null;
}

/**
 * The sizes a replan moves: the KV pool (bytes and usable pages), the prefill
 * chunk cap (tokens), the prefix cache's pages (None when unknown) and the GPU expert
 * cache in front of routed experts in host memory (slots over all its layers and
 * their bytes; None when every expert is on the device); the last decoder layers the
 * CPU runs (`--cpu-layers`; on every event of an engine whose split can move or is
 * split; None for one whose layers all stay on the device throughout).
 */
export interface PlanPoint {
  kv_pool_bytes: number;
  num_pages: number;
  max_prefill_tokens: number;
  prefix_cache_pages: number | null;
  expert_cache_slots: number | null;
  expert_cache_bytes: number | null;
  cpu_layers: number | null;
}

/**
 * The plan changed while serving. `action` names the step (e.g.
 * `lower_chunk_cap`, `evict_prefix_cache`, `shrink_expert_cache`,
 * `grow_expert_cache`, `shrink_kv`, `grow_kv`, `set_kv_cache`,
 * `set_expert_cache`, `move_layers_to_cpu`, `move_layers_to_device`,
 * `set_cpu_layers`); `reason`
 * says why for people; `duration_s` how long it took.
 */
export interface ReplanEvent {
  type: "replan";
  seq: number;
  ts: number;
  action: string;
  reason: string;
  before: PlanPoint;
  after: PlanPoint;
  duration_s: number | null;
}

/**
 * A request hit an error inside the engine (the engine stayed up).
 *
 * `code` e.g. `out_of_memory`; `phase` where (`prefill`, `decode`,
 * `sample`); `action` what was done (`failed`, `retry_smaller_chunk`,
 * `preempted`, `retry`); `bytes_asked` the failed allocation's size and
 * `headroom_bytes` the device's headroom at the time, when known.
 */
export interface RequestErrorEvent {
  type: "request_error";
  seq: number;
  ts: number;
  request_id: string;
  code: string;
  message: string;
  action: string;
  phase: string | null;
  bytes_asked: number | null;
  headroom_bytes: number | null;
}

/**
 * Body of `POST /api/control/reserve`: `reserve` is `"auto"`, a number of
 * bytes, or a size as text (`"1.5GiB"`, `"512MiB"`).
 */
export interface ReserveRequest {
  reserve: number | string;
}

/**
 * Everything the UI shows, at `seq` (the last event it includes; the next event
 * has `seq + 1`). `epoch` names this hub (a new one per service start): resume
 * only with the epoch the `seq` came from. Each field holds the latest event of its
 * kind (null before the first), `last_exit` the latest `worker` event of phase
 * `exited` (code, signal, reason survive the restart); `request_errors` and
 * `replans` the newest ones, oldest first. This is also the body of
 * `GET /api/status`.
 */
export interface Snapshot {
  type: "snapshot";
  seq: number;
  ts: number;
  epoch: string;
  health: HealthEvent | null;
  worker: WorkerEvent | null;
  last_exit: WorkerEvent | null;
  engine: EngineInfoEvent | null;
  plan: PlanEvent | null;
  vram: VramEvent | null;
  counters: CountersEvent | null;
  request_errors: RequestErrorEvent[];
  replans: ReplanEvent[];
}

/**
 * A setting that would make the plan fit (or fit better): `flag` from `current`
 * to `proposed` frees `saves_bytes`.
 */
export interface Suggestion {
  flag: string;
  current: string;
  proposed: string;
  saves_bytes: number;
  price: string;
}

/**
 * The device's memory now, in bytes.
 *
 * `gpus` lists every GPU the worker runs on, one entry per tensor-parallel rank's
 * device in rank order (one entry for a single GPU; empty in CPU mode). The other
 * fields are those of the *tightest* GPU: the one with the least headroom, which sizes
 * the group's KV pool and which the replans follow (with one GPU, that GPU).
 *
 * `ours_bytes` is held by this service's processes, `others_bytes` by everyone
 * else; `free_bytes` is what the device has free; `reserve_bytes` is kept for the
 * desktop; `headroom_bytes = free_bytes - reserve_bytes` (negative when the desktop
 * is already short). `source` is `nvml`, `simulated`, or `none` (no GPU: CPU
 * mode, all sizes 0, `reason` says why). `top_consumers` lists the largest other
 * processes.
 *
 * `device_limit_bytes` is `--device-limit` where it is smaller than the card, and
 * `memory_rule` says for people which rule reads the card (the same one the memory
 * plan used at start): a card of the limit's size, against which other processes'
 * memory counts, or the whole card.
 */
export interface VramEvent {
  type: "vram";
  seq: number;
  ts: number;
  device: string;
  source: "none" | "nvml" | "simulated";
  total_bytes: number;
  free_bytes: number;
  ours_bytes: number;
  others_bytes: number;
  reserve_bytes: number;
  headroom_bytes: number;
  top_consumers: Consumer[];
  reason: string | null;
  device_limit_bytes: number | null;
  memory_rule: string | null;
  host: HostMemory | null;
  gpus: GpuMemory[];
}

/**
 * A change in the engine worker process's life.
 *
 * `started`: spawned, `pid` set. `exited`: ended; `exit_code` (None when
 * killed by a signal), `signal` (its name, e.g. `"SIGKILL"`, or None), `reason`
 * (e.g. `"was killed by SIGKILL"`) and its `last_lines` of output. `restarting`: a new worker follows in `delay_s`
 * seconds. `failed`: no more restarts (`reason` says why) until one is asked for.
 * `restarts` counts the restarts after a crash or a hang since the service started
 * (a restart asked for through the control API is not counted).
 */
export interface WorkerEvent {
  type: "worker";
  seq: number;
  ts: number;
  phase: "exited" | "failed" | "restarting" | "started";
  pid: number | null;
  exit_code: number | null;
  signal: string | null;
  reason: string | null;
  delay_s: number | null;
  restarts: number;
  last_lines: string[];
}

/** One text frame of the /api/events WebSocket. */
export type ServerMessage =
  | Snapshot
  | HealthEvent
  | WorkerEvent
  | EngineInfoEvent
  | VramEvent
  | PlanEvent
  | ReplanEvent
  | RequestErrorEvent
  | CountersEvent;

/** Every event (a frame that is not the snapshot). */
export type EventMessage = Exclude<ServerMessage, Snapshot>;

/** The `type` of an event. */
export type EventType = EventMessage["type"];

/** The event of a given `type`. */
export type EventOf<T extends EventType> = Extract<EventMessage, { type: T }>;

export const EVENT_TYPES = ["health","worker","engine","vram","plan","replan","request_error","counters"] as const;

/** WebSocket close codes of /api/events. */
export const CLOSE_CODES = {
  NORMAL: 1000,
  GOING_AWAY: 1001,
  UNAUTHORIZED: 4001,
  ORIGIN_REFUSED: 4003,
  TOO_SLOW: 4008,
} as const;

/** A browser sends its token as the subprotocol `${SUBPROTOCOL_PREFIX}<token>`. */
export const SUBPROTOCOL_PREFIX = "headroom.token.";
