// duet console: the one script (no inline scripts; the CSP allows only this origin's files).
// A region with data-refresh="URL" is re-read from the server every 3 s while the tab is
// visible (the cluster page's live view); the server renders and escapes the HTML.
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  for (const el of document.querySelectorAll("[data-refresh]")) {
    const url = el.getAttribute("data-refresh");
    setInterval(async () => {
      if (document.hidden) return;
      try {
        const r = await fetch(url, { credentials: "same-origin", headers: { Accept: "text/html" } });
        if (r.redirected || r.status === 401) location.assign("/console/login?expired=1");
        else if (r.ok) {
          const before = el.querySelector("[data-summary]")?.getAttribute("data-summary");
          el.innerHTML = await r.text();
          const after = el.querySelector("[data-summary]")?.getAttribute("data-summary");
          const status = document.getElementById("live-status");
          // announce the nodes' summary when it changes, never the whole tables
          if (status && after && after !== before) status.textContent = after;
        }
      } catch (e) { /* the next tick tries again */ }
    }, 3000);
  }
  const key = document.getElementById("new-key");
  if (key) { key.focus(); key.select(); }
});
