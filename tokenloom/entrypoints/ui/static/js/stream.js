/* Server-sent events over fetch() (EventSource cannot send the API key): yields each
   `data:` JSON object of an OpenAI streaming response until [DONE]. Aborting the
   AbortSignal closes the connection, which makes the server abort the request. */
"use strict";
TL.streamJSON = async function* (path, body, signal) {
  const r = await TL.api(path, {
    method: "POST", signal, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  if (!r.ok) throw new Error(`${r.status}: ${await TL.errorText(r)}`);
  const reader = r.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message || JSON.stringify(obj.error));
        yield obj;
      }
    }
  }
};

/* Sampling fields shared by both playgrounds, read from inputs named <prefix><field>. */
TL.samplingParams = (prefix) => {
  const v = (name) => TL.$(prefix + name).value.trim();
  const body = {};
  for (const [name, parse] of [["temperature", parseFloat], ["top_p", parseFloat], ["top_k", (x) => parseInt(x, 10)],
                               ["max_tokens", (x) => parseInt(x, 10)], ["seed", (x) => parseInt(x, 10)]]) {
    if (v(name) !== "") body[name] = parse(v(name));
  }
  const stop = TL.$(prefix + "stop").value.split("\n").filter((s) => s.length);
  if (stop.length) body.stop = stop;
  const model = TL.$("model-picker").value;
  if (model) body.model = model;
  return body;
};

/* The model picker: /v1/models (the base model and any LoRA adapters, "parent" naming an adapter's base),
   refreshed when opened so adapters loaded at run time appear. Hidden while there is only one model. */
TL.loadModels = async () => {
  if (!TL.ready()) return;
  const picker = TL.$("model-picker");
  let data;
  try {
    const r = await TL.api("v1/models");
    if (!r.ok) return;
    data = (await r.json()).data || [];
  } catch (e) { return; }
  const chosen = picker.value;
  picker.replaceChildren(...data.map((m) => {
    const o = TL.el("option", m.parent ? `${m.id} (LoRA on ${m.parent})` : m.id);
    o.value = m.id;
    return o;
  }));
  if (data.some((m) => m.id === chosen)) picker.value = chosen;
  picker.hidden = data.length < 2;
};
TL.$("model-picker").addEventListener("focus", TL.loadModels);
TL.loadModels();

/* TTFT and TPOT as this page saw them (network included). */
TL.timing = (t0, tFirst, tLast, tokens) => {
  const parts = [];
  if (tFirst) parts.push("TTFT " + TL.fmt.secs((tFirst - t0) / 1000));
  if (tFirst && tLast && tokens > 1) parts.push("TPOT " + TL.fmt.secs((tLast - tFirst) / 1000 / (tokens - 1)));
  return parts.join(" · ");
};
