/* The live engine view: polls ui/api/status about once a second and fills the cards,
   charts and tables. Every value goes in as text. */
"use strict";
(() => {
  const $ = TL.$, f = TL.fmt;
  const set = (id, text) => { $(id).textContent = text; };

  function header(h, healthy) {
    set("hdr-model", h.model);
    if (TL.onImageInput) TL.onImageInput(Boolean(h.image_input));
    set("hdr-dtype", `${h.dtype} · KV ${h.kv_cache_dtype || h.dtype}${h.device ? " · " + h.device : ""}`);
    const size = h.weights_bytes ? `, ${f.num(h.weights_bytes / 2 ** 20, 0)} MiB` : "";
    set("hdr-quant", `${h.weights_file || "weights"} (${h.quantization}${size})`);
    set("hdr-kv", `KV ${h.kv_blocks} blocks × ${h.block_size} tokens · max len ${h.max_model_len}`);
    set("hdr-version", "v" + h.version);
    set("hdr-health", healthy ? "healthy" : "engine down");
    $("hdr-health").className = "chip " + (healthy ? "ok" : "bad");
  }

  function rows(tbody, items, cells) {
    const frag = document.createDocumentFragment();
    for (const item of items) {
      const tr = document.createElement("tr");
      for (const c of cells(item)) tr.appendChild(TL.el("td", c));
      frag.appendChild(tr);
    }
    tbody.replaceChildren(frag);
  }

  function render(s) {
    header(s.header, s.healthy);
    set("m-running", s.running); set("m-waiting", s.waiting);
    set("m-kv", f.pct(s.kv_cache_usage)); set("m-kv-blocks", `${s.kv_blocks_used} / ${s.kv_blocks_total} blocks`);
    set("m-hit", f.pct(s.prefix_cache_hit_rate));
    set("m-ptps", f.num(s.prompt_tps, 1)); set("m-ptotal", `${s.prompt_tokens_total} total`);
    set("m-gtps", f.num(s.generation_tps, 1)); set("m-gtotal", `${s.generation_tokens_total} total`);
    set("m-budget", f.pct(s.budget_use)); set("m-budget-of", `of ${s.header.max_num_batched_tokens} tokens a step`);
    set("m-preempt", s.num_preemptions);
    for (const tr of document.querySelectorAll("#latency tbody tr")) {
      const l = s.latency[tr.dataset.key], td = tr.querySelectorAll("td");
      td[0].textContent = f.secs(l.p50); td[1].textContent = f.secs(l.p90); td[2].textContent = f.secs(l.p99);
      td[3].textContent = l.count;
    }
    const hist = s.history;
    TL.chart($("c-reqs"), [{ color: "#3756d6", points: hist.map((p) => [p.t, p.running]) },
                           { color: "#d68a37", points: hist.map((p) => [p.t, p.waiting]) }]);
    TL.chart($("c-kv"), [{ color: "#3756d6", points: hist.map((p) => [p.t, p.kv_cache_usage]) }],
             { max: 1, label: () => "100 %" });
    TL.chart($("c-gtps"), [{ color: "#1b7a33", points: hist.map((p) => [p.t, p.generation_tps]) }]);
    TL.chart($("c-ptps"), [{ color: "#7a1b6b", points: hist.map((p) => [p.t, p.prompt_tps]) }]);
    set("req-count", `(${s.requests.length})`);
    rows($("requests").tBodies[0], s.requests,
         (r) => [r.id, r.state, r.prompt_tokens, r.output_tokens, f.secs(r.age)]);
    const batches = s.batches || [];
    set("batch-count", `(${batches.length})`);
    rows($("batches").tBodies[0], batches,
         (b) => [b.id, b.status, b.endpoint, b.completed, b.failed, b.total]);
    const ul = $("errors"), frag = document.createDocumentFragment();
    for (const e of s.errors) frag.appendChild(TL.el("li", `${new Date(e.time * 1000).toLocaleTimeString()} ${e.level} ${e.message}`));
    ul.replaceChildren(frag);
  }

  async function poll() {
    if (!TL.ready()) { setTimeout(poll, 300); return; }
    try {
      const r = await TL.api("ui/api/status", { cache: "no-store" });
      if (r.ok) render(await r.json());
      else if (r.status !== 401) set("hdr-health", "status " + r.status);
    } catch (e) {
      set("hdr-health", "server unreachable");
      $("hdr-health").className = "chip bad";
    }
    setTimeout(poll, 1000);
  }
  poll();
})();
