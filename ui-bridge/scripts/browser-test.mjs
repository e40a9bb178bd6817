// The dashboard in headless Chromium, against a running control plane.
//
//   npm run test:browser -- --demo              # spawns tests/events_demo_server.py
//   HEADROOM_URL=http://127.0.0.1:8427 HEADROOM_TOKEN=$(cat ~/.config/headroom/token) \
//     npm run test:browser                      # a running `headroom serve`
//
// It loads /ui/#token=..., waits for "ready", checks that the VRAM chart moves (more
// samples, different pixels), kills the worker process (pid from /api/status) with
// SIGKILL, and checks that the page shows the worker's exit and goes restarting -> ready.
// Screenshots go to --out (default ./browser-test-out). Exit code 0 when all held.
//
// Chromium is Debian's (/usr/bin/chromium, or $CHROMIUM), driven by playwright-core; when
// it is missing and we are root on Debian, it is installed with apt-get.
import { spawn, execFileSync } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const here = dirname(fileURLToPath(import.meta.url));
const repo = resolve(here, "..", "..");
const args = process.argv.slice(2);
const flag = (name) => args.includes(name);
const option = (name, fallback) => {
  const i = args.indexOf(name);
  return i >= 0 && args[i + 1] ? args[i + 1] : fallback;
};
const outDir = resolve(option("--out", "browser-test-out"));
const chromiumPath = option("--chromium", process.env.CHROMIUM || "/usr/bin/chromium");
const venvPython = join(repo, ".venv", "bin", "python");
const python = option("--python", process.env.PYTHON || (existsSync(venvPython) ? venvPython : "python3"));

function log(...parts) {
  console.log(`[browser-test ${new Date().toISOString().slice(11, 23)}]`, ...parts);
}

function ensureChromium() {
  if (existsSync(chromiumPath)) return;
  if (process.getuid?.() === 0 && existsSync("/usr/bin/apt-get")) {
    log("installing Debian's chromium with apt-get");
    execFileSync("apt-get", ["install", "-y", "chromium"], { stdio: "inherit", env: { ...process.env, DEBIAN_FRONTEND: "noninteractive" } });
    return;
  }
  throw new Error(`no Chromium at ${chromiumPath}: install Debian's chromium (apt-get install chromium) or pass --chromium PATH`);
}

async function startDemo() {
  const child = spawn(python, [join(repo, "tests", "events_demo_server.py"), "--port", "0"], {
    cwd: repo,
    stdio: ["ignore", "pipe", "inherit"],
  });
  const first = await new Promise((resolveLine, reject) => {
    const rl = createInterface({ input: child.stdout });
    rl.once("line", (line) => resolveLine(line));
    child.once("exit", (code) => reject(new Error(`the demo server exited (${code})`)));
  });
  const info = JSON.parse(first);
  return { url: info.url, token: info.token, stop: () => child.kill("SIGTERM") };
}

async function status(url, token) {
  const r = await fetch(`${url}/api/status`, { headers: { Authorization: `Bearer ${token}` } });
  if (!r.ok) throw new Error(`/api/status: HTTP ${r.status}`);
  return r.json();
}

