// The levers9 dashboard: Apps (a workspace's tasks), a task's page with its live log, and
// the operator's Machines and Workers. Everything comes from the /v1/ API the CLI uses, with
// the session cookie; live views read the API's watch and follow streams (one JSON per line).
// No framework and no build step: DOM nodes are made with textContent only, never HTML
// strings, so no value from the API is ever parsed as markup.

const meta = (name) => document.querySelector(`meta[name="${name}"]`)?.content ?? "";
const session = { kind: meta("levers9-kind"), name: meta("levers9-name"), csrf: meta("levers9-csrf") };
const STATES = ["pending", "starting", "running", "succeeded", "failed", "cancelled", "lost"];
const PAGE = 50;
const view = document.getElementById("view");
let current = null; // the AbortController of the view on screen

class ApiFailure extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

// What an element holds now; null, undefined and false (a part not shown) are left out, as
// h() leaves them out: the DOM's own replaceChildren would show them as the text "null".
function fill(el, ...children) {
  el.replaceChildren(...children.flat().filter((child) => child !== null && child !== undefined && child !== false));
}

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

async function failure(response) {
  let code = "", message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    code = body.code ?? "";
    message = body.message ?? message;
  } catch (_) { /* not JSON */ }
  if (response.status === 401) {
    window.location.assign("/ui/signin");
  }
  return new ApiFailure(response.status, code, message);
}

async function api(path, { method = "GET", body, signal } = {}) {
  const headers = { accept: "application/json" };
  if (method !== "GET") headers["x-levers9-csrf"] = session.csrf;
  if (body !== undefined) headers["content-type"] = "application/json";
  const response = await fetch(path, {
    method, headers, signal, credentials: "same-origin",
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!response.ok) throw await failure(response);
  return response.status === 204 ? null : response.json();
}

// Calls onItem with each JSON line of a streaming answer until it ends or `signal` aborts.
async function stream(path, onItem, signal, onAnswered = () => {}) {
  const response = await fetch(path, { signal, credentials: "same-origin" });
  if (!response.ok) throw await failure(response);
  onAnswered();
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    let newline;
    while ((newline = pending.indexOf("\n")) >= 0) {
      const line = pending.slice(0, newline);
      pending = pending.slice(newline + 1);
      if (line.trim()) onItem(JSON.parse(line));
    }
  }
}

const sleep = (ms, signal) => new Promise((resolve) => {
  const timer = setTimeout(resolve, ms);
  signal?.addEventListener("abort", () => { clearTimeout(timer); resolve(); }, { once: true });
});

// Keeps a stream open, opening it again after a failure (the worker or replica went away),
// and says why on `onTrouble` meanwhile. Ends when the stream ends on its own.
// `onOpen` is called before each (re)opening: a follow stream starts from the beginning again.
async function keepStreaming(path, onItem, onTrouble, signal, onOpen = () => {}) {
  // A blip (the browser's network changed, a replica drained) is bridged at once; a worker
  // that stays away is asked again every 2 s.
  let delay = 250;
  for (;;) {
    try {
      onOpen();
      // Answered again: the trouble shown meanwhile is over, and the next blip is bridged fast.
      await stream(path, onItem, signal, () => { onTrouble(null); delay = 250; });
      return;
    } catch (error) {
      if (signal.aborted) return;
      if (error instanceof ApiFailure && error.status !== 503 && error.status !== 504) {
        onTrouble(error);
        return;
      }
      onTrouble(error);
      await sleep(delay, signal);
      delay = Math.min(delay * 2, 2000);
    }
  }
}

function problem(error) {
  if (error instanceof ApiFailure) {
    if (error.status === 403) {
      return h("div", { class: "notice warn" },
        h("strong", { text: "Not for this token. " }), error.message,
        h("p", { class: "muted", text: session.kind === "workspace"
          ? "This page needs an operator token: sign out and sign in with one."
          : "This page needs a workspace token: sign out and sign in with one." }));
    }
    if (error.status === 404) return h("div", { class: "notice warn" }, h("strong", { text: "Not found. " }), error.message);
    if (error.status === 503 || error.status === 504) {
      return h("div", { class: "notice error" },
        h("strong", { text: "The controlplane cannot reach it right now. " }), error.message,
        h("p", { class: "muted", text: "It keeps trying; this page updates when it answers." }));
    }
    return h("div", { class: "notice error" }, h("strong", { text: `${error.code || error.status}: ` }), error.message);
  }
  return h("div", { class: "notice error" }, h("strong", { text: "The dashboard lost the controlplane. " }), String(error.message || error));
}

