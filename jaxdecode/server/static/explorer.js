// The decoding explorer's page: every number shown comes from the server's /explore/ endpoints,
// which compute it with the library's own rules and loops; this file only draws.

const $ = (id) => document.getElementById(id);
const state = { info: null, path: [], seeded: null, lastNextMs: null, nextSeq: 0 };

// --------------------------------------------------------------------------- helpers

// a server started with --api-key wants it on /explore/ too; it is kept for this tab only
function headers() {
  const key = sessionStorage.getItem("jaxdecode-api-key");
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function post(url, body) {
  const r = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json", ...headers() }, body: JSON.stringify(body) });
  const data = await r.json();
  if (!r.ok) throw new Error(data.error ? data.error.message : `${r.status}`);
  return data;
}

function status(text, error = false) {
  const s = $("status");
  s.textContent = text;
  s.classList.toggle("error", error);
}

// a token's text with its white space made visible
export function shown(text) {
  return text.replace(/\n/g, "⏎").replace(/\t/g, "⇥").replace(/ /g, "␣") || "∅";
}

const fix = (x, d = 4) => (x === null || x === undefined ? "−∞" : Number(x).toFixed(d));

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function settings() {
  const out = {};
  for (const input of document.querySelectorAll("#rules input")) {
    if (input.value.trim() === "") continue;
    out[input.dataset.rule] = input.dataset.integer === "1" ? parseInt(input.value, 10) : parseFloat(input.value);
  }
  return out;
}

const prompt = () => $("prompt").value;

// --------------------------------------------------------------------------- next token and step

async function updateNext() {
  const seq = ++state.nextSeq;
  const t0 = performance.now();
  let data;
  try {
    data = await post("/explore/next", { prompt: prompt(), path: state.path.map((s) => s.token), settings: settings(), top: 30 });
  } catch (e) {
    if (seq === state.nextSeq) status(e.message, true);
    return;
  }
  if (seq !== state.nextSeq) return; // a later change is on its way
  drawBars(data);
  state.lastNextMs = performance.now() - t0;
  document.body.dataset.nextMs = state.lastNextMs.toFixed(1);
  document.body.dataset.nextSeq = String(seq);
  status(`next token: ${data.kept} of ${data.vocab_size} tokens kept · updated in ${state.lastNextMs.toFixed(0)} ms`);
}

function drawBars(data) {
  const top = Math.max(...data.tokens.map((t) => Math.max(t.prob, t.processed_prob)), 1e-9);
  const list = $("bars");
  list.replaceChildren();
  const stages = data.stages.map((s) => `${s.rule} keeps ${s.kept}`).join(", ");
  $("next-summary").textContent = `(entropy ${fix(data.entropy, 3)} → ${fix(data.processed_entropy, 3)} nats` +
    (stages ? `; ${stages})` : ")");
  for (const t of data.tokens) {
    const raw = el("span", { class: "raw" });
    raw.style.width = `${(100 * t.prob) / top}%`;
    const kept = el("span", { class: "kept" });
    kept.style.width = `${(100 * t.processed_prob) / top}%`;
    const li = el("li", { class: "bar" + (t.cut_by ? " cut" : ""), tabindex: "0", role: "button",
      "data-token": String(t.token), "data-cut-by": t.cut_by || "",
      "aria-label": `${shown(t.text)}: p ${fix(t.prob)}, after the rules ${fix(t.processed_prob)}` + (t.cut_by ? `, cut by ${t.cut_by}` : "") },
    el("span", { class: "tok", text: shown(t.text) }), el("span", { class: "track" }, raw, kept),
    el("span", { class: "num prob", text: fix(t.prob) }), el("span", { class: "num processed", text: fix(t.processed_prob) }),
    el("span", { class: "why", text: t.cut_by ? `cut: ${t.cut_by}` : "" }));
    const pick = () => append({ token: t.token, text: t.text, prob: t.prob, processed_prob: t.processed_prob, logprob: t.logprob, how: "clicked" });
    li.addEventListener("click", pick);
    li.addEventListener("keydown", (e) => { if (e.key === "Enter" || e.key === " ") { e.preventDefault(); pick(); } });
    list.append(li);
  }
}

function append(step) {
  state.path.push(step);
  state.seeded = null; // a clicked token ends the seed's own path
  drawPath();
  updateNext();
}

function drawPath() {
  const body = $("path").querySelector("tbody");
  body.replaceChildren();
  let total = 0;
  state.path.forEach((s, i) => {
    total += s.logprob ?? -Infinity;
    body.append(el("tr", {}, el("td", { text: String(i + 1) }), el("td", { class: "tok", text: shown(s.text) }),
      el("td", { class: "num", text: fix(s.prob) }), el("td", { class: "num", text: fix(s.processed_prob) }),
      el("td", { class: "num", text: fix(total) }), el("td", { text: s.how })));
  });
  $("path-prompt").textContent = prompt();
  $("path-text").textContent = state.path.map((s) => s.text).join("");
}

async function draw() {
  const seed = parseInt($("seed").value || "0", 10);
  const n = parseInt($("draw-n").value || "1", 10);
  const greedy = $("greedy").checked;
  const key = JSON.stringify([seed, greedy, settings(), prompt()]);
  // the seed's own path continues as generate would; after clicked tokens, the loop restarts there
  const fromStart = state.path.length === 0 || state.seeded === key;
  const body = { prompt: prompt(), settings: settings(), seed, greedy, n: fromStart ? state.path.length + n : n,
    path: fromStart ? [] : state.path.map((s) => s.token) };
  status("drawing…");
  try {
    const data = await post("/explore/sample", body);
    const steps = data.steps.map((s) => ({ ...s, how: greedy ? "greedy" : `seed ${seed}` }));
    state.path = fromStart ? steps : state.path.concat(steps);
    state.seeded = fromStart ? key : null;
    drawPath();
    await updateNext();
  } catch (e) { status(e.message, true); }
}

// --------------------------------------------------------------------------- compare

async function runCompare() {
  status("comparing… (the first run compiles the programs)");
  const seeds = $("cmp-seeds").value.split(",").map((s) => s.trim()).filter(Boolean).map(Number);
  try {
    const data = await post("/explore/compare", { prompt: prompt(), n: +$("cmp-n").value, k: +$("cmp-k").value, seeds, settings: settings() });
    const body = $("compare").querySelector("tbody");
    body.replaceChildren();
    for (const r of data.rows) {
      body.append(el("tr", { "data-method": r.method }, el("td", { text: r.method }),
        el("td", { class: "tok", text: r.skipped ? `(${r.skipped})` : shown(r.text) }),
        el("td", { class: "num", text: r.skipped ? "" : fix(r.logprob) }),
        el("td", { class: "num", text: r.skipped ? "" : fix(r.mean_logprob) })));
    }
    status("compared");
  } catch (e) { status(e.message, true); }
}

// --------------------------------------------------------------------------- beam tree

async function runBeam() {
  status("searching…");
  try {
    const data = await post("/explore/beam", { prompt: prompt(), n: +$("beam-n").value, k: +$("beam-k").value,
      pruned: +$("beam-pruned").value, settings: settings() });
    drawTree(data);
    status("searched");
  } catch (e) { status(e.message, true); }
}

function drawTree(data) {
  const svg = $("tree");
  const NS = "http://www.w3.org/2000/svg";
  const W = 120, H = 26, GAP = 8;
  svg.replaceChildren();
  const rows = data.levels.map((lv) => lv.survivors.concat(lv.pruned));
  const height = Math.max(1, ...rows.map((r) => r.length)) * (H + GAP) + GAP;
  svg.setAttribute("width", String((data.levels.length + 1) * (W + 40)));
  svg.setAttribute("height", String(height));
  const pos = { root: [10, height / 2 - H / 2] };
  const finals = new Set(data.final.map((f) => f.tokens.join(",")));
  const node = (x, y, label, cls, id) => {
    const g = document.createElementNS(NS, "g");
    g.setAttribute("class", cls);
    if (id) g.setAttribute("data-id", id);
    const r = document.createElementNS(NS, "rect");
    Object.entries({ x, y, width: W, height: H, rx: 4 }).forEach(([k, v]) => r.setAttribute(k, v));
    const t = document.createElementNS(NS, "text");
    t.setAttribute("x", x + 5); t.setAttribute("y", y + 17);
    t.textContent = label;
    g.append(r, t);
    svg.append(g);
  };
  node(10, pos.root[1], "prompt", "survivor", "root");
  data.levels.forEach((lv, i) => {
    const x = 10 + (i + 1) * (W + 40);
    rows[i].forEach((n, j) => {
      const y = GAP + j * (H + GAP);
      pos[n.id] = [x, y];
      const from = pos[n.parent];
      if (from) {
        const line = document.createElementNS(NS, "line");
        Object.entries({ x1: from[0] + W, y1: from[1] + H / 2, x2: x, y2: y + H / 2 }).forEach(([k, v]) => line.setAttribute(k, v));
        line.setAttribute("class", "edge" + (n.survived ? "" : " pruned"));
        svg.prepend(line);
      }
      const last = i === data.levels.length - 1 && n.survived && finals.has(n.tokens.join(","));
      node(x, y, `${shown(n.text)}  ${fix(n.score, 2)}`, last ? "final" : n.survived ? "survivor" : "pruned", n.id);
    });
  });
  const list = $("beam-final");
  list.replaceChildren();
  for (const f of data.final) {
    list.append(el("li", { class: "tok", "data-text": f.text, text: `${shown(f.text)}   score ${fix(f.score)}   log p ${fix(f.logprob)}` }));
  }
}

// --------------------------------------------------------------------------- speculative

async function runSpeculative() {
  status("running…");
  try {
    const data = await post("/explore/speculative", { prompt: prompt(), n: +$("spec-n").value, gamma: +$("spec-gamma").value,
      seed: +$("spec-seed").value, greedy: $("spec-greedy").checked, draft: $("spec-draft").value, settings: settings() });
    const st = data.stats;
    $("spec-summary").textContent = `${shown(data.text)} — ${st.passes} target passes, ${st.accepted} of ${st.examined} ` +
      `examined proposals accepted (acceptance rate ${fix(st.acceptance_rate, 3)}), ${fix(st.chars_per_pass, 2)} tokens per pass`;
    const list = $("spec-passes");
    list.replaceChildren();
    for (const p of data.passes) {
      const li = el("li");
      p.proposals.forEach((q, j) => li.append(el("span", { class: q.accepted ? "acc" : j < p.examined ? "rej" : "skip",
        title: q.accepted ? "accepted" : j < p.examined ? "rejected" : "not examined", text: shown(q.text) })));
      li.append(" → ", el("span", { class: "tgt", title: "the target's token", text: shown(p.text) }));
      list.append(li);
    }
    status("ran");
  } catch (e) { status(e.message, true); }
}

// --------------------------------------------------------------------------- constrained

async function runConstrained() {
  status("running…");
  const kind = $("con-kind").value;
  const text = $("con-pattern").value;
  const body = { prompt: prompt(), n: +$("con-n").value, seed: +$("con-seed").value, greedy: $("con-greedy").checked, settings: settings() };
  if (kind === "regex") body.regex = text; else body.choices = text.split("\n").filter((s) => s.length);
  try {
    const data = await post("/explore/constrained", body);
    $("con-summary").textContent = `${shown(data.text)} — ${data.accepted ? "in" : "not in"} the language; finished: ${data.finish_reason}`;
    const list = $("con-steps");
    list.replaceChildren();
    for (const s of data.steps) {
      const li = el("li", {}, el("span", { class: "tgt", text: shown(s.text) }), ` (${s.allowed} allowed; p ${fix(s.logprob === null ? 0 : Math.exp(s.logprob))}) `);
      for (const c of s.candidates) li.append(el("span", { class: c.masked ? "masked" : "allowed", title: c.masked ? "masked" : "allowed", text: `${shown(c.text)}:${fix(c.prob, 3)}` }));
      list.append(li);
    }
    status("ran");
  } catch (e) { status(e.message, true); }
}

// --------------------------------------------------------------------------- set-up

function selectTab(tab) {
  for (const t of document.querySelectorAll("nav [role=tab]")) {
    const on = t === tab;
    t.setAttribute("aria-selected", String(on));
    $(t.getAttribute("aria-controls")).hidden = !on;
  }
}

async function start() {
  $("key-box").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("jaxdecode-api-key", $("api-key").value);
    location.reload();
  });
  try {
    const r = await fetch("/explore/info", { headers: headers() });
    if (r.status === 401) {
      $("key-box").hidden = false;
      status("this server needs its API key", true);
      return;
    }
    state.info = await r.json();
    if (!r.ok) throw new Error(state.info.error ? state.info.error.message : `${r.status}`);
  } catch (e) { status(`the explorer is not available: ${e.message}`, true); return; }
  const info = state.info;
  $("model").textContent = `${info.vocab_size} tokens, window ${info.window}` + (info.speculative ? "" : " · no speculative runs");
  const box = $("rules");
  for (const r of info.rules) {
    const input = el("input", { type: "number", id: `rule-${r.name}`, step: r.integer ? "1" : "any", min: "0",
      "data-rule": r.name, "data-integer": r.integer ? "1" : "0", placeholder: r.neutral === null ? "" : String(r.neutral) });
    if (info.defaults[r.name] !== undefined) input.value = info.defaults[r.name];
    const label = el("label", { for: input.id, title: r.help, text: r.name.replace(/_/g, " ") });
    label.append(input);
    box.append(label);
    input.addEventListener("input", () => { updateNext(); });
  }
  let timer = null;
  $("prompt").addEventListener("input", () => {
    clearTimeout(timer);
    state.path = []; state.seeded = null; drawPath();
    timer = setTimeout(updateNext, 150);
  });
  for (const t of document.querySelectorAll("nav [role=tab]")) t.addEventListener("click", () => selectTab(t));
  $("draw").addEventListener("click", draw);
  $("undo").addEventListener("click", () => { state.path.pop(); state.seeded = null; drawPath(); updateNext(); });
  $("clear").addEventListener("click", () => { state.path = []; state.seeded = null; drawPath(); updateNext(); });
  $("cmp-run").addEventListener("click", runCompare);
  $("beam-run").addEventListener("click", runBeam);
  $("spec-run").addEventListener("click", runSpeculative);
  $("con-run").addEventListener("click", runConstrained);
  drawPath();
  await updateNext();
  document.body.dataset.ready = "1";
}

start();
