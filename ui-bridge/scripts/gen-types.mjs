// Generates src/types.ts from schema/events.schema.json (which the service exports with
// `python -m service.events.export_schema`). Run: `npm run gen`. No dependencies, deterministic:
// test/types.test.ts regenerates in memory and fails when src/types.ts differs.
import { readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
export const SCHEMA_PATH = join(here, "..", "schema", "events.schema.json");
export const TYPES_PATH = join(here, "..", "src", "types.ts");

const refName = (ref) => ref.slice(ref.lastIndexOf("/") + 1);

function tsType(s) {
  if (s.$ref) return refName(s.$ref);
  if (s.anyOf) return [...new Set(s.anyOf.map(tsType))].join(" | ");
  if (s.enum) return s.enum.map((v) => JSON.stringify(v)).join(" | ");
  switch (s.type) {
    case "integer":
    case "number":
      return "number";
    case "string":
    case "boolean":
    case "null":
      return s.type;
    case "array": {
      const item = s.items ? tsType(s.items) : "unknown";
      return item.includes(" | ") ? `Array<${item}>` : `${item}[]`;
    }
    case "object":
      return "Record<string, unknown>";
    default:
      return "unknown";
  }
}

function doc(text, indent = "") {
  if (!text) return "";
  const lines = text.replace(/``/g, "`").split("\n");
  return `${indent}/**\n${lines.map((l) => `${indent} *${l ? " " + l : ""}`).join("\n")}\n${indent} */\n`;
}

/** The TypeScript source for `schema` (the parsed JSON Schema document). */
export function generate(schema) {
  const out = [
    "// Generated from schema/events.schema.json by scripts/gen-types.mjs: do not edit.",
    "// Regenerate with `npm run gen` after `python -m service.events.export_schema`.",
    "",
  ];
  for (const [name, def] of Object.entries(schema.$defs)) {
    const required = new Set(def.required ?? []);
    out.push(doc(def.description) + `export interface ${name} {`);
    for (const [prop, ps] of Object.entries(def.properties ?? {})) {
      const optional = required.has(prop) ? "" : "?";
      out.push(`  ${prop}${optional}: ${tsType(ps)};`);
    }
    out.push("}", "");
  }
  const members = schema.anyOf.map(tsType);
  const x = schema["x-headroom"];
  out.push(
    "/** One text frame of the /api/events WebSocket. */",
    `export type ServerMessage =\n${members.map((m) => `  | ${m}`).join("\n")};`,
    "",
    "/** Every event (a frame that is not the snapshot). */",
    "export type EventMessage = Exclude<ServerMessage, Snapshot>;",
    "",
    "/** The `type` of an event. */",
    'export type EventType = EventMessage["type"];',
    "",
    "/** The event of a given `type`. */",
    "export type EventOf<T extends EventType> = Extract<EventMessage, { type: T }>;",
    "",
    `export const EVENT_TYPES = ${JSON.stringify(x.eventTypes)} as const;`,
    "",
    "/** WebSocket close codes of /api/events. */",
    "export const CLOSE_CODES = {",
    ...Object.entries(x.closeCodes).map(([k, v]) => `  ${k}: ${v},`),
    "} as const;",
    "",
    "/** A browser sends its token as the subprotocol `${SUBPROTOCOL_PREFIX}<token>`. */",
    `export const SUBPROTOCOL_PREFIX = ${JSON.stringify(x.subprotocolPrefix)};`,
    "",
  );
  return out.join("\n");
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const schema = JSON.parse(readFileSync(SCHEMA_PATH, "utf8"));
  writeFileSync(TYPES_PATH, generate(schema));
  console.log(`wrote ${TYPES_PATH}`);
}
