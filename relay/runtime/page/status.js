// The status page: fetches /status.json every few seconds and draws it. Every value is set
// as text (textContent, setAttribute of numbers): event data and errors never become markup.
// A cell is "num", "word" (the relay's own words and config names: not broken) or "text"
// (event data and errors, of any length: broken anywhere rather than widen the page).
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 320;
const HEIGHT = 80;
const TREND_OVER = 60; // seconds: the lag now against the lag this long ago
// Before the first good read of the fleet the tables are null: unknown, not empty.
const NO_DATA = "No data yet: this replica has not read the fleet from the database.";

function cell(row, field, value, kind) {
  const td = document.createElement("td");
  td.dataset.field = field;
  td.className = kind || "text";
  td.textContent = value === null || value === undefined ? "" : String(value);
  row.appendChild(td);
  return td;
}

function fill(tableId, rows, columns, empty) {
  const body = document.querySelector(`#${tableId} tbody`);
  const out = [];
  for (const item of rows || []) {
    const tr = document.createElement("tr");
    for (const [field, value, kind] of columns(item)) {
      cell(tr, field, value, kind);
    }
    out.push(tr);
  }
  if (out.length === 0) {
    const tr = document.createElement("tr");
    tr.className = "empty";
    const td = cell(tr, "empty", rows === null ? NO_DATA : empty);
    td.colSpan = document.querySelectorAll(`#${tableId} thead th`).length;
    out.push(tr);
  }
  body.replaceChildren(...out);
  return out;
}

function outboxOf(lane) {
  return lane.split("/")[0];
}

function trend(samples) {
  if (!samples || samples.length < 2) {
    return "";
  }
  const last = samples[samples.length - 1];
  let then = null;
  for (const s of samples) {
    if (s.at <= last.at - TREND_OVER) {
      then = s;
    }
  }
  if (then === null) {
    return ""; // not a minute of samples yet: no trend to tell
  }
  if (last.lag_events < then.lag_events) {
    return "falling";
  }
  if (last.lag_events > then.lag_events) {
    return "rising";
  }
  return "steady";
}

function drawLanes(data) {
  const rows = fill("lanes", data.lanes, (l) => [
    ["name", l.name, "word"],
    ["state", l.state, "word"],
    ["holder", l.holder],
    ["epoch", l.epoch, "num"],
    ["checkpoint", l.checkpoint, "num"],
    ["head", l.head, "num"],
    ["lag_events", l.lag_events, "num"],
    ["lag_seconds", l.lag_seconds, "num"],
    ["trend", trend(data.history[outboxOf(l.name)]), "word"],
    ["parked", l.parked, "num"],
    ["last_error", l.last_error],
  ], "No outbox configured.");
  (data.lanes || []).forEach((l, i) => {
    rows[i].dataset.lane = l.name;
    rows[i].querySelector('[data-field="state"]').classList.add(
      "state-" + l.state.replace(/[^a-z]+/g, "-"));
  });
}

function drawBlocking(data) {
  const waiting = data.lanes === null ? null : data.lanes.filter((l) => l.blocking_transaction);
  const rows = fill("blocking", waiting, (l) => {
    const b = l.blocking_transaction;
    return [
      ["name", l.name, "word"],
      ["pid", b.pid, "num"],
      ["application_name", b.application_name],
      ["state", b.state, "word"],
      ["age_seconds", b.age_seconds, "num"],
      ["gid", b.gid ? `prepared transaction ${b.gid} (owner ${b.owner})` : ""],
    ];
  }, "No lane is waiting on a transaction.");
  (waiting || []).forEach((l, i) => { rows[i].dataset.lane = l.name; });
}

function drawParked(data) {
  document.getElementById("parked-total").textContent = data.parked_total === null
    ? "(not read yet)" : `(${data.parked_total}; the 20 newest)`;
  const rows = fill("parked", data.parked, (p) => [
    ["id", p.id, "num"],
    ["outbox", p.outbox, "word"],
    ["position", p.position, "num"],
    ["event", p.event],
    ["event_type", p.event_type],
    ["rule", p.rule, "word"],
    ["reason", p.reason, "word"],
    ["attempts", p.attempts, "num"],
    ["parked_at", p.parked_at, "word"],
    ["error", p.error],
  ], "Nothing is parked.");
  (data.parked || []).forEach((p, i) => { rows[i].dataset.parked = String(p.id); });
}

