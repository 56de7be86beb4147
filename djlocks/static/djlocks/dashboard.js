// Live updates of the djlocks dashboard: refetch the page's JSON every few
// seconds and redraw the tables in place; tick countdowns every second.
// Without this script the pages are complete, only static.
"use strict";
(function () {
  const root = document.querySelector("[data-djlocks-json]");
  if (!root) {
    return;
  }
  const every = 1000 * Number(root.dataset.djlocksEvery || 5);

  // The same wording as the `seconds` template filter (djlocks_dashboard.py).
  function seconds(value) {
    if (value === null || value === undefined) {
      return "—";
    }
    if (value < 0) {
      return "overdue by " + seconds(-value);
    }
    if (value < 10) {
      return value.toFixed(1) + " s";
    }
    const whole = Math.floor(value);
    const units = [["d", 86400, "h", 3600], ["h", 3600, "min", 60], ["min", 60, "s", 1]];
    for (const [unit, size, smaller, smallerSize] of units) {
      if (whole >= size) {
        return Math.floor(whole / size) + " " + unit + " " +
          Math.floor((whole % size) / smallerSize) + " " + smaller;
      }
    }
    return whole + " s";
  }

  function utc(value) {
    return value ? new Date(value).toISOString().replace("T", " ").slice(0, 19) : "—";
  }

  function link(href, text) {
    const anchor = document.createElement("a");
    anchor.href = href;
    anchor.textContent = text;
    return anchor;
  }

  // A cell for `row[key]` in the format its column header names. A countdown
  // header's data-past is what its cells say once zero has passed ("ended");
  // without it they count on as "overdue by ...".
  function cell(row, header) {
    const td = document.createElement("td");
    const value = row[header.dataset.key];
    switch (header.dataset.format) {
      case "link":
        td.append(link(row.url, value));
        break;
      case "action":
        if (value) {
          td.append(link(value, header.dataset.label));
        }
        break;
      case "usage":
        td.textContent = row.holders + " / " + row.limit;
        break;
      case "countdown":
      case "elapsed":
        if (value === null || value === undefined) {
          td.textContent = header.dataset.none || "—";
        } else {
          td.dataset[header.dataset.format] = value;
          if (header.dataset.past) {
            td.dataset.past = header.dataset.past;
          }
        }
        break;
      case "seconds":
        td.textContent = seconds(value);
        break;
      case "utc":
        td.textContent = utc(value);
        break;
      case "list":
        td.textContent = value.join(", ");
        if (row.stuck) {
          td.className = "djlocks-stuck";
        }
        break;
      case "flag":
        td.textContent = value ? header.dataset.yes : header.dataset.no;
        break;
      case "svg":
        // Drawn and escaped on the server (djlocks.charts), like the page itself.
        td.innerHTML = value;
        break;
      case "stuck":
        if (value === null || value === undefined) {
          td.textContent = "—";
        } else {
          td.textContent = "stuck: usually held " + seconds(value) + " (p95)";
          td.className = "djlocks-stuck";
        }
        break;
      default:
        td.textContent =
          value === null || value === undefined || value === "" ? header.dataset.none || "—" : value;
    }
    return td;
  }

  function redraw(table, rows) {
    const headers = Array.from(table.querySelectorAll("thead th"));
    const body = table.querySelector("tbody");
    body.replaceChildren();
    for (const row of rows) {
      const tr = document.createElement("tr");
      for (const header of headers) {
        tr.append(cell(row, header));
      }
      body.append(tr);
    }
    if (!rows.length) {
      const tr = document.createElement("tr");
      const td = document.createElement("td");
      td.colSpan = headers.length;
      td.textContent = table.dataset.empty || "None.";
      tr.append(td);
      body.append(tr);
    }
  }

  let stamped = performance.now();

  // Countdowns fall and waits grow from the values of the last fetch.
  function tick() {
    const passed = (performance.now() - stamped) / 1000;
    for (const td of root.querySelectorAll("[data-countdown]")) {
      const left = Number(td.dataset.countdown) - passed;
      td.textContent = left < 0 && td.dataset.past ? td.dataset.past : seconds(left);
    }
    for (const td of root.querySelectorAll("[data-elapsed]")) {
      td.textContent = seconds(Number(td.dataset.elapsed) + passed);
    }
  }

  function show(data) {
    for (const table of root.querySelectorAll("table[data-source]")) {
      redraw(table, data[table.dataset.source] || []);
    }
    for (const element of root.querySelectorAll("[data-value]")) {
      const path = element.dataset.value.split(".");
      const value = path.reduce((object, key) => (object ? object[key] : undefined), data);
      element.textContent = element.dataset.format === "seconds" ? seconds(value) : value;
    }
    stamped = performance.now();
    tick();
  }

  async function refresh() {
    try {
      const response = await fetch(root.dataset.djlocksJson, {
        credentials: "same-origin",
        headers: { Accept: "application/json" },
      });
      if (response.ok) {
        show(await response.json());
        root.classList.remove("djlocks-stale");
      } else {
        root.classList.add("djlocks-stale");
      }
    } catch (error) {
      root.classList.add("djlocks-stale");
    }
  }

  tick();
  setInterval(tick, 1000);
  setInterval(refresh, every);
})();
