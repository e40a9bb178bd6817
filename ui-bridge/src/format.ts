// Sizes for people: bytes inside, MiB/GiB only at the edge (as in the service).
import type { MemoryPlan } from "./types.js";

const KiB = 1024;
const MiB = 1024 * KiB;
const GiB = 1024 * MiB;

/** `1536 MiB` -> "1.50 GiB"; negative sizes keep their sign. */
export function formatBytes(n: number): string {
  const a = Math.abs(n);
  if (a >= GiB) return `${(n / GiB).toFixed(2)} GiB`;
  if (a >= MiB) return `${Math.round(n / MiB)} MiB`;
  if (a >= KiB) return `${Math.round(n / KiB)} KiB`;
  return `${n} B`;
}

/** The dashboard's one-line summary of a memory plan: pages, context, whether it fits,
 * and, when fit-the-card lowered the context, the plan's note ("context 8,192 -> 3,456
 * tokens: 1.10 GiB held by other processes"). */
export function planSummary(plan: MemoryPlan): string {
  return (
    `${plan.device}: ${plan.num_pages} pages × ${plan.page_size} tokens, max context ${plan.max_context_tokens} tokens` +
    (plan.fits ? "" : ` — does not fit: ${formatBytes(plan.shortfall_bytes)} short`) +
    (plan.context_note ? ` — ${plan.context_note}` : "") +
    (plan.requests_note ? ` — ${plan.max_running_requests} running requests, ${plan.requests_note}` : "")
  );
}
