// Bundles dashboard/src/main.ts (and the client it imports) into dashboard/app.js, the
// one script of the page the service serves at /ui. app.js is a build product, not
// committed: `make dashboard`, setup.py's build step (the wheel carries it) and the tests
// run this script; test/dashboard.test.ts checks that the bundle builds, the same twice.
import { writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { build } from "esbuild";

const here = dirname(fileURLToPath(import.meta.url));
export const ENTRY = join(here, "..", "dashboard", "src", "main.ts");
export const OUTFILE = join(here, "..", "dashboard", "app.js");

/** The bundle's text (deterministic for the same sources and esbuild version). */
export async function bundleDashboard() {
  const result = await build({
    entryPoints: [ENTRY],
    bundle: true,
    format: "esm",
    target: ["es2020", "chrome100", "safari15"],
    platform: "browser",
    write: false,
    legalComments: "none",
    charset: "utf8",
    banner: { js: "// Built from dashboard/src by scripts/build-dashboard.mjs: do not edit." },
  });
  return result.outputFiles[0].text;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  writeFileSync(OUTFILE, await bundleDashboard());
  console.log(`wrote ${OUTFILE}`);
}
