// A live stacked chart of device memory, drawn on a canvas (no libraries).
import type { VramEvent } from "../../src/types.js";

export interface VramSample {
  /** Unix seconds. */
  t: number;
  total: number;
  free: number;
  ours: number;
  others: number;
  reserve: number;
}

export const SERIES = [
  { key: "ours", label: "ours", color: "#4c8dff" },
  { key: "others", label: "others'", color: "#f0a030" },
  { key: "driver", label: "unattributed", color: "#7d8590" },
  { key: "reserve", label: "reserve (free, kept for the desktop)", color: "#a371f7" },
  { key: "headroom", label: "free (headroom)", color: "#3fb950" },
] as const;

type Band = (typeof SERIES)[number]["key"];

/** The stacked bands of one sample, bottom to top; they add up to `total`. */
export function bands(s: VramSample): Record<Band, number> {
  const ours = Math.max(0, s.ours);
  const others = Math.max(0, s.others);
  const free = Math.max(0, s.free);
  const driver = Math.max(0, s.total - free - ours - others);
  const reserve = Math.min(Math.max(0, s.reserve), free);
  return { ours, others, driver, reserve, headroom: free - reserve };
}

export function sampleOf(e: VramEvent): VramSample {
  return {
    t: e.ts,
    total: e.total_bytes,
    free: e.free_bytes,
    ours: e.ours_bytes,
    others: e.others_bytes,
    reserve: e.reserve_bytes,
  };
}

const GiB = 1 << 30;

export class VramChart {
  readonly samples: VramSample[] = [];
  private scheduled = false;

  constructor(
    private readonly canvas: HTMLCanvasElement,
    /** Seconds of history shown. */
    private readonly windowS = 180,
    private readonly maxSamples = 4000,
  ) {}

  push(sample: VramSample): void {
    const last = this.samples.at(-1);
    if (last && sample.t < last.t) return;
    this.samples.push(sample);
    const cutoff = sample.t - this.windowS * 2;
    while (this.samples.length > this.maxSamples || (this.samples[0] && this.samples[0].t < cutoff)) {
      this.samples.shift();
    }
    this.canvas.dataset.samples = String(this.samples.length);
    this.requestDraw();
  }

  requestDraw(): void {
    if (this.scheduled) return;
    this.scheduled = true;
    requestAnimationFrame(() => {
      this.scheduled = false;
      this.draw();
    });
  }

  draw(now = Date.now() / 1000): void {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const cssW = c.clientWidth || 600;
    const cssH = c.clientHeight || 220;
    if (c.width !== Math.round(cssW * dpr) || c.height !== Math.round(cssH * dpr)) {
      c.width = Math.round(cssW * dpr);
      c.height = Math.round(cssH * dpr);
    }
    const g = c.getContext("2d");
    if (!g) return;
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, cssW, cssH);
    const left = 52;
    const right = cssW - 8;
    const top = 8;
    const bottom = cssH - 20;
    const style = getComputedStyle(c);
    const fg = style.color || "#c9d1d9";

    const total = Math.max(GiB, ...this.samples.map((s) => s.total));
    const y = (bytes: number) => bottom - (bytes / total) * (bottom - top);
    // Up to windowS of history; a young chart spans what it has (at least 30 s).
    const first = this.samples[0]?.t ?? now;
    const span = Math.min(this.windowS, Math.max(30, Math.ceil(now - first)));
    const t0 = now - span;
    const x = (t: number) => left + ((t - t0) / span) * (right - left);

    // Grid: a line every 1, 2, 4... GiB so that there are at most 6.
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = fg;
    g.strokeStyle = "rgba(128,128,128,0.25)";
    g.lineWidth = 1;
    let step = GiB;
    while (total / step > 6) step *= 2;
    for (let b = 0; b <= total + 1; b += step) {
      g.beginPath();
      g.moveTo(left, y(b));
      g.lineTo(right, y(b));
      g.stroke();
      g.fillText(`${Math.round(b / GiB)} GiB`, 4, y(b) + 4);
    }
    g.fillText(`-${span} s`, left, cssH - 4);
    g.fillText("now", right - 22, cssH - 4);

    const visible = this.samples.filter((s, i) => s.t >= t0 || this.samples[i + 1]?.t! >= t0);
    if (visible.length === 0) return;
    // Each band as a step area, drawn from the top band down so lower ones cover it.
    const stacks = visible.map((s) => {
      const b = bands(s);
      let acc = 0;
      const tops: Record<string, number> = {};
      for (const { key } of SERIES) {
        acc += b[key];
        tops[key] = acc;
      }
      return { t: Math.max(s.t, t0), tops };
    });
    for (let i = SERIES.length - 1; i >= 0; i--) {
      const { key, color } = SERIES[i]!;
      g.beginPath();
      g.moveTo(x(stacks[0]!.t), y(0));
      stacks.forEach((s, j) => {
        const next = stacks[j + 1]?.t ?? now;
        g.lineTo(x(s.t), y(s.tops[key]!));
        g.lineTo(x(next), y(s.tops[key]!));
      });
      g.lineTo(x(now), y(0));
      g.closePath();
      g.fillStyle = color;
      g.fill();
    }
  }
}
