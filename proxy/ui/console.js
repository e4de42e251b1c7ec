// kvkeeper operator console: polls the admin API with the bearer token the operator gives.
// No framework, no build step; every value from the server is escaped before it is shown.
"use strict";

const POLL_MS = 2000;
const PAGE = 50;
const OPS = ["offload", "prefetch", "evict", "pin"];
const $ = (id) => document.getElementById(id);

const state = {
  token: "", tenant: "", q: "", filter: "", offset: 0,
  total: 0, skew: 0, collapsed: new Set(), timer: null, busy: false,
  selected: null, // {tenant, sid}: the session shown in the detail panel
  shownQ: "", again: false,
};

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, (c) => (
    { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
function num(n) { return n == null ? "–" : Number(n).toLocaleString("en-US"); }
function pct(x) { return x == null ? "–" : (x * 100).toFixed(1) + "%"; }

async function api(method, path, params) {
  const url = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params || {})) if (v !== "" && v != null) url.searchParams.set(k, v);
  const resp = await fetch(url, { method, headers: { Authorization: "Bearer " + state.token } });
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (!resp.ok) {
    const err = new Error((body && body.error && body.error.message) || resp.statusText);
    err.status = resp.status; err.body = body;
    throw err;
  }
  return body;
}

function setStatus(text, cls) { const s = $("status"); s.textContent = text; s.className = "status " + (cls || ""); }

// --- the session forest ---------------------------------------------------------------------
async function loadForest() {
  // an open action menu or confirmation would be destroyed by a re-render: wait for it
  if (document.activeElement && document.activeElement.matches("select.act")) return;
  if ($("confirm").open) return;
  const asked = { tenant: state.tenant, q: state.q, state: state.filter, offset: state.offset, limit: PAGE };
  const page = await api("GET", "/admin/console/forest", asked);
  // the search, filter or page changed while this was in flight: the queued refresh shows them
  if (asked.q !== state.q || asked.state !== state.filter || asked.offset !== state.offset ||
      asked.tenant !== state.tenant) return;
  state.shownQ = asked.q;
  state.skew = page.now * 1000 - Date.now();
  state.total = page.total_trees;
  const rows = [];
  for (const tree of page.trees) walk(tree, 0, [], rows);
  $("forest-body").innerHTML = rows.join("") ||
    '<tr><td colspan="11" class="muted">no sessions' + (state.q ? " match" : "") + "</td></tr>";
  const end = Math.min(page.offset + page.trees.length, page.total_trees);
  $("pageinfo").textContent = page.total_trees
    ? `trees ${page.offset + 1}–${end} of ${num(page.total_trees)}` : "no trees";
  $("prev").disabled = page.offset === 0;
  $("next").disabled = end >= page.total_trees;
  $("counts").innerHTML = `${num(page.total_sessions)} sessions` + Object.entries(page.states)
    .filter(([, n]) => n).map(([s, n]) => `<span class="chip s-${esc(s)}"><b>${num(n)}</b> ${esc(s)}</span>`).join("");
  tickTTL();
}

function walk(node, depth, lastFlags, rows) {
  const s = node.session;
  const kids = node.children || [];
  const key = s.tenant + "\u001f" + s.session_id;
  const closed = state.collapsed.has(key);
  rows.push(row(s, depth, lastFlags, kids.length + (node.hidden_children || 0), closed));
  if (closed) return;
  kids.forEach((k, i) => walk(k, depth + 1, [...lastFlags, i === kids.length - 1], rows));
  if (node.hidden_children) {
    rows.push(`<tr><td colspan="11" class="muted">${"  ".repeat(depth + 1)}… ${num(node.hidden_children)} more children (search to narrow)</td></tr>`);
  }
}

function treePrefix(lastFlags) {
  let out = "";
  lastFlags.forEach((last, i) => {
    const final = i === lastFlags.length - 1;
    out += final ? (last ? "└─" : "├─") : (last ? "  " : "│ ");
  });
  return out;
}

