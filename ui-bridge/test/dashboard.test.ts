import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { bundleDashboard, OUTFILE } from "../scripts/build-dashboard.mjs";
import { bands } from "../dashboard/src/chart.js";
import { planSummary } from "../src/format.js";
import type { MemoryPlan } from "../src/types.js";

const GiB = 1 << 30;

describe("dashboard", () => {
  it("app.js is the bundle of dashboard/src (run `npm run build:dashboard`)", async () => {
    expect(readFileSync(OUTFILE, "utf8")).toBe(await bundleDashboard());
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

  it("the plan's summary carries the note when fit-the-card lowered the context", () => {
    const plan: MemoryPlan = {
      device: "NVIDIA RTX 4060", simulated: false, ledger: [], budget_bytes: 7 * GiB, fixed_bytes: 5 * GiB,
      kv_pool_bytes: GiB, num_pages: 216, page_size: 16, max_context_tokens: 3456, min_context_tokens: 2048,
      fits: true, shortfall_bytes: 0, suggestions: [], max_prefill_tokens: 2048, max_running_requests: 8,
      wanted_context_tokens: 8192, context_note: "context 8,192 -> 3,456 tokens: 1.10 GiB held by other processes",
    };
    expect(planSummary(plan)).toBe(
      "NVIDIA RTX 4060: 216 pages × 16 tokens, max context 3456 tokens — context 8,192 -> 3,456 tokens: 1.10 GiB held by other processes",
    );
    expect(planSummary({ ...plan, max_context_tokens: 8192, context_note: "" })).toBe(
      "NVIDIA RTX 4060: 216 pages × 16 tokens, max context 8192 tokens",
    );
  });
});
