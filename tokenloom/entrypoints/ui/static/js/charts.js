/* Tiny time-series charts on <canvas>: a line per series over the last minute. Hand-written
   (40 lines) because a charting library would be larger than the whole page. */
"use strict";
TL.chart = (canvas, series, opts = {}) => {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 300, h = canvas.clientHeight || 70;
  if (canvas.width !== w * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const now = Date.now() / 1000, span = 60;
  let max = opts.max || 0;
  for (const s of series) for (const [, v] of s.points) max = Math.max(max, v || 0);
  if (!max) max = 1;
  ctx.strokeStyle = "#dedee3"; ctx.lineWidth = 1;
  ctx.beginPath(); ctx.moveTo(0, h - 0.5); ctx.lineTo(w, h - 0.5); ctx.stroke();
  ctx.fillStyle = "#6b6b73"; ctx.font = "10px system-ui";
  ctx.fillText(opts.label ? opts.label(max) : String(Math.round(max)), 2, 10);
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.5; ctx.beginPath();
    s.points.forEach(([t, v], i) => {
      const x = w - ((now - t) / span) * w, y = h - 2 - ((v || 0) / max) * (h - 14);
      if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
    });
    ctx.stroke();
  }
};
