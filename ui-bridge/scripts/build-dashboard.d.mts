export const ENTRY: string;
export const OUTFILE: string;
export function bundleDashboard(): Promise<string>;