function row(s, depth, lastFlags, nkids, closed) {
  const c = s.counters;
  const toggle = nkids ? `<span class="toggle" data-toggle="1">${closed ? "▸" : "▾"}</span>` : '<span class="toggle"></span>';
  const ttl = s.ttl_until > 0
    ? `<div class="ttl" data-until="${s.ttl_until}" data-total="${s.ttl_s}"><div class="ttl-fill"></div><span class="ttl-text"></span></div>`
    : '<span class="muted">–</span>';
  const blocks = s.blocks == null ? '<span class="muted">–</span>'
    : `${num(s.gpu_blocks)} / ${num(s.tier_blocks)} / ${num(s.blocks)}`;
  const ops = ["free"].concat(nkids ? ["free-tree"] : [], OPS);
  const actions = '<select class="act" aria-label="action"><option value="">action…</option>' +
    ops.map((op) => `<option value="${op}">${op.replace("-", " ")}</option>`).join("") + "</select>";
  return `<tr class="node${s.matched && state.shownQ ? " matched" : ""}" data-sid="${esc(s.session_id)}" data-tenant="${esc(s.tenant)}"` +
    ` data-parent="${esc(s.parent_session_id || "")}" data-depth="${depth}" data-state="${esc(s.display_state)}" data-children="${nkids}">` +
    `<td class="sid"><span class="tree">${treePrefix(lastFlags)}</span>${toggle}${esc(s.session_id)}` +
    `${state.tenant || !s.tenant ? "" : ` <span class="muted">@${esc(s.tenant)}</span>`}</td>` +
    `<td>${esc(s.agent || "")}</td>` +
    `<td><span class="badge s-${esc(s.display_state)}">${esc(s.display_state)}</span></td>` +
    `<td>${ttl}</td><td>${esc(s.engine || "–")}</td><td>${blocks}</td>` +
    `<td>${s.tier_pinned ? "📌 tier" : '<span class="muted">no</span>'}</td>` +
    `<td>${num(c.requests)}</td><td>${num(c.prompt_tokens)} / ${num(c.cached_tokens)}</td>` +
    `<td>${pct(c.hit_rate)}</td><td class="actions">${actions}</td></tr>`;
}

// TTL bars move between polls from their deadline and the server's clock
function tickTTL() {
  const now = (Date.now() + state.skew) / 1000;
  for (const el of document.querySelectorAll(".ttl")) {
    const left = Math.max(0, Number(el.dataset.until) - now);
    const total = Math.max(Number(el.dataset.total) || left, left, 0.001);
    el.firstChild.style.width = (100 * left / total).toFixed(2) + "%";
    el.dataset.left = left.toFixed(2);
    el.lastChild.textContent = left >= 1 ? left.toFixed(0) + " s" : left.toFixed(1) + " s";
  }
}

// --- engines -----------------------------------------------------------------------------------
function chart(points, key, fmt, color) {
  // one line through the points that have a value (a window without requests has none)
  const pts = points.map((p, i) => [i, p[key]]).filter(([, v]) => v != null);
  const last = pts.length ? fmt(pts[pts.length - 1][1]) : "–";
  const max = key === "hit_rate" ? 1 : Math.max(...pts.map(([, v]) => v)) * 1.15 || 1;
  const step = 300 / Math.max(1, points.length - 1);
  const xy = pts.map(([i, v]) => `${(i * step).toFixed(1)},${(38 - 36 * v / max).toFixed(1)}`);
  const line = xy.length > 1 ? `<polyline fill="none" stroke="${color}" stroke-width="1.5" points="${xy.join(" ")}"/>` : "";
  const dot = xy.length ? `<circle r="2" fill="${color}" cx="${xy[xy.length - 1].split(",")[0]}" cy="${xy[xy.length - 1].split(",")[1]}"/>` : "";
  return { svg: `<svg class="chart" viewBox="0 0 300 40" preserveAspectRatio="none">${line}${dot}</svg>`, last };
}

function outcomes(obj) {
  const e = Object.entries(obj || {});
  return e.length ? e.map(([k, v]) => `${esc(k)} ${num(v)}`).join(", ") : "–";
}