function drawAudits(data) {
  const audited = data.lanes === null ? null : data.lanes.filter((l) => l.audit);
  const rows = fill("audits", audited, (l) => {
    const a = l.audit;
    const last = (a.last_missing || [])[0];
    return [
      ["outbox", outboxOf(l.name), "word"],
      ["position", a.position, "num"],
      ["since_audit", a.since_audit, "num"],
      ["checked", a.checked, "num"],
      ["missing", a.missing, "num"],
      ["last_missing", last ? `${last.id} at ${last.position} -> ${last.destination}` : ""],
      ["last_error", a.last_error],
    ];
  }, "No outbox is audited (audit.enabled).");
  (audited || []).forEach((l, i) => { rows[i].dataset.outbox = outboxOf(l.name); });
}

function drawReplicas(data) {
  const rows = fill("replicas", data.replicas, (r) => [
    ["identity", r.identity],
    ["version", r.version === null ? "not recorded (an older release)" : r.version, "word"],
    ["connected", r.connected ? "connected" : "gone: reconnecting, or dead"],
    ["holds", r.holds.join(", ")],
  ], "No replica is alive.");
  (data.replicas || []).forEach((r, i) => { rows[i].dataset.replica = r.identity; });
}

function chart(outbox, samples) {
  const figure = document.createElement("figure");
  figure.dataset.outbox = outbox;
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("class", "chart");
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
  const base = document.createElementNS(SVG, "line");
  base.setAttribute("x1", "0");
  base.setAttribute("x2", String(WIDTH));
  base.setAttribute("y1", String(HEIGHT - 1));
  base.setAttribute("y2", String(HEIGHT - 1));
  svg.appendChild(base);
  const last = samples[samples.length - 1];
  const top = Math.max(1, ...samples.map((s) => s.lag_events));
  const span = 900;
  const points = samples.map((s) => {
    const x = WIDTH - ((last.at - s.at) / span) * WIDTH;
    const y = HEIGHT - 1 - (s.lag_events / top) * (HEIGHT - 4);
    return `${x.toFixed(1)},${y.toFixed(1)}`;
  });
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", points.join(" "));
  svg.appendChild(line);
  const [x, y] = points[points.length - 1].split(",");
  const now = document.createElementNS(SVG, "circle"); // the latest sample, seen even alone
  now.setAttribute("cx", x);
  now.setAttribute("cy", y);
  now.setAttribute("r", "2.5");
  svg.appendChild(now);
  const caption = document.createElement("figcaption");
  caption.textContent = `${outbox}: ${last.lag_events} events (${last.lag_seconds}s) now,` +
    ` at most ${top} in the last ${Math.round((last.at - samples[0].at) / 60)} min` +
    (trend(samples) ? `, ${trend(samples)}` : "");
  figure.append(caption, svg);
  return figure;
}

function drawCharts(data) {
  const figures = Object.entries(data.history).map(([outbox, samples]) => chart(outbox, samples));
  if (figures.length === 0) {
    const p = document.createElement("p");
    p.textContent = "No sample yet: this replica samples the lag every few seconds.";
    figures.push(p);
  }
  document.getElementById("charts").replaceChildren(...figures);
}

// The line under the title: the data's age grows by the second, also when no answer comes
// (the replica that served the page is gone), so it never passes for current.
let shown = null;

function drawMeta(data) {
  shown = { takenAt: data.taken_at, servedBy: data.served_by, version: data.version };
  tickMeta();
}

function tickMeta() {
  if (shown === null) {
    return;
  }
  const when = shown.takenAt ? new Date(shown.takenAt) : null;
  const age = when ? Math.max(0, Math.round((Date.now() - when.getTime()) / 1000)) : null;
  const meta = document.getElementById("meta");
  meta.textContent = (when
    ? `Data from ${when.toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC")}` +
      ` (database clock, ${age}s ago)`
    : "No data yet") + `; served by ${shown.servedBy}, relay ${shown.version}.`;
  meta.dataset.takenAt = shown.takenAt || "";
}

function showError(text) {
  const box = document.getElementById("error");
  box.textContent = text || "";
  box.hidden = !text;
}

async function refresh() {
  let wait = 2;
  try {
    const answer = await fetch("/status.json", { cache: "no-store" });
    if (!answer.ok) {
      throw new Error(`HTTP ${answer.status}`);
    }
    const data = await answer.json();
    wait = data.refresh_seconds;
    drawMeta(data);
    drawLanes(data);
    drawCharts(data);
    drawBlocking(data);
    drawParked(data);
    drawAudits(data);
    drawReplicas(data);
    showError(data.error ? `The last read of the fleet failed: ${data.error}` +
      (data.taken_at ? " (the tables show the last good read)" : "") : "");
  } catch (err) {
    showError(`This replica did not answer: ${err.message} (the tables show the last answer)`);
  }
  setTimeout(refresh, wait * 1000);
}

refresh();
setInterval(tickMeta, 1000);
