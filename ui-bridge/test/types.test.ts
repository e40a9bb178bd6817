// src/types.ts must match schema/events.schema.json (which the Python tests keep in step
// with the service's types): generated text, and every interface's property names.
import { readFileSync } from "node:fs";
import ts from "typescript";
import { describe, expect, it } from "vitest";
import { generate, SCHEMA_PATH, TYPES_PATH } from "../scripts/gen-types.mjs";
import { CLOSE_CODES, EVENT_TYPES, SUBPROTOCOL_PREFIX } from "../src/types.js";

interface Def {
  type?: string;
  properties?: Record<string, unknown>;
  required?: string[];
}
const schema = JSON.parse(readFileSync(SCHEMA_PATH, "utf8")) as {
  $defs: Record<string, Def>;
  "x-headroom": { closeCodes: Record<string, number>; eventTypes: string[]; subprotocolPrefix: string };
};
const source = readFileSync(TYPES_PATH, "utf8");

describe("src/types.ts", () => {
  it("is what scripts/gen-types.mjs makes of the schema (run `npm run gen`)", () => {
    expect(source).toBe(generate(schema));
  });

  it("declares every schema type with the same property names and optionality", () => {
    const file = ts.createSourceFile("types.ts", source, ts.ScriptTarget.ES2022, true);
    const interfaces = new Map<string, Map<string, boolean>>();
    file.forEachChild((node) => {
      if (!ts.isInterfaceDeclaration(node)) return;
      const props = new Map<string, boolean>();
      for (const member of node.members) {
        if (ts.isPropertySignature(member)) props.set(member.name.getText(file), !member.questionToken);
      }
      interfaces.set(node.name.text, props);
    });
    const objects = Object.entries(schema.$defs).filter(([, d]) => d.type === "object");
    expect([...interfaces.keys()].sort()).toEqual(objects.map(([n]) => n).sort());
    for (const [name, def] of objects) {
      const required = new Set(def.required ?? []);
      const expected = Object.keys(def.properties ?? {}).map((p) => [p, required.has(p)]);
      expect([...interfaces.get(name)!.entries()], name).toEqual(expected);
    }
  });

  it("carries the protocol constants", () => {
    const x = schema["x-headroom"];
    expect(CLOSE_CODES).toEqual(x.closeCodes);
    expect([...EVENT_TYPES]).toEqual(x.eventTypes);
    expect(SUBPROTOCOL_PREFIX).toBe(x.subprotocolPrefix);
    expect(CLOSE_CODES.TOO_SLOW).toBe(4008);
  });
});