// -- formatting --------------------------------------------------------------------------

function ago(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d${Math.floor((s % 86400) / 3600)}h`;
}
const now = () => Date.now() / 1000;
const since = (t) => (t ? ago(now() - t) : "—");
function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}
const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "—");

function duration(task) {
  const from = task.runningAt ?? task.startedAt;
  if (!from) return "—";
  return ago((task.finishedAt ?? now()) - from);
}

function stateCell(task) {
  const cell = h("td", {}, h("span", { class: `state ${task.state}`, text: task.state }));
  if (task.state === "pending" && task.waiting) cell.append(h("div", { class: "why", text: task.waiting }));
  if (task.state === "starting" && task.pull) {
    const { phase, doneBytes, totalBytes } = task.pull;
    const pct = totalBytes ? Math.floor((100 * doneBytes) / totalBytes) : 0;
    const bar = h("div", { class: "progress", title: `${bytes(doneBytes)} of ${bytes(totalBytes)}` }, h("span"));
    bar.firstChild.style.width = `${pct}%`;
    cell.append(h("div", { class: "why", text: `${phase} ${pct}%` }), bar);
  }
  if (task.state === "succeeded" || task.state === "failed" || task.state === "lost" || task.state === "cancelled") {
    const detail = [task.exitCode !== null && task.exitCode !== undefined ? `exit ${task.exitCode}` : null, task.reason].filter(Boolean).join(" · ");
    if (detail) cell.append(h("div", { class: "why", text: detail }));
  }
  return cell;
}

function cardsCell(task) {
  if (!task.cards) return h("td", { class: "muted", text: "—" });
  return h("td", { title: (task.cardIds || []).join("\n") || "not placed yet" },
    `${task.cards}× `, h("span", { text: task.cardModel || "GPU" }));
}

// -- views -------------------------------------------------------------------------------

function parseHash() {
  const [path, query = ""] = window.location.hash.replace(/^#/, "").split("?");
  return { parts: path.split("/").filter(Boolean), query: new URLSearchParams(query) };
}

function setNav(name) {
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("active", link.dataset.nav === name);
  }
}

// A watched page after one line of changes: the removed and changed tasks taken out, then
// each changed one put at its place, in order (`apply_changes` in control/api/watch.py).
function applyChanges(page, changes) {
  const changed = changes.changed || [];
  const moved = new Set([...(changes.removed || []), ...changed.map((c) => c.task.id)]);
  const tasks = page.tasks.filter((task) => !moved.has(task.id));
  for (const c of changed) tasks.splice(c.index, 0, c.task);
  return { tasks, next: changes.next ?? null };
}

async function appsView(query, signal) {
  setNav("apps");
  const state = query.get("state") || "";
  const before = query.get("before") || "";
  const filters = h("div", { class: "filters" },
    ["", ...STATES].map((s) => h("a", {
      href: `#/apps${s ? `?state=${s}` : ""}`, class: s === state ? "chip active" : "chip", text: s || "all",
    })));
  const body = h("tbody", {}, h("tr", {}, h("td", { colspan: 8, class: "muted", text: "Loading…" })));
  const older = h("a", { class: "button hidden", text: "Older →" });
  const newer = h("a", { class: "button", href: `#/apps${state ? `?state=${state}` : ""}`, text: "← Newest" });
  const trouble = h("div");
  fill(view,
    h("h1", {}, "Apps ", h("span", { class: "muted", text: `workspace ${session.name}` })),
    filters, trouble,
    h("table", { class: "tasks" },
      h("thead", {}, h("tr", {}, ["Task", "State", "Image", "Cards", "Worker · node", "Age", "Duration"].map((t) => h("th", { text: t })))),
      body),
    h("div", { class: "pager" }, before ? newer : null, older),
  );
  const params = new URLSearchParams({ limit: String(PAGE), watch: "true" });
  if (state) params.set("state", state);
  if (before) params.set("before", before);
  let latest = null;
  const draw = (list) => {
    latest = list;
    const rows = list.tasks.map((task) => h("tr", { "data-task": task.id },
      h("td", {}, h("a", { href: `#/tasks/${encodeURIComponent(task.id)}`, text: task.id })),
      stateCell(task),
      h("td", { class: "image", text: task.image, title: task.image }),
      cardsCell(task),
      h("td", {}, task.worker ? h("span", { text: task.worker, title: task.worker }) : h("span", { class: "muted", text: "—" }),
        task.node ? h("div", { class: "why", text: task.node }) : null),
      h("td", { text: since(task.createdAt), title: when(task.createdAt) }),
      h("td", { text: duration(task) })));
    fill(body, ...(rows.length ? rows : [h("tr", {}, h("td", { colspan: 8, class: "muted", text: state ? `No ${state} tasks.` : "No tasks yet. Run one with `levers9 run`." }))]));
    older.classList.toggle("hidden", !list.next);
    if (list.next) older.href = `#/apps?${new URLSearchParams({ ...(state ? { state } : {}), before: list.next })}`;
  };
  const ticker = setInterval(() => latest && draw(latest), 1000);
  signal.addEventListener("abort", () => clearInterval(ticker), { once: true });
  // The first line is the page, each later one its changes (control/api/watch.py).
  const onItem = (item) => draw(item.tasks ? item : applyChanges(latest, item));
  await keepStreaming(`/v1/tasks?${params}`, onItem, (error) => fill(trouble, ...(error ? [problem(error)] : [])), signal);
}