async function loadEngines() {
  const body = await api("GET", "/admin/console/engines");
  $("engines").innerHTML = body.engines.map((e) => {
    const hit = chart(e.series, "hit_rate", pct, "#3fb950");
    const ttft = chart(e.series, "ttft_s", (v) => (v * 1000).toFixed(0) + " ms", "#58a6ff");
    const use = e.load && e.load.kv_cache_usage != null ? e.load.kv_cache_usage : null;
    const tier = e.tier ? `${num(e.tier.sessions)} sessions, ${num(e.tier.chunks)} chunks` + (e.tier.capacity_chunks ? ` of ${num(e.tier.capacity_chunks)}` : "") : "no tier";
    const resident = Object.entries(e.resident_blocks || {}).map(([m, n]) => `${esc(m)} ${num(n)}`).join(", ") || "–";
    return `<div class="engine" data-engine="${esc(e.name)}">` +
      `<h3><span><span class="dot ${e.healthy ? "up" : "down"}"></span>${esc(e.name)}</span><span class="muted">${e.healthy ? "healthy" : esc(e.last_error || "down")}</span></h3>` +
      '<dl class="kv">' +
      (e.leader === false ? '<dt>driven by</dt><dd class="muted">another worker or replica (horizon, pool and residency are its to see)</dd>' : "") +
      `<dt>load</dt><dd>${num(e.inflight)} in flight${e.load ? `, ${num(e.load.running)} running, ${num(e.load.waiting)} waiting` : ""}</dd>` +
      `<dt>pool</dt><dd>${pct(use)} of ${num(e.load && e.load.pool_blocks)} blocks</dd>` +
      `<dt>LRU horizon</dt><dd>${e.horizon_s == null ? "–" : e.horizon_s.toFixed(1) + " s"} <span class="muted">from ${esc(e.horizon_source || "–")}</span></dd>` +
      `<dt>resident</dt><dd>${resident}</dd>` +
      `<dt>protected</dt><dd>${num(e.protected_sessions)} sessions</dd>` +
      `<dt>credit</dt><dd>${e.credit ? `${num(Math.round(e.credit.credit_tokens))} tokens (share ${e.credit.max_share}), recomputed ${num(e.credit.recomputed_tokens)}, declined ${num(e.credit.declined)}` : "–"}</dd>` +
      `<dt>touches</dt><dd>${outcomes(e.touches)}</dd>` +
      `<dt>tier pins</dt><dd>${tier}</dd>` +
      "</dl>" +
      `<div class="bar"><div style="width:${((use || 0) * 100).toFixed(1)}%"></div></div>` +
      `<div class="chart-label">hit rate <b>${hit.last}</b></div>${hit.svg}` +
      `<div class="chart-label">TTFT <b>${ttft.last}</b></div>${ttft.svg}</div>`;
  }).join("");
}

// --- one session in detail --------------------------------------------------------------------
async function loadDetail() {
  if (!state.selected) return;
  const { tenant, sid } = state.selected;
  let d;
  try {
    d = await api("GET", "/admin/console/sessions/" + encodeURIComponent(sid), { tenant });
  } catch (err) {
    if (err.status !== 404) throw err;
    $("detail-body").innerHTML = `<p class="muted">${esc(sid)} is gone (freed or expired)</p>`;
    return;
  }
  const s = d.session, c = s.counters;
  const when = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "–");
  const where = Object.entries(d.residency).map(([engine, media]) =>
    `${esc(engine)}: ` + (Object.entries(media).map(([m, n]) => `${esc(m)} ${num(n)}`).join(", ") || "nothing resident")
  ).join("<br>") || "–";
  $("detail-body").innerHTML = `<h3 data-detail="${esc(s.session_id)}"><span>${esc(s.session_id)}</span>` +
    `<span class="badge s-${esc(s.display_state)}">${esc(s.display_state)}</span></h3><dl class="kv">` +
    `<dt>tenant</dt><dd>${esc(s.tenant)}</dd><dt>agent</dt><dd>${esc(s.agent || "–")}</dd>` +
    `<dt>parent</dt><dd>${esc(s.parent_session_id || "–")}</dd>` +
    `<dt>children</dt><dd>${d.children.map(esc).join(", ") || "–"}</dd>` +
    `<dt>engine</dt><dd>${esc(s.engine || "–")}</dd>` +
    `<dt>TTL</dt><dd>${s.ttl_until > 0 ? `until ${when(s.ttl_until)} (${num(s.ttl_s)} s${s.ttl_guessed ? ", guessed from its returns" : ""})` : "not protected"}</dd>` +
    `<dt>prefix</dt><dd>${num(s.blocks)} blocks${s.tier_pinned ? ", pinned in the tier" : ""}</dd>` +
    `<dt>resident</dt><dd class="residency">${where}</dd>` +
    `<dt>context</dt><dd>${num(d.context_bytes)} bytes</dd>` +
    `<dt>created</dt><dd>${when(s.created)}</dd><dt>last used</dt><dd>${when(d.last_used)}</dd>` +
    `<dt>last touch</dt><dd>${when(d.last_touch)}</dd>` +
    `<dt>requests</dt><dd>${num(c.requests)} (${num(c.touches)} touches, ${num(c.warmups)} warm-ups, ${num(c.expiries)} expiries)</dd>` +
    `<dt>tokens</dt><dd>${num(c.prompt_tokens)} prompt, ${num(c.cached_tokens)} cached (${pct(c.hit_rate)}), ${num(c.completion_tokens)} completion</dd></dl>`;
}

function select(tenant, sid) {
  state.selected = { tenant, sid };
  $("detail").hidden = false;
  $("detail-body").innerHTML = '<p class="muted">loading…</p>';
  loadDetail().catch((err) => setStatus("error: " + err.message, "err"));
}

// --- actions -----------------------------------------------------------------------------------
function confirmDialog(text) {
  const dlg = $("confirm");
  $("confirm-text").textContent = text;
  return new Promise((resolve) => {
    dlg.addEventListener("close", () => resolve(dlg.returnValue === "ok"), { once: true });
    dlg.showModal();
  });
}