async function main() {
  ensureChromium();
  mkdirSync(outDir, { recursive: true });
  let server;
  if (flag("--demo")) {
    server = await startDemo();
    log("demo server at", server.url);
  } else {
    const url = process.env.HEADROOM_URL;
    const token = process.env.HEADROOM_TOKEN;
    if (!url || !token) throw new Error("set HEADROOM_URL and HEADROOM_TOKEN, or pass --demo");
    server = { url: url.replace(/\/$/, ""), token, stop: () => {} };
  }
  const profile = mkdtempSync(join(tmpdir(), "headroom-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: chromiumPath,
    headless: true,
    viewport: { width: 1280, height: 1000 },
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
  const problems = [];
  const checks = [];
  const check = (ok, what) => {
    checks.push({ ok, what });
    log(ok ? "ok  " : "FAIL", what);
    if (!ok) problems.push(what);
  };
  try {
    const page = context.pages()[0] ?? (await context.newPage());
    const consoleErrors = [];
    page.on("console", (m) => m.type() === "error" && consoleErrors.push(m.text()));
    page.on("pageerror", (e) => consoleErrors.push(String(e)));

    await page.goto(`${server.url}/ui/#token=${encodeURIComponent(server.token)}`);
    await page.waitForSelector('body[data-health="ready"]', { timeout: 60_000 });
    check(!page.url().includes("token"), "the token is removed from the address bar");
    check(
      !(await page.evaluate(() => location.href)).includes(server.token),
      "the token is not in the history entry",
    );
    check((await page.getAttribute("body", "data-connection")) === "open", "the event socket is open");

    // The chart moves.
    const canvas = page.locator("#vram-chart");
    await page.waitForFunction(() => Number(document.querySelector("#vram-chart").dataset.samples) >= 2, null, { timeout: 20_000 });
    const samples0 = Number(await canvas.getAttribute("data-samples"));
    const pixels0 = await page.evaluate(() => document.querySelector("#vram-chart").toDataURL());
    // Samples arrive about every 0.5 s; wait for three more with a deadline a busy
    // machine can meet, not a fixed time.
    const t0 = Date.now();
    await page.waitForFunction(
      (n) => Number(document.querySelector("#vram-chart").dataset.samples) >= n,
      samples0 + 3,
      { timeout: 30_000 },
    );
    const samples1 = Number(await canvas.getAttribute("data-samples"));
    const pixels1 = await page.evaluate(() => document.querySelector("#vram-chart").toDataURL());
    check(samples1 >= samples0 + 3, `the VRAM chart gets samples (${samples0} -> ${samples1} in ${((Date.now() - t0) / 1000).toFixed(1)} s)`);
    check(pixels0 !== pixels1, "the VRAM chart's pixels change");
    const ledgerRows = await page.locator("#plan-ledger tr").count();
    check(ledgerRows > 3, `the plan ledger is shown (${ledgerRows} rows)`);
    await page.screenshot({ path: join(outDir, "1-ready.png"), fullPage: true });

    // Record every state the page goes through, then kill the worker.
    await page.evaluate(() => {
      const seen = (window.__seen = { health: [], worker: [] });
      const note = () => {
        const h = document.body.dataset.health;
        const w = document.body.dataset.worker;
        if (seen.health.at(-1) !== h) seen.health.push(h);
        if (seen.worker.at(-1) !== w) seen.worker.push(w);
      };
      note();
      new MutationObserver(note).observe(document.body, { attributes: true });
    });
    const before = await status(server.url, server.token);
    const pid = before.health?.worker_pid ?? before.worker?.pid;
    check(Number.isInteger(pid), `/api/status names the worker's pid (${pid})`);
    process.kill(pid, "SIGKILL");
    log("killed worker", pid);
    await page.waitForFunction(() => window.__seen.worker.includes("exited"), null, { timeout: 30_000 });
    await page.screenshot({ path: join(outDir, "2-worker-exited.png"), fullPage: true });
    await page.waitForFunction(
      () => window.__seen.health.includes("restarting") && document.body.dataset.health === "ready",
      null,
      { timeout: 120_000 },
    );
    const seen = await page.evaluate(() => window.__seen);
    log("states seen:", JSON.stringify(seen));
    check(seen.worker.includes("exited"), "the page showed the worker's exit");
    check(seen.health.includes("restarting"), "the page went to restarting");
    check(seen.health.at(-1) === "ready", "and back to ready");
    const lastExit = await page.textContent("#worker-exit");
    check(lastExit.includes("SIGKILL") && lastExit.includes(String(pid)), `the last exit is shown: "${lastExit}"`);
    const after = await status(server.url, server.token);
    check(after.health?.worker_pid !== pid && after.health?.status === "ready", `a new worker serves (pid ${after.health?.worker_pid})`);
    check((after.health?.restarts ?? 0) >= 1, "the restart is counted");
    await page.screenshot({ path: join(outDir, "3-ready-again.png"), fullPage: true });

    if (!flag("--demo")) await firstMinute(context, page, server, check);
    check(consoleErrors.length === 0, `no console errors${consoleErrors.length ? ": " + consoleErrors.join(" | ") : ""}`);
  } finally {
    await context.close();
    rmSync(profile, { recursive: true, force: true });
    server.stop();
  }
  log(`screenshots in ${outDir}`);
  if (problems.length) {
    log(`${problems.length} check(s) failed`);
    process.exit(1);
  }
  log(`all ${checks.length} checks passed`);
}

/**
 * What a new user meets (a real service only): the service's address leads to the page,
 * which asks for the token with its form; the Restart button's exit says who asked; the
 * chat panel answers.
 */
async function firstMinute(context, page, server, check) {
  const fresh = await context.newPage(); // a new tab: no token in its session storage
  await fresh.goto(`${server.url}/`);
  check(new URL(fresh.url()).pathname === "/ui/", `the service's address leads to the dashboard (${fresh.url()})`);
  await fresh.waitForSelector("#token-form:not([hidden])", { timeout: 20_000 });
  await fresh.screenshot({ path: join(outDir, "4-token-form.png"), fullPage: true });
  await fresh.fill("#token-input", server.token);
  await fresh.click("#token-form button[type=submit]");
  await fresh.waitForSelector('body[data-health="ready"]', { timeout: 60_000 });
  check(await fresh.isHidden("#token-form"), "the token typed in the form connects the page");
  await fresh.close();

  // The page's health is still "ready" from before until the restart's events arrive:
  // wait for a "restarting" after the click, then "ready" again (a chat sent in between
  // is refused with 503 while the new worker loads).
  const mark = await page.evaluate(() => window.__seen.health.length);
  await page.click("#restart");
  await page.waitForFunction(
    () => document.querySelector("#worker-exit").textContent.includes("restart requested by the control API"),
    null,
    { timeout: 60_000 },
  );
  await page.waitForFunction(
    (from) => window.__seen.health.slice(from).includes("restarting") && document.body.dataset.health === "ready",
    mark,
    { timeout: 120_000 },
  );
  check(true, `a restart from the page says who asked: "${await page.textContent("#worker-exit")}"`);

  await page.fill("#chat-input", "Say hello in three words.");
  await page.click("#chat-send");
  // The panel samples (the API's default temperature) with a 512-token limit, so an
  // answer may run long on a busy 2-core machine: the first streamed text shows that the
  // chat answers, and a reply still streaming then is stopped from the page (the button
  // reads "Stop" meanwhile), which must end the turn at once.
  await page.waitForFunction(() => document.querySelector(".chat-assistant")?.textContent, null, { timeout: 180_000 });
  if ((await page.textContent("#chat-send")) === "Stop") await page.click("#chat-send");
  await page.waitForFunction(() => document.querySelector("#chat-send").textContent === "Send", null, { timeout: 60_000 });
  const reply = await page.textContent(".chat-assistant");
  const note = await page.evaluate(() =>
    [...document.querySelectorAll("#chat-log .muted, #chat-log .bad")].map((e) => e.textContent).join(" "),
  );
  check(reply.trim().length > 0 && !(await page.locator("#chat-log .bad").count()), `the chat panel answers: "${reply.trim()}" ${note}`);
  await page.screenshot({ path: join(outDir, "5-chat.png"), fullPage: true });
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
