// Sizes for people: bytes inside, MiB/GiB only at the edge (as in the service).
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
