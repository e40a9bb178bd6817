import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import { bundleDashboard, OUTFILE } from "../scripts/build-dashboard.mjs";
import { bands } from "../dashboard/src/chart.js";

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
});
