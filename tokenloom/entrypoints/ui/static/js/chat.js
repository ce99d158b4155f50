/* The chat playground: system prompt, multi-turn history, streamed markdown answers with
   reasoning apart, tool calls, response formats, per-message usage and timings, a stop
   button that aborts the request on the server (by closing the stream), and images (picked
   or pasted) sent as image_url parts when the model takes them. */
"use strict";
(() => {
  const $ = TL.$;
  let history = [];
  let controller = null;
  let images = [];  // data: URLs attached to the message being written
  /* The server checks bytes and pixels itself (docs/multimodal.md); this spares uploading a file that cannot pass. */
  const MAX_IMAGE_BYTES = 20 * 2 ** 20;

  function showAttachments() {
    const frag = document.createDocumentFragment();
    images.forEach((url, i) => {
      const fig = document.createElement("figure");
      const img = document.createElement("img");
      img.src = url;
      img.alt = "attached image " + (i + 1);
      const remove = TL.el("button", "×");
      remove.title = "remove";
      remove.addEventListener("click", () => { images.splice(i, 1); showAttachments(); });
      fig.append(img, remove);
      frag.appendChild(fig);
    });
    $("chat-attachments").replaceChildren(frag);
  }

  function attach(files) {
    for (const file of files) {
      if (!file.type.startsWith("image/")) { $("p-error").textContent = `${file.name || "that file"} is not an image`; continue; }
      if (file.size > MAX_IMAGE_BYTES) { $("p-error").textContent = `${file.name || "the image"} is over 20 MiB`; continue; }
      const reader = new FileReader();
      reader.onload = () => { images.push(reader.result); showAttachments(); };
      reader.readAsDataURL(file);
    }
  }

  /* The header says whether the served model takes images; the attach button shows only then. */
  TL.onImageInput = (on) => { $("chat-attach").hidden = !on; };
  $("chat-attach").addEventListener("click", () => $("chat-image").click());
  $("chat-image").addEventListener("change", (e) => { attach(e.target.files); e.target.value = ""; });
  $("chat-input").addEventListener("paste", (e) => {
    if ($("chat-attach").hidden) return;
    const files = Array.from(e.clipboardData.files || []).filter((f) => f.type.startsWith("image/"));
    if (files.length) { e.preventDefault(); attach(files); }
  });

  $("p-format").addEventListener("change", () => { $("p-schema-wrap").hidden = $("p-format").value !== "json_schema"; });

  function options() {
    const body = TL.samplingParams("p-");
    const format = $("p-format").value;
    if (format === "json_object") body.response_format = { type: "json_object" };
    if (format === "json_schema") {
      body.response_format = { type: "json_schema", json_schema: { name: "schema", schema: JSON.parse($("p-schema").value) } };
    }
    const tools = $("p-tools").value.trim();
    if (tools) body.tools = JSON.parse(tools);
    return body;
  }

  function bubble(role) {
    const m = TL.el("div", null, "msg " + role);
    m.appendChild(TL.el("div", role, "role"));
    const reasoning = TL.el("details", null, "reasoning");
    reasoning.appendChild(TL.el("summary", "reasoning"));
    const reasoningText = TL.el("div");
    reasoning.appendChild(reasoningText);
    reasoning.hidden = true;
    const content = TL.el("div", null, "content");
    const tools = TL.el("div", null, "tools"); tools.hidden = true;
    const meta = TL.el("div", null, "meta");
    m.append(reasoning, content, tools, meta);
    $("chat-log").appendChild(m);
    return { m, reasoning, reasoningText, content, tools, meta };
  }

  function busy(on) { $("chat-send").disabled = on; $("chat-stop").disabled = !on; }

  async function send() {
    const text = $("chat-input").value;
    if ((!text.trim() && !images.length) || controller) return;
    $("p-error").textContent = "";
    let body;
    try { body = options(); } catch (e) { $("p-error").textContent = "Response format / tools: " + e.message; return; }
    $("chat-input").value = "";
    const user = TL.el("div", null, "msg user");
    user.append(TL.el("div", "user", "role"), TL.el("div", text, "content"));
    if (images.length) {
      const shown = TL.el("div", null, "images");
      for (const url of images) { const img = document.createElement("img"); img.src = url; img.alt = "your image"; shown.appendChild(img); }
      user.appendChild(shown);
    }
    $("chat-log").appendChild(user);
    const imageParts = images.map((url) => ({ type: "image_url", image_url: { url } }));
    const textParts = text.trim() ? [{ type: "text", text }] : [];
    history.push({ role: "user", content: imageParts.length ? textParts.concat(imageParts) : text });
    images = [];
    showAttachments();
    const system = $("chat-system").value.trim();
    body.messages = (system ? [{ role: "system", content: system }] : []).concat(history);
    body.stream = true;
    body.stream_options = { include_usage: true };
    const b = bubble("assistant");
    let content = "", reasoning = "", usage = null, finish = null, tFirst = 0, tLast = 0, chunks = 0;
    const calls = [];
    controller = new AbortController();
    busy(true);
    const t0 = performance.now();
    try {
      for await (const chunk of TL.streamJSON("v1/chat/completions", body, controller.signal)) {
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const d = choice.delta || {};
        const r = d.reasoning_content || d.reasoning || "";
        if (d.content || r || d.tool_calls) { tLast = performance.now(); if (!tFirst) tFirst = tLast; chunks++; }
        if (r) { reasoning += r; b.reasoning.hidden = false; b.reasoningText.textContent = reasoning; }
        if (d.content) { content += d.content; TL.setMarkdown(b.content, content); }
        for (const tc of d.tool_calls || []) {
          const c = (calls[tc.index || 0] = calls[tc.index || 0] || { id: tc.id, type: "function", function: { name: "", arguments: "" } });
          if (tc.id) c.id = tc.id;
          if (tc.function && tc.function.name) c.function.name += tc.function.name;
          if (tc.function && tc.function.arguments) c.function.arguments += tc.function.arguments;
          b.tools.hidden = false;
          b.tools.textContent = calls.map((x) => `${x.function.name}(${x.function.arguments})`).join("\n");
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else { b.m.classList.add("error"); b.content.textContent = content + (content ? "\n" : "") + e.message; finish = "error"; }
    } finally {
      controller = null;
      busy(false);
    }
    const msg = { role: "assistant", content };
    if (calls.length) msg.tool_calls = calls;
    if (content || calls.length) history.push(msg);
    const tokens = usage ? usage.completion_tokens : chunks;
    const parts = [finish || ""];
    if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    parts.push(TL.timing(t0, tFirst, tLast, tokens));
    b.meta.textContent = parts.filter(Boolean).join(" · ");
  }

  $("chat-send").addEventListener("click", send);
  $("chat-stop").addEventListener("click", () => { if (controller) controller.abort(); });
  $("chat-clear").addEventListener("click", () => { history = []; $("chat-log").replaceChildren(); });
  $("chat-input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
})();