function showOutcome(op, sid, status, reason, detail) {
  const li = document.createElement("li");
  li.className = "outcome";
  li.dataset.op = op; li.dataset.sid = sid; li.dataset.status = status;
  li.innerHTML = `<b>${esc(op)}</b> ${esc(sid)}: <span class="o-${esc(status)}">${esc(status)}</span>` +
    (reason ? ` <i>${esc(reason)}</i>` : "") + (detail ? ` <code>${esc(JSON.stringify(detail))}</code>` : "");
  $("outcomes").prepend(li);
}

async function act(tr, op) {
  const sid = tr.dataset.sid, tenant = tr.dataset.tenant;
  const kids = Number(tr.dataset.children || 0);
  const what = op === "free-tree" ? `free ${sid} and its subtree (${kids} direct children)`
    : op === "free" ? `free ${sid}` + (kids ? " (its children are detached, not freed)" : "")
    : `${op} ${sid}`;
  if (!(await confirmDialog(`Really ${what}?`))) return;
  const path = "/admin/sessions/" + encodeURIComponent(sid);
  try {
    if (op.startsWith("free")) {
      const res = await api("DELETE", path, { tenant, tree: op === "free-tree" ? "true" : "" });
      showOutcome(op, sid, "applied", null, { freed: res.freed });
    } else {
      const res = await api("POST", path + "/" + op, { tenant });
      showOutcome(op, sid, res.status, res.reason, res.detail);
    }
  } catch (err) {
    showOutcome(op, sid, "error", err.message, err.body && err.body.error ? { code: err.body.error.code, status: err.status } : null);
  }
  await refresh();
}

// --- wiring ------------------------------------------------------------------------------------
async function refresh() {
  if (!state.token) return;
  if (state.busy) { state.again = true; return; } // one more right after this one
  state.busy = true;
  try {
    await Promise.all([loadForest(), loadEngines(), loadDetail()]);
    setStatus("live · " + new Date().toLocaleTimeString(), "ok");
  } catch (err) {
    const what = { 401: "not authorised", 403: "forbidden" }[err.status] || "error";
    setStatus(what + ": " + err.message, "err");
  } finally {
    state.busy = false;
    if (state.again) { state.again = false; refresh(); }
  }
}

function connect() {
  state.token = $("token").value.trim();
  state.tenant = $("tenant").value.trim();
  state.offset = 0;
  sessionStorage.setItem("kvk-token", state.token);
  sessionStorage.setItem("kvk-tenant", state.tenant);
  clearInterval(state.timer);
  state.timer = setInterval(refresh, POLL_MS);
  refresh();
}

function init() {
  const hash = new URLSearchParams(location.hash.slice(1));
  $("token").value = hash.get("token") || sessionStorage.getItem("kvk-token") || "";
  $("tenant").value = hash.get("tenant") || sessionStorage.getItem("kvk-tenant") || "";
  if (hash.has("token")) history.replaceState(null, "", location.pathname); // keep it out of history
  $("auth").addEventListener("submit", (ev) => { ev.preventDefault(); connect(); });
  let debounce = null;
  $("search").addEventListener("input", () => {
    clearTimeout(debounce);
    debounce = setTimeout(() => { state.q = $("search").value.trim(); state.offset = 0; refresh(); }, 250);
  });
  $("state").addEventListener("change", () => { state.filter = $("state").value; state.offset = 0; refresh(); });
  $("prev").addEventListener("click", () => { state.offset = Math.max(0, state.offset - PAGE); refresh(); });
  $("next").addEventListener("click", () => { state.offset += PAGE; refresh(); });
  $("forest-body").addEventListener("click", (ev) => {
    const tr = ev.target.closest("tr.node");
    if (!tr) return;
    if (!ev.target.dataset.toggle) {
      if (ev.target.closest("td.sid")) select(tr.dataset.tenant, tr.dataset.sid);
      return;
    }
    const key = tr.dataset.tenant + "\u001f" + tr.dataset.sid;
    if (state.collapsed.has(key)) state.collapsed.delete(key); else state.collapsed.add(key);
    refresh();
  });
  $("forest-body").addEventListener("change", (ev) => {
    const tr = ev.target.closest("tr.node");
    if (!tr || !ev.target.matches("select.act") || !ev.target.value) return;
    const op = ev.target.value;
    ev.target.value = "";
    ev.target.blur();
    act(tr, op);
  });
  $("detail-close").addEventListener("click", () => { state.selected = null; $("detail").hidden = true; });
  setInterval(tickTTL, 200);
  if ($("token").value) connect();
}

init();
