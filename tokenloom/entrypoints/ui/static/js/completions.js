/* The completions playground: raw text streamed token by token, each token a <span> whose
   hover shows its logprob and the top alternatives (from the `logprobs` field). */
"use strict";
(() => {
  const $ = TL.$;
  let controller = null;

  function busy(on) { $("comp-send").disabled = on; $("comp-stop").disabled = !on; }

  function tokenSpan(tok, lp, top) {
    const s = TL.el("span", tok, "tok");
    const lines = [`${JSON.stringify(tok)}  logprob ${lp === null || lp === undefined ? "–" : lp.toFixed(3)}`];
    if (lp !== null && lp !== undefined) lines[0] += `  p=${(100 * Math.exp(lp)).toFixed(1)}%`;
    for (const [alt, alp] of Object.entries(top || {}).sort((a, b) => b[1] - a[1])) {
      lines.push(`${JSON.stringify(alt).padEnd(16)} ${alp.toFixed(3)}`);
    }
    s.dataset.logprob = lp === null || lp === undefined ? "" : String(lp);
    s.addEventListener("mousemove", (e) => TL.tooltip.show(e, lines.join("\n")));
    s.addEventListener("mouseleave", TL.tooltip.hide);
    return s;
  }

  async function complete() {
    if (controller) return;
    $("cp-error").textContent = "";
    const prompt = $("comp-prompt").value;
    const body = TL.samplingParams("cp-");
    const top = parseInt($("cp-logprobs").value, 10);
    body.prompt = prompt;
    body.logprobs = Number.isFinite(top) ? top : 0;
    body.stream = true;
    body.stream_options = { include_usage: true };
    const out = $("comp-out");
    out.querySelector(".prompt-echo").textContent = prompt;
    const tokens = out.querySelector(".tokens");
    tokens.replaceChildren();
    $("comp-stats").textContent = "";
    let usage = null, finish = null, tFirst = 0, tLast = 0, count = 0;
    controller = new AbortController();
    busy(true);
    const t0 = performance.now();
    try {
      for await (const chunk of TL.streamJSON("v1/completions", body, controller.signal)) {
        if (chunk.usage) usage = chunk.usage;
        const c = chunk.choices && chunk.choices[0];
        if (!c) continue;
        const lp = c.logprobs;
        if (lp && lp.tokens && lp.tokens.length) {
          lp.tokens.forEach((tok, i) => tokens.appendChild(tokenSpan(tok, lp.token_logprobs[i], lp.top_logprobs && lp.top_logprobs[i])));
        } else if (c.text) {
          tokens.appendChild(TL.el("span", c.text, "tok"));
        }
        if (c.text) { tLast = performance.now(); if (!tFirst) tFirst = tLast; count += lp && lp.tokens ? lp.tokens.length : 1; }
        if (c.finish_reason) finish = c.finish_reason;
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else { $("cp-error").textContent = e.message; finish = "error"; }
    } finally {
      controller = null;
      busy(false);
    }
    const parts = [finish || ""];
    if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    parts.push(TL.timing(t0, tFirst, tLast, usage ? usage.completion_tokens : count));
    $("comp-stats").textContent = parts.filter(Boolean).join(" · ");
  }

  $("comp-send").addEventListener("click", complete);
  $("comp-stop").addEventListener("click", () => { if (controller) controller.abort(); });
})();