function confirmThen(text, action) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = text;
  dialog.returnValue = "";
  dialog.addEventListener("close", () => { if (dialog.returnValue === "ok") action(); }, { once: true });
  dialog.showModal();
}

async function taskView(id, signal) {
  setNav("apps");
  const head = h("div");
  const actions = h("div", { class: "actions" });
  const facts = h("dl", { class: "facts" });
  const timeline = h("ol", { class: "timeline" });
  const endpoints = h("div");
  const said = h("div");
  const logBox = h("pre", { class: "log", "aria-label": "log" });
  const logState = h("p", { class: "muted small", text: "Waiting for the log…" });
  fill(view,
    h("p", {}, h("a", { href: "#/apps", text: "← Apps" })),
    head, actions, said,
    h("div", { class: "columns" },
      h("section", {}, h("h2", { text: "Spec" }), facts, h("h2", { text: "Endpoints" }), endpoints),
      h("section", {}, h("h2", { text: "Timeline" }), timeline)),
    h("h2", { text: "Log" }), logState, logBox);

  const act = (what, path, done) => async () => {
    try {
      const result = await api(path, { method: "POST", signal });
      fill(said, h("div", { class: "notice ok", text: done(result) }));
    } catch (error) {
      fill(said, problem(error));
    }
  };
  let shown = null;
  const draw = (task) => {
    fill(head, h("h1", {}, task.id, " ", h("span", { class: `state ${task.state}`, text: task.state })),
      task.waiting ? h("p", { class: "why", text: task.waiting }) : null,
      task.reason ? h("p", { class: "why", text: `${task.exitCode !== null && task.exitCode !== undefined ? `exit ${task.exitCode} · ` : ""}${task.reason}` }) : null);
    if (shown !== task.state) {
      shown = task.state;
      fill(actions,
        ["pending", "starting", "running"].includes(task.state) ? h("button", { class: "danger", id: "cancel", type: "button",
          onclick: () => confirmThen(`Cancel task ${task.id}? Its container is stopped.`, act("cancel", `/v1/tasks/${encodeURIComponent(task.id)}/cancel`, (t) => `Task ${t.id} is ${t.state}.`)) }, "Cancel") : null,
        task.state === "running" ? h("button", { id: "snapshot", type: "button",
          onclick: () => confirmThen(`Snapshot the filesystem of task ${task.id}?`, act("snapshot", `/v1/tasks/${encodeURIComponent(task.id)}/snapshot`, (s) => `Snapshot ${s.digest} kept.`)) }, "Snapshot") : null);
    }
    const rows = [
      ["Image", task.image],
      ["Command", [...(task.command || []), ...(task.args || [])].join(" ") || "(the image's)"],
      ["Cards", task.cards ? `${task.cards} × ${task.cardModel || "GPU"}` : "none"],
      ["Card UUIDs", (task.cardIds || []).join(", ") || "—"],
      ["CPU", task.cpuMillis ? `${task.cpuMillis / 1000} cores` : "—"],
      ["Memory", task.memoryBytes ? bytes(task.memoryBytes) : "—"],
      ["Timeout", task.timeoutS ? ago(task.timeoutS) : "none"],
      ["Worker", task.worker || "—"],
      ["Node", task.node || "—"],
    ];
    fill(facts, ...rows.flatMap(([k, v]) => [h("dt", { text: k }), h("dd", { text: v })]));
    const steps = [["created", task.createdAt], ["placed", task.startedAt], ["running", task.runningAt], [task.state, task.finishedAt]];
    fill(timeline, ...steps.filter(([, t]) => t).map(([name, t]) => h("li", {}, h("strong", { text: name }), " ", h("span", { class: "muted", text: when(t) }))));
    fill(endpoints, ...(task.ports?.length ? task.ports.map((port) => h("div", { class: "endpoint" },
      h("code", { text: `${window.location.origin}/v1/tasks/${task.id}/ports/${port}/` }),
      h("p", { class: "muted small", text: `With a workspace token as a bearer header, or locally: levers9 port ${task.id} ${port}` }))) : [h("p", { class: "muted", text: "No ports declared." })]));
  };
  const trouble = (error) => fill(said, ...(error ? [problem(error)] : []));
  const follow = async () => {
    let lines = 0;
    const restart = () => { lines = 0; fill(logBox); };
    await keepStreaming(`/v1/tasks/${encodeURIComponent(id)}/logs?follow=true`, (line) => {
      lines += 1;
      logBox.append(h("span", { class: line.stream === "stderr" ? "line stderr" : "line", title: `${line.stream} ${line.time}`, text: line.partial ? line.text : `${line.text}\n` }));
      logState.textContent = `${lines} line(s), following`;
      if (logBox.scrollHeight - logBox.scrollTop - logBox.clientHeight < 80) logBox.scrollTop = logBox.scrollHeight;
    }, (error) => {
      if (error) fill(logState, problem(error));
      else logState.textContent = lines ? `${lines} line(s), following` : "Following the log…";
    }, signal, restart);
    if (!signal.aborted) logState.textContent = `${lines} line(s); the log ended`;
  };
  follow();
  await keepStreaming(`/v1/tasks/${encodeURIComponent(id)}?watch=true`, draw, trouble, signal);
}

