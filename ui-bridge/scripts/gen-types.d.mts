export const SCHEMA_PATH: string;
export const TYPES_PATH: string;
/** The TypeScript source for `schema` (the parsed JSON Schema document). */
export function generate(schema: unknown): string;
