// The diloco dashboard: polls /status, draws the worker table and three SVG charts, and posts
// to /control/*. Plain browser JavaScript, no library and no build step. Every chart is drawn
// from the server's own records (its update log and loss history), so a reloaded page shows
// the run so far.
//
// The token lives in sessionStorage (this tab only) and goes out as `Authorization: Bearer`,
// never as a cookie. Every request carries X-Diloco-Client, which the server requires on
// state-changing requests (a cross-site page cannot add it). Server data is written with
// textContent only: worker ids and host names come from whoever holds the token.
"use strict";

(() => {
  const TOKEN_KEY = "diloco.token";
  const REFRESH_KEY = "diloco.refresh"; // localStorage: the interval is no secret, and outlives the tab
  const REFRESH_CHOICES = [1000, 2000, 5000, 10000, 30000];
  const query = new URLSearchParams(window.location.search);
  const MAX_POINTS = 600;
  const MAX_LOSS_ROUNDS = 2048; // as many as the server keeps (server/observe/loss_history.py)
  const PALETTE = ["#2f6fb2", "#d64045", "#2e9b4f", "#8c5bb5", "#d98b00", "#1b9aaa",
    "#6b7480", "#c2549d"];
  const SVG_NS = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);

  class AuthError extends Error {}

  // --- state kept by the page ---------------------------------------------------------------
  let timer = null;
  let stopped = false;
  // How often to poll: ?refresh=MS (tests, a bookmark), else the selector's last choice.
  let refreshMs = Math.max(100, Number(query.get("refresh")) ||
    Number(window.localStorage.getItem(REFRESH_KEY)) || 1000);
  const hist = {
    lossRounds: new Map(), // round -> loss_history entry of /status
    lossSince: null, // the newest round held: the next poll asks from it on (it may still fill)
    lossX: "round", // the loss chart's x axis: "round" or "steps"
    instance: undefined, // the server's instance the history came from
    roundTime: [], // [[round, seconds]]
    bytesUp: [], // [[round, bytes received]]
    bytesDown: [], // [[round, bytes sent]]
    lastRound: null,
    lastBytes: null,
    lastSample: null, // [time, bytes in + out] for the byte rate
    rate: null,
    xName: "round",
    t0: performance.now(),
  };

  function resetHistory() {
    hist.lossRounds.clear();
    hist.lossSince = null;
    hist.instance = undefined;
    hist.roundTime = [];
    hist.bytesUp = [];
    hist.bytesDown = [];
    hist.lastRound = null;
    hist.lastBytes = null;
    hist.lastSample = null;
    hist.rate = null;
  }

  // --- requests -----------------------------------------------------------------------------
  function token() {
    return window.sessionStorage.getItem(TOKEN_KEY) || "";
  }

  async function api(method, path, body) {
    const headers = { "X-Diloco-Client": "dashboard" };
    const t = token();
    if (t) headers.Authorization = "Bearer " + t;
    const init = { method, headers, cache: "no-store", credentials: "omit" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const resp = await fetch(path, init);
    let data = null;
    try {
      data = await resp.json();
    } catch (_) {
      data = null;
    }
    const detail = data && data.detail ? data.detail : "HTTP " + resp.status;
    if (resp.status === 401 || resp.status === 429) throw new AuthError(detail);
    if (!resp.ok) throw new Error(detail);
    return data;
  }

  // --- formatting ---------------------------------------------------------------------------
  function fmtBytes(n) {
    if (typeof n !== "number" || !isFinite(n)) return "-";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) {
      n /= 1024;
      i += 1;
    }
    return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
  }

  function fmtCount(n) {
    if (typeof n !== "number") return "-";
    if (n >= 1e9) return (n / 1e9).toFixed(2) + "B";
    if (n >= 1e6) return (n / 1e6).toFixed(2) + "M";
    if (n >= 1e3) return (n / 1e3).toFixed(1) + "k";
    return String(n);
  }

  function fmtNum(v, digits) {
    return typeof v === "number" && isFinite(v) ? v.toFixed(digits) : "-";
  }

  function fmtDuration(s) {
    if (typeof s !== "number") return "-";
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    const sec = Math.floor(s % 60);
    return h ? `${h}h ${m}m` : m ? `${m}m ${sec}s` : `${sec}s`;
  }

  function setText(id, text) {
    const el = $(id);
    if (el.textContent !== text) el.textContent = text;
  }

  function message(text, isError) {
    const el = $("message");
    el.textContent = text;
    el.className = isError ? "error" : "";
  }

  // --- views --------------------------------------------------------------------------------
  function showLogin(error) {
    // Without a valid token the page shows nothing of the run: drop what was drawn.
    $("main").hidden = true;
    $("summary").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    $("worker-table").tBodies[0].replaceChildren();
    for (const id of ["chart-loss", "chart-round-time", "chart-bytes"]) $(id).replaceChildren();
    resetHistory();
    $("login-error").textContent = error || "";
    setText("connection", "not signed in");
    $("token-input").focus();
  }

  function showMain() {
    $("login").hidden = true;
    $("main").hidden = false;
    $("summary").hidden = false;
    $("logout").hidden = !token();
  }

  function health(w, st) {
    const timeout = st.heartbeat_timeout > 0 ? st.heartbeat_timeout : 120;
    const seen = w.last_seen_s_ago;
    if (typeof seen !== "number") return ["late", "unknown"];
    if (seen < timeout * 0.25) return ["ok", "healthy"];
    if (seen < timeout * 0.75) return ["late", "late heartbeat"];
    return ["dead", "silent"];
  }

  function staleness(w, st) {
    if (typeof w.staleness === "number") return String(w.staleness);
    if (typeof w.last_round === "number" && typeof st.round === "number") {
      return String(Math.max(0, st.round - 1 - w.last_round));
    }
    return "-";
  }

  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }

  function renderWorkers(st) {
    const body = $("worker-table").tBodies[0];
    const workers = Array.isArray(st.workers) ? st.workers : [];
    const rows = workers.map((w) => {
      const tr = document.createElement("tr");
      tr.dataset.worker = String(w.worker_id);
      cell(tr, String(w.worker_id), "worker-id");
      cell(tr, String(w.hostname || "-"));
      cell(tr, w.last_round === null || w.last_round === undefined ? "-" : String(w.last_round),
        "num worker-round");
      cell(tr, fmtNum(w.steps_per_second, 2), "num worker-speed");
      cell(tr, fmtNum(w.last_seen_s_ago, 1) + " s ago", "num");
      const [cls, label] = health(w, st);
      const td = cell(tr, "");
      const dot = document.createElement("span");
      dot.className = "health " + cls;
      dot.title = label;
      td.append(dot, label);
      cell(tr, fmtBytes(w.bytes_in) + " / " + fmtBytes(w.bytes_out), "num");
      cell(tr, w.codec ? String(w.codec) : "raw", "worker-codec");
      cell(tr, staleness(w, st), "num");
      cell(tr, fmtNum(w.loss, 4), "num worker-loss");
      const kick = document.createElement("button");
      kick.type = "button";
      kick.className = "kick";
      kick.textContent = "Kick";
      kick.dataset.worker = String(w.worker_id);
      const action = document.createElement("td");
      action.appendChild(kick);
      tr.appendChild(action);
      return tr;
    });
    body.replaceChildren(...rows);
    $("no-workers").hidden = rows.length > 0;
  }

  function renderSummary(st) {
    const workers = Array.isArray(st.workers) ? st.workers : [];
    const opt = st.outer_optimizer || {};
    setText("s-mode", String(st.mode || "sync"));
    setText("s-round", String(st.round ?? "-") + (st.opened === false ? " (waiting)" : ""));
    setText("s-uptime", fmtDuration(st.uptime_s));
    setText("s-model", fmtCount(st.num_params) + " params, " + fmtBytes(st.model_bytes));
    // The server's own rates (from the step counts uploads carry, and its traffic counters):
    // right from the first uploads; the page's poll-to-poll rate only for an older server.
    const bytesRate = typeof st.bytes_per_second === "number" ? st.bytes_per_second : hist.rate;
    const rate = bytesRate === null ? "" : ", " + fmtBytes(bytesRate) + "/s";
    const steps = typeof st.steps_per_second === "number" ? fmtNum(st.steps_per_second, 1) : "-";
    setText("s-throughput", steps + " steps/s" + rate);
    setText("s-workers", `${workers.length} live / ${st.num_workers ?? "-"} expected`);
    setText("s-outer", `${opt.lr ?? "-"} / ${opt.momentum ?? "-"}`);
    // The codecs the workers upload with and rounds are published in, and the last round's
    // traffic each way.
    const codecs = Array.isArray(st.codecs) && st.codecs.length ? st.codecs.join(", ") : "raw";
    setText(
      "s-codecs",
      `${codecs} up, ${st.download_codec || "fp32"} down; ` +
        `last round ${fmtBytes(st.last_round_bytes_in)} up, ` +
        `${fmtBytes(st.last_round_bytes_out)} down`);
    // Uploads queue for the server's receive buffers; a long wait means more slots would help
    // workers on links slower than the server's (README, Network tuning).
    const slots = st.upload_slots ?? "-";
    setText(
      "s-uploads",
      `${slots} slot${slots === 1 ? "" : "s"}, ${st.uploads_waiting ?? 0} queued, ` +
        `${fmtNum(st.last_round_upload_wait_max_s, 2)} s wait`);
    renderMetrics(st, workers);
    fillIfIdle("lr-input", opt.lr);
    fillIfIdle("momentum-input", opt.momentum);
    fillIfIdle("num-workers-input", st.num_workers);
  }

  // The server panel. All-reduce mode shows its quorums and hides what only a parameter server
  // has (a barrier's submissions, DyLU, fragments' uploads); swarm mode shows its stages;
  // elements say which with data-mode.
  function renderMetrics(st, workers) {
    const allreduce = st.mode === "allreduce";
    const family = allreduce || st.mode === "swarm" ? st.mode : "server";
    for (const el of document.querySelectorAll("[data-mode]")) {
      el.hidden = el.dataset.mode !== family;
    }
    const dn = st.delayed_nesterov;
    $("m-dn-row").hidden = !dn;
    if (dn) {
      const buffered = Array.isArray(st.dn_buffered) && st.dn_buffered.length ? st.dn_buffered : [0];
      setText("m-dn", buffered.map((b) => `${b}/${dn.buffer_size}`).join(", "));
    }
    setText("m-deaths", `${st.worker_deaths ?? 0} evicted, ${st.kicks ?? 0} kicked`);
    renderHierarchy(st, workers);
    $("save-state").disabled = false;
    if (st.swarm) {
      renderSwarm(st.swarm);
      $("save-state").disabled = true;
      $("save-state").title = "disabled: the peers hold their stages' parameters";
      return;
    }
    if (allreduce) {
      renderQuorums(st);
      $("save-state").title = "rank 0 of the next quorum saves, where its worker has a save_dir";
      return;
    }
    setText("m-pending", pending(st));
    if (st.dylu) {
      const each = workers.map((w) =>
        `${w.worker_id} ${w.sync_every ?? "-"}→${w.recommended_sync_every ?? "-"}`);
      setText("m-dylu", "on" + (each.length ? ": " + each.join(", ") : ""));
    } else {
      setText("m-dylu", "off");
    }
    const parts = Array.isArray(st.fragments) ? st.fragments.length : 1;
    const pattern = parts > 1 && st.fragment_pattern ? ` (${st.fragment_pattern})` : "";
    setText("m-fragments", `${st.submissions ?? 0} / ${parts} fragment${parts === 1 ? "" : "s"}` +
      pattern);
    // Saving needs a place to save: say why the button does nothing rather than fail on click.
    const canSave = typeof st.save_dir === "string" && st.save_dir !== "";
    $("save-state").disabled = !canSave;
    $("save-state").title = canSave ? "save a checkpoint to " + st.save_dir
      : "disabled: this server has no save directory (start it with --save-dir)";
    $("save-wrap").title = $("save-state").title;
  }

  // Regional relays (docs/design/relay.md): a relay shows its upstream, an upstream its relays.
  function renderHierarchy(st, workers) {
    const up = st.upstream;
    const relays = workers.filter((w) => typeof w.region === "number");
    $("m-hierarchy-row").hidden = !up && !relays.length;
    if (up) {
      const sent = up.last_upload_bytes == null ? "-" : fmtBytes(up.last_upload_bytes);
      setText("m-hierarchy", `relay of ${up.url}, upstream round ${up.round ?? "-"}, ` +
        `last upload ${sent}` + (up.last_error ? ` (${up.last_error})` : ""));
    } else if (relays.length) {
      setText("m-hierarchy", "relays: " +
        relays.map((w) => `${w.worker_id} (${w.region} workers)`).join(", "));
    }
  }

  function pending(st) {
    const expected = Array.isArray(st.expected) ? st.expected.length : 0;
    if (Array.isArray(st.fragments)) {
      return st.fragments.map((f) => Array.isArray(f.submitted)
        ? `f${f.fragment} ${f.submitted.length}/${expected}`
        : `f${f.fragment} ${f.uploading.length} uploading`).join(", ");
    }
    if (st.mode === "async") {
      const up = Array.isArray(st.uploading) ? st.uploading.length : 0;
      return `${up} uploading (async: applied as they arrive)`;
    }
    if (!st.opened) return "round not open";
    const submitted = Array.isArray(st.submitted) ? st.submitted.length : 0;
    return `${submitted}/${expected} submitted`;
  }

  function renderQuorums(st) {
    const q = st.quorum;
    const waiting = Array.isArray(st.pending_quorum) ? st.pending_quorum : [];
    setText("m-quorum", q ? `${q.id} (round ${q.round}): ${q.members.join(", ")}`
      : "none open" + (waiting.length ? `; waiting: ${waiting.join(", ")}` : ""));
    setText("m-quorum-rounds",
      `${st.rounds_completed ?? 0} completed, ${st.rounds_discarded ?? 0} discarded`);
    const excluded = Array.isArray(st.excluded_last) ? st.excluded_last : [];
    const leftOut = Array.isArray(st.left_out) ? st.left_out.map((l) => l.worker_id) : [];
    setText("m-excluded", [...excluded, ...leftOut].join(", ") || "none");
  }

  // Swarm mode's section (``sw``): ``stg`` a stage, ``bnd`` a boundary, ``sus`` a suspect.
  function renderSwarm(sw) {
    const stages = Array.isArray(sw.stages) ? sw.stages : [];
    setText("m-swarm-stages", stages.map((stg) =>
      `s${stg.stage} ${stg.ready.length}/${stg.assigned.length}` +
        (stg.throughput === null ? "" : ` ${fmtNum(stg.throughput, 1)}/s`)).join(", ") || "-");
    const bounds = Array.isArray(sw.boundaries) ? sw.boundaries : [];
    setText("m-swarm-boundaries", bounds.map((bnd) =>
      `${bnd.boundary}${bnd.direction === "forward" ? "→" : "←"} ` +
        `${fmtNum(bnd.bytes_per_token, 1)} B/token`).join(", ") || "none yet");
    const suspects = Array.isArray(sw.suspects) ? sw.suspects.map((sus) => sus.peer_id) : [];
    setText("m-swarm-reroutes", `${sw.reroutes ?? 0} rerouted, ${sw.recoveries ?? 0} recovered` +
      (suspects.length ? `; suspect: ${suspects.join(", ")}` : ""));
  }

  function fillIfIdle(id, value) {
    const el = $(id);
    if (document.activeElement === el || el.dataset.dirty === "1") return;
    if (value === undefined || value === null) return;
    el.value = String(value);
  }

  // --- history for the charts ---------------------------------------------------------------
  function push(list, point) {
    list.push(point);
    if (list.length > MAX_POINTS) list.splice(0, list.length - MAX_POINTS);
  }

  function statusPath() {
    return hist.lossSince === null ? "/status" : "/status?history_since=" + hist.lossSince;
  }

  function recordLoss(st) {
    if (st.instance !== hist.instance) {
      // The first look, or a restarted server: its history replaces what was drawn. An answer
      // to a question from an old round on lacks the new server's earlier rounds: ask again.
      const partial = hist.lossSince !== null;
      hist.lossRounds.clear();
      hist.lossSince = null;
      hist.instance = st.instance;
      if (partial) return;
    }
    for (const entry of Array.isArray(st.loss_history) ? st.loss_history : []) {
      if (typeof entry.round === "number") hist.lossRounds.set(entry.round, entry);
    }
    const rounds = [...hist.lossRounds.keys()].sort((a, b) => a - b);
    for (const r of rounds.splice(0, Math.max(0, rounds.length - MAX_LOSS_ROUNDS))) {
      hist.lossRounds.delete(r);
    }
    if (rounds.length) hist.lossSince = rounds[rounds.length - 1];
  }

  // The loss chart's series: the mean over workers, then each worker, against the round or
  // against inner steps (a worker's own; the mean's at the workers' mean step count).
  function lossSeries() {
    const bySteps = hist.lossX === "steps";
    const entries = [...hist.lossRounds.values()].sort((a, b) => a.round - b.round);
    const mean = [];
    const workers = new Map();
    for (const entry of entries) {
      const reports = Array.isArray(entry.workers) ? entry.workers : [];
      const steps = reports.map((wl) => wl.steps).filter((n) => typeof n === "number");
      for (const wl of reports) {
        const x = bySteps ? wl.steps : entry.round;
        if (typeof wl.loss !== "number" || typeof x !== "number") continue;
        const id = String(wl.worker_id);
        if (!workers.has(id)) workers.set(id, []);
        workers.get(id).push([x, wl.loss]);
      }
      let meanX = entry.round;
      if (bySteps) meanX = steps.length ? steps.reduce((a, b) => a + b, 0) / steps.length : null;
      if (typeof entry.mean_loss === "number" && meanX !== null) {
        mean.push([meanX, entry.mean_loss]);
      }
    }
    const series = [{ name: "mean", points: mean }];
    for (const [name, points] of workers) {
      if (series.length >= PALETTE.length) break;
      series.push({ name, points });
    }
    return series;
  }

  function record(st) {
    const now = (performance.now() - hist.t0) / 1000;
    recordLoss(st);
    const total = (st.bytes_in || 0) + (st.bytes_out || 0);
    const received = st.bytes_in || 0;
    if (hist.lastSample) {
      const dt = now - hist.lastSample[0];
      if (dt > 0) hist.rate = Math.max(0, (total - hist.lastSample[1]) / dt);
    }
    hist.lastSample = [now, total];
    if (Array.isArray(st.update_log) && st.update_log.length) {
      // The server's own log of updates: exact per-update figures (the bytes of each update's
      // uploads, and those sent since the update before). With fragments the rounds of
      // different fragments interleave: plot against time instead.
      const log = st.update_log;
      const multi = log.some((u) => typeof u.fragment === "number" && u.fragment > 0);
      const x = (u) => (multi ? u.t : u.round);
      hist.xName = multi ? "seconds since start" : "round";
      hist.roundTime = log
        .filter((u) => typeof u.round_time_s === "number")
        .map((u) => [x(u), u.round_time_s]);
      hist.bytesUp = log.filter((u) => typeof u.round_bytes_in === "number")
        .map((u) => [x(u), u.round_bytes_in]);
      hist.bytesDown = log.filter((u) => typeof u.round_bytes_out === "number")
        .map((u) => [x(u), u.round_bytes_out]);
    } else if (typeof st.round === "number") {
      // Otherwise observed here: the time of the last round, bytes received since the last one.
      hist.xName = "round";
      if (hist.lastRound !== null && st.round > hist.lastRound) {
        if (typeof st.last_round_time_s === "number") push(hist.roundTime, [st.round, st.last_round_time_s]);
        if (hist.lastBytes !== null) {
          push(hist.bytesUp, [st.round, (received - hist.lastBytes) / (st.round - hist.lastRound)]);
        }
      }
      if (hist.lastRound === null || st.round !== hist.lastRound) hist.lastBytes = received;
      hist.lastRound = st.round;
    }
  }

  // --- charts -------------------------------------------------------------------------------
  function svg(tag, attrs, text) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
    if (text !== undefined) el.textContent = text;
    return el;
  }

  function tickLabel(v) {
    const a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a >= 10 || Number.isInteger(v)) return v.toFixed(0);
    return v.toPrecision(3);
  }

  function lineChart(el, series, xName) {
    const W = 420, H = 200, L = 46, R = 10, T = 10, B = 28;
    const pts = series.flatMap((s) => s.points);
    const nodes = [];
    if (!pts.length) {
      nodes.push(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, "no data yet"));
      el.replaceChildren(...nodes);
      return;
    }
    let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
    const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
    const sy = (y) => T + (1 - (y - y0) / (y1 - y0)) * (H - T - B);
    for (let i = 0; i <= 4; i += 1) {
      const y = y0 + ((y1 - y0) * i) / 4;
      nodes.push(svg("line", { class: "grid", x1: L, x2: W - R, y1: sy(y), y2: sy(y) }));
      nodes.push(svg("text", { x: L - 4, y: sy(y) + 3, "text-anchor": "end" }, tickLabel(y)));
    }
    nodes.push(svg("line", { class: "axis", x1: L, x2: L, y1: T, y2: H - B }));
    nodes.push(svg("line", { class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B }));
    nodes.push(svg("text", { x: L, y: H - B + 14 }, tickLabel(x0)));
    nodes.push(svg("text", { x: W - R, y: H - B + 14, "text-anchor": "end" }, tickLabel(x1)));
    nodes.push(svg("text", { x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle" }, xName));
    series.forEach((s, i) => {
      if (!s.points.length) return;
      const colour = PALETTE[i % PALETTE.length];
      const d = s.points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
      if (s.points.length === 1) {
        const [cx, cy] = d.split(",");
        nodes.push(svg("circle", { cx, cy, r: 2.5, fill: colour }));
      } else {
        nodes.push(svg("polyline", { class: "series", points: d, stroke: colour }));
      }
      if (series.length > 1 || s.name) {
        const label = svg("text", { x: W - R - 4, y: T + 10 + i * 12, "text-anchor": "end" },
          s.name);
        label.style.fill = colour; // CSSOM, not a style attribute: allowed by the CSP
        nodes.push(label);
      }
    });
    el.replaceChildren(...nodes);
  }

  function renderCharts() {
    const xName = hist.lossX === "steps" ? "inner steps" : "round";
    lineChart($("chart-loss"), lossSeries(), xName);
    lineChart($("chart-round-time"), [{ name: "", points: hist.roundTime }], hist.xName);
    lineChart($("chart-bytes"), [
      { name: "up", points: hist.bytesUp },
      { name: "down", points: hist.bytesDown },
    ], hist.xName);
  }

  // --- polling ------------------------------------------------------------------------------
  async function poll() {
    timer = null;
    if (stopped) return;
    try {
      const st = await api("GET", statusPath());
      if (stopped) return; // shut down while this poll was in flight: keep that message
      showMain();
      record(st);
      renderSummary(st);
      renderWorkers(st);
      renderCharts();
      setText("connection", "live · refreshed " + new Date().toLocaleTimeString());
    } catch (err) {
      if (err instanceof AuthError) {
        // A refused token is forgotten; a first visit without one just asks for it.
        const had = token() !== "";
        window.sessionStorage.removeItem(TOKEN_KEY);
        showLogin(had || err.message.includes("retry") ? "refused: " + err.message : "");
        return; // wait for a token
      }
      if (stopped) return; // the poll failed because the server was shut down meanwhile
      setText("connection", "server unreachable: " + err.message + " (retrying)");
    }
    schedule();
  }

  function schedule() {
    if (!stopped && timer === null) timer = window.setTimeout(poll, refreshMs);
  }

  function refreshNow() {
    if (timer !== null) window.clearTimeout(timer);
    timer = null;
    poll();
  }

  async function control(path, body, describe) {
    try {
      const reply = await api("POST", "/control/" + path, body);
      message(describe(reply), false);
      refreshNow();
      return reply;
    } catch (err) {
      if (err instanceof AuthError) message("refused: " + err.message, true);
      else message(err.message, true);
      return null;
    }
  }

  // --- wiring -------------------------------------------------------------------------------
  function initRefresh() {
    const select = $("refresh");
    if (!REFRESH_CHOICES.includes(refreshMs)) {
      const option = document.createElement("option"); // ?refresh= off the list
      option.value = String(refreshMs);
      option.textContent = `${refreshMs / 1000} s`;
      select.prepend(option);
    }
    select.value = String(refreshMs);
    select.addEventListener("change", () => {
      refreshMs = Number(select.value);
      window.localStorage.setItem(REFRESH_KEY, String(refreshMs));
      // The next poll follows the new interval from now, not the old one's timer.
      if (timer !== null) {
        window.clearTimeout(timer);
        timer = null;
        schedule();
      }
    });
  }

  function init() {
    initRefresh();
    $("login-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const value = $("token-input").value.trim();
      if (!value) return;
      window.sessionStorage.setItem(TOKEN_KEY, value);
      $("token-input").value = "";
      $("login-error").textContent = "";
      resetHistory();
      refreshNow();
    });
    $("loss-x").addEventListener("change", () => {
      hist.lossX = $("loss-x").value === "steps" ? "steps" : "round";
      renderCharts();
    });
    $("logout").addEventListener("click", () => {
      window.sessionStorage.removeItem(TOKEN_KEY);
      showLogin("");
    });
    $("worker-table").addEventListener("click", (ev) => {
      const btn = ev.target.closest("button.kick");
      if (!btn) return;
      const id = btn.dataset.worker;
      control("kick_worker", { worker_id: id }, () => `worker ${id} kicked`);
    });
    $("save-state").addEventListener("click", () => {
      control("save_state", {}, (r) => `saved round ${r.round} to ${r.path}`);
    });
    for (const id of ["lr-input", "momentum-input", "num-workers-input"]) {
      $(id).addEventListener("input", () => { $(id).dataset.dirty = "1"; });
    }
    $("optimizer-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const body = {};
      const lr = $("lr-input").value.trim();
      const momentum = $("momentum-input").value.trim();
      if (lr !== "") body.lr = Number(lr);
      if (momentum !== "") body.momentum = Number(momentum);
      control("update_optimizer", body, (r) => {
        const o = r.outer_optimizer || {};
        $("lr-input").dataset.dirty = "";
        $("momentum-input").dataset.dirty = "";
        return `outer optimizer: lr ${o.lr}, momentum ${o.momentum}`;
      });
    });
    $("workers-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const n = Number($("num-workers-input").value);
      control("update_num_workers", { num_workers: n }, (r) => {
        $("num-workers-input").dataset.dirty = "";
        return `expected workers: ${r.num_workers}`;
      });
    });
    $("shutdown").addEventListener("click", async () => {
      if (!window.confirm("Shut the server down? It saves first (when it has a save directory); " +
          "workers keep training locally until it is back.")) return;
      const reply = await control("shutdown", { save: true }, () => "the server is shutting down");
      if (reply) {
        stopped = true;
        setText("connection", "server shut down");
      }
    });
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