function cardBar(cards) {
  // Ours are busy (our tasks hold them), idle (our worker holds them, no task does), or out of
  // placement as our worker reports them: unhealthy, occupied (a process outside levers9), refused.
  const bad = (cards.unhealthy || 0) + (cards.occupied || 0) + (cards.refused || 0);
  const bar = h("div", { class: "bar", title: `${cards.total} cards: ${cards.busy} busy, ${cards.idle} idle, ${bad} out of service, ${cards.others} others, ${cards.free} free` });
  for (const part of ["busy", "idle", "unhealthy", "occupied", "refused", "others", "free"]) {
    if (!cards[part]) continue;
    const seg = h("span", { class: part, text: String(cards[part]) });
    seg.style.width = `${(100 * cards[part]) / Math.max(1, cards.total)}%`;
    bar.append(seg);
  }
  return bar;
}

function cardProblems(problems) {
  // Each card our worker keeps out of placement, in its words (an XID, a squatter's pid).
  if (!problems?.length) return null;
  return h("ul", { class: "card-problems" }, problems.map((p) => h("li", { class: `card-problem ${p.state}`, "data-card": String(p.index) },
    h("strong", { text: `card ${p.index}` }), ` (${p.uuid}): `,
    p.state === "occupied" ? p.reason : `${p.state}: ${p.reason}`)));
}

async function machinesView(signal) {
  setNav("machines");
  const body = h("div", {}, h("p", { class: "muted", text: "Loading…" }));
  fill(view, h("h1", { text: "Machines" }), h("p", { class: "legend" },
    h("span", { class: "key busy", text: "busy (our tasks)" }), h("span", { class: "key idle", text: "idle (our worker)" }),
    h("span", { class: "key unhealthy", text: "unhealthy" }), h("span", { class: "key occupied", text: "occupied (outside levers9)" }),
    h("span", { class: "key others", text: "others" }), h("span", { class: "key free", text: "free" })), body);
  while (!signal.aborted) {
    try {
      const list = await api("/v1/machines", { signal });
      const sections = list.pools.map((pool) => {
        const machines = list.machines.filter((m) => m.pool === pool.pool);
        return h("section", { class: "pool", "data-pool": pool.pool },
          h("h2", {}, `Pool ${pool.pool} `, pool.error ? h("span", { class: "state failed", text: "failing" }) : h("span", { class: "state running", text: "ok" })),
          h("p", { class: "muted" }, pool.passedAt ? `last pass ${since(pool.passedAt)} ago` : "no pass yet",
            ` · ${machines.length} machine(s)`, pool.skipped?.length ? ` · ${pool.skipped.length} node(s) left out` : ""),
          pool.error ? h("div", { class: "notice error" }, h("strong", { text: "Last reconcile failed: " }), pool.error) : null,
          h("table", {},
            h("thead", {}, h("tr", {}, ["Node", "GPU", "Cards", "CPU free", "Memory free", "Worker"].map((t) => h("th", { text: t })))),
            h("tbody", {}, machines.map((m) => h("tr", { "data-node": m.node },
              h("td", { text: m.node }), h("td", { text: m.gpuModel || "—" }),
              h("td", {}, cardBar(m.cards), cardProblems(m.cardProblems)),
              h("td", { text: `${(m.cpuFreeMillis / 1000).toFixed(1)} cores` }),
              h("td", { text: bytes(m.memoryFreeBytes) }),
              h("td", {}, m.worker ? `${m.worker.state} · ${ago(m.worker.ageSeconds)}` : h("span", { class: "muted", text: "none" }),
                m.error ? h("div", { class: "notice error node-error" }, h("strong", { text: "Last write failed: " }), m.error) : null,
                m.refused ? h("div", { class: "notice error node-error" }, h("strong", { text: "Pods refused: " }), m.refused) : null))))),
          pool.skipped?.length ? h("details", {}, h("summary", { text: "Nodes left out" }),
            h("ul", {}, pool.skipped.map((s) => h("li", {}, h("strong", { text: s.node }), `: ${s.reason}`,
              s.error ? h("span", { class: "node-error" }, ` (last write failed: ${s.error})`) : null)))) : null);
      });
      fill(body, ...(sections.length ? sections : [h("p", { class: "muted", text: "No pools reconciled by this replica yet." })]));
    } catch (error) {
      if (signal.aborted) return;
      fill(body, problem(error));
      if (error instanceof ApiFailure && error.status === 403) return;
    }
    await sleep(5000, signal);
  }
}

async function workersView(signal) {
  setNav("workers");
  const body = h("div", {}, h("p", { class: "muted", text: "Loading…" }));
  fill(view, h("h1", { text: "Workers" }), body);
  while (!signal.aborted) {
    try {
      const list = await api("/v1/workers", { signal });
      fill(body, h("table", {},
        h("thead", {}, h("tr", {}, ["Worker", "Mode", "Connected", "Version", "Cards", "Node", "Tunnel age", "Last heartbeat", "RTT", "Replica"].map((t) => h("th", { text: t })))),
        h("tbody", {}, list.workers.map((w) => h("tr", { "data-worker": w.workerId },
          h("td", { text: w.workerId }), h("td", { text: w.mode }),
          h("td", {}, h("span", { class: w.connected ? "state running" : "state failed", text: w.connected ? "yes" : "no" })),
          h("td", { text: w.version || "—" }),
          h("td", { text: w.cards ? `${w.cards} × ${w.cardModel || "GPU"}` : "0" }),
          h("td", { text: w.node || "—" }),
          h("td", { text: w.connectedAt ? ago(now() - w.connectedAt) : "—" }),
          h("td", { text: w.registeredAt ? `${since(w.registeredAt)} ago` : "—" }),
          h("td", { text: w.rttMs !== null && w.rttMs !== undefined ? `${w.rttMs.toFixed(1)} ms` : "—" }),
          h("td", { text: w.replica || "—" }))))));
      if (!list.workers.length) fill(body, h("p", { class: "muted", text: "No worker has registered yet." }));
    } catch (error) {
      if (signal.aborted) return;
      fill(body, problem(error));
      if (error instanceof ApiFailure && error.status === 403) return;
    }
    await sleep(5000, signal);
  }
}

function route() {
  current?.abort();
  current = new AbortController();
  const { signal } = current;
  const { parts, query } = parseHash();
  const home = session.kind === "operator" ? "machines" : "apps";
  const [page = home, arg] = parts;
  let shown;
  if (page === "apps") shown = appsView(query, signal);
  else if (page === "tasks" && arg) shown = taskView(decodeURIComponent(arg), signal);
  else if (page === "machines") shown = machinesView(signal);
  else if (page === "workers") shown = workersView(signal);
  else {
    fill(view, h("h1", { text: "Not found" }), h("p", { text: `There is no page ${window.location.hash}.` }), h("a", { href: "#/", text: "Back" }));
    return;
  }
  shown.catch((error) => { if (!signal.aborted) fill(view, problem(error)); });
}

document.getElementById("signout").addEventListener("click", async () => {
  current?.abort();
  try {
    await fetch("/ui/signout", { method: "POST", credentials: "same-origin", headers: { "x-levers9-csrf": session.csrf } });
  } finally {
    window.location.assign("/ui/signin");
  }
});
window.addEventListener("hashchange", route);
route();
