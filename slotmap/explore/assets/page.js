// slotmap explore: shows the numbers spec computed for each step (embedded as JSON above) and highlights
// one token's path through them. Nothing here computes a mapping: every index, position, block and slot
// is read from the data; the page only chooses what to show and what to highlight.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("slotmap-data").textContent);
  const STEPS = DATA.steps;
  const GROUPS = DATA.config.groups;
  const MAX_DRAWN_BLOCKS = 1024; // a larger group lists only the blocks some table holds
  const view = { step: 0, flat: 0 };

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else if (key === "style") node.style.cssText = value;
      else node.setAttribute(key, value);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }
  const req = (r) => DATA.reqs[r];
  const colour = (r) => DATA.colours[r];
  function reqLabel(r) {
    return el("span", { class: "req-label" }, el("span", { class: "swatch", style: `background:${colour(r)}`, "aria-hidden": "true" }), req(r));
  }
  const list = (xs) => "[" + xs.join(", ") + "]";
  const tables = (perGroup) => perGroup.map(list).join(" / ");
  function groupName(g) {
    const group = GROUPS[g];
    const window = group.window === null ? "" : ", window " + group.window;
    // an mla group: each slot holds one latent vector (kv_c, then the RoPE key part k_pe)
    const latent = group.latent ? `, MLA latent ${group.latent[0]} + rope ${group.latent[1]} per slot` : "";
    return `group ${g} (block_size ${group.block_size}${window}${latent})`;
  }
  const pairs = (flat) => { const out = []; for (let i = 0; i + 1 < (flat || []).length; i += 2) out.push([flat[i], flat[i + 1]]); return out; };

  // ---- the static part --------------------------------------------------------------------
  const slider = document.getElementById("step-slider");
  slider.max = String(STEPS.length);
  document.getElementById("config").textContent =
    `${DATA.config.max_num_reqs} rows, max_model_len ${DATA.config.max_model_len}, ` +
    `${DATA.config.max_num_batched_tokens} tokens per step; ` +
    GROUPS.map((g, i) => `${groupName(i)}: ${g.num_blocks} blocks`).join("; ");
  const legend = document.getElementById("kv-legend");
  legend.append(
    el("span", {}, el("span", { class: "block held", style: "--c:#888" }, "req #j"), " held by one request (its logical block j)"),
    el("span", {}, el("span", { class: "block shared" }, "shared ×n"), " held by n requests (prefix caching)"),
    el("span", {}, el("span", { class: "block null" }, "null"), " block 0, never holds KV"),
    el("span", {}, el("span", { class: "block released" }, "released"), " a window moved past it (stale entry)"),
    el("span", {}, el("span", { class: "block stale" }, "stale"), " listed by a preempted request"),
    el("span", {}, el("span", { class: "block written" }, "✎"), " written this step"),
  );

  // ---- one step ---------------------------------------------------------------------------
  function renderStep() {
    const s = STEPS[view.step];
    slider.value = String(view.step + 1);
    document.getElementById("step-label").textContent = `step ${view.step + 1} of ${STEPS.length}`;
    document.getElementById("step-title").textContent = s.title;
    document.getElementById("step-prev").disabled = view.step === 0;
    document.getElementById("step-next").disabled = view.step === STEPS.length - 1;
    renderRows(s);
    renderBatch(s);
    renderTokens(s);
    renderSlots(s);
    renderKV(s);
    renderChanges(s);
    renderSched(s);
  }

  function renderRows(s) {
    const table = document.getElementById("state-rows");
    table.replaceChildren();
    table.append(el("tr", {}, el("th", { text: "req_state_idx" }), el("th", { class: "req", text: "req_id" }),
      el("th", { text: "computed / known" }), el("th", { text: "batch_idx" }),
      ...GROUPS.map((_, g) => el("th", { class: "req", text: `block_table, ${groupName(g)}` }))));
    for (const [row, r, computed, known, batchIdx, status, entries, released] of s.rows) {
      const cells = entries.map((ids, g) => el("td", { class: "req" }, ...ids.map((id, j) => {
        const gone = j < released[g];
        const kind = gone ? "released" : id === 0 ? "null" : "";
        const label = `row ${row}, ${groupName(g)}, logical block ${j}: physical block ${id}` + (gone ? ", released by the window" : "");
        return el("span", { class: `entry ${kind}`, "data-group": g, "data-logical": j, title: label, role: "img", "aria-label": label }, id);
      }), ids.length === 0 ? "(empty)" : null));
      const statusText = DATA.row_status[status];
      table.append(el("tr", { class: `state-row status-${status}`, "data-row": row, "data-req": req(r) },
        el("td", { text: row }), el("td", { class: "req name" }, reqLabel(r)), el("td", { text: `${computed} / ${known}` }),
        el("td", { text: batchIdx < 0 ? statusText : batchIdx, title: statusText }), ...cells));
    }
    if (s.rows.length === 0) table.append(el("tr", {}, el("td", { text: "(the pool is empty)" })));
  }

  function renderBatch(s) {
    const table = document.getElementById("batch-rows");
    table.replaceChildren();
    const drafts = s.batch.some((b) => b[6] > 0);
    table.append(el("tr", {}, ...["batch_idx", "req_id", "req_state_idx", "num_scheduled_tokens", "flat tokens", "seq_len",
      ...(drafts ? ["num_draft_tokens"] : [])].map((h) => el("th", { text: h }))));
    s.batch.forEach(([r, rowIdx, n, start, end, seqLen, k], b) => {
      table.append(el("tr", { class: "batch-row", "data-batch": b, "data-row": rowIdx },
        el("td", { text: b }), el("td", { class: "req name" }, reqLabel(r)), el("td", { text: rowIdx }), el("td", { text: n }),
        el("td", { text: `[${start}, ${end})` }), el("td", { text: seqLen }), drafts ? el("td", { text: k }) : null));
    });
    // a FULL graph's request rows past the real ones: they name no request (index_mapping -1)
    for (const [b, rowIdx, n, seqLen, nullBlocks] of s.pad_rows) {
      table.append(el("tr", { class: "batch-row pad-row", "data-batch": b, "data-row": rowIdx },
        el("td", { text: b }), el("td", { class: "req name", text: "padding" }), el("td", { text: rowIdx }), el("td", { text: n }),
        el("td", { text: `[${s.num_tokens}, ${s.num_tokens})` }), el("td", { text: seqLen, title: nullBlocks ? "block-table row: the null block only" : "" }),
        drafts ? el("td", { text: "" }) : null));
    }
    if (s.batch.length === 0) table.append(el("tr", {}, el("td", { text: "(nothing scheduled this step)" })));
    document.getElementById("batch-arrays").replaceChildren(
      el("code", { id: "index-mapping", text: "index_mapping = " + list([...s.batch.map((b) => b[1]), ...s.pad_rows.map((p) => p[1])]) }), "  ",
      el("code", { id: "query-start-loc", text: "query_start_loc = " + list(s.qsl) }));
    const g = s.graph;
    document.getElementById("graph").textContent = g === null ? "" :
      `captured graph: ${g[0]}, ${g[1]} tokens (${s.num_tokens} real), ${g[2]} request rows (${s.batch.length} real), uniform ${g[3]}, max query len ${g[4]}` +
      (s.pad_rows.length ? `; padded rows: index_mapping -1, 0 tokens, seq_len ${s.pad_rows[0][3]}, block-table rows of the null block` : "");
  }

  function tokenLabel(s, t) {
    const tok = s.tokens;
    const b = tok.batch[t];
    if (b < 0) return `flat token ${t}: padding`;
    const draft = tok.draft && tok.draft[t] ? ", draft" : "";
    return `flat token ${t}: ${req(s.batch[b][0])}, position ${tok.position[t]}${draft}, slot ${tok.groups.map((g) => g.slot[t]).join(" / ")}`;
  }

  function renderTokens(s) {
    const strip = document.getElementById("tokens");
    strip.replaceChildren();
    const tok = s.tokens;
    const starts = new Set(s.qsl.slice(0, -1));
    const u = s.ubatch;
    const info = document.getElementById("ubatch");
    info.replaceChildren();
    if (u && u.refused) info.append(`micro-batches: not split (${u.refused})`);
    else if (u) u.halves.forEach(([start, stop, rowStart, rowStop, qsl], i) => info.append(el("span", { class: "half", "data-half": i },
      `ubatch ${i}: tokens [${start}, ${stop}), rows [${rowStart}, ${rowStop}), query_start_loc ${list(qsl)}`)));
    if (u && !u.refused && u.straddling >= 0) info.append(`${req(u.straddling)} straddles the split: in both halves`);
    const split = u && !u.refused ? u.split : -1;
    for (let t = 0; t < tok.position.length; t++) {
      const b = tok.batch[t];
      const r = b < 0 ? null : s.batch[b][0];
      const classes = ["token", b < 0 ? "pad" : "", tok.draft && tok.draft[t] ? "draft" : "", b >= 0 && starts.has(t) ? "qsl-start" : "",
        t === split ? "ubatch-split" : ""];
      strip.append(el("button", {
        type: "button", class: classes.join(" "), "data-flat": t, tabindex: "-1", "aria-label": tokenLabel(s, t),
        style: r === null ? null : `--c:${colour(r)}`, onclick: () => select(t, true),
      }, el("span", { class: "flat" }, t), b < 0 ? "pad" : req(r), el("br"), b < 0 ? "" : `pos ${tok.position[t]}`,
      tok.draft && tok.draft[t] ? " (draft)" : null));
    }
    if (tok.position.length === 0) strip.append(el("span", { text: "(no tokens this step)" }));
  }

  function renderSlots(s) {
    const box = document.getElementById("slots");
    box.replaceChildren();
    s.tokens.groups.forEach((grp, g) => {
      const row = el("div", { class: "slot-row", "data-group": g }, el("span", { class: "label", text: `slot_mappings[${g}], ${groupName(g)}` }));
      grp.slot.forEach((slot, t) => {
        const b = s.tokens.batch[t];
        row.append(el("span", { class: b < 0 ? "slot pad" : "slot", "data-flat": t, "data-group": g, title: `flat token ${t}: slot ${slot}`,
          style: b < 0 ? null : `--c:${colour(s.batch[b][0])}` }, slot));
      });
      box.append(row);
    });
  }

  function blockText(kind, holders, released, stale) {
    const names = (entries) => entries.map(([r, j]) => `${req(r)} #${j}`).join(", ");
    // a block a window released may be handed out again: the stale entry stays in the old table
    const reused = released.length && holders.length ? `; released at ${names(released)}, reused` : "";
    if (kind === "null") return "null";
    if (kind === "shared") return `shared ×${holders.length}: ${names(holders)}${reused}`;
    if (kind === "held") return `${names(holders)}${reused}`;
    if (kind === "released") return `released: ${names(released)}`;
    return `stale: ${names(stale)}`;
  }

  function renderKV(s) {
    const box = document.getElementById("kv");
    box.replaceChildren();
    s.kv.forEach((entries, g) => {
      const written = new Set(s.written[g]);
      const listed = new Map(entries.map((e) => [e[0], e]));
      const grid = el("div", { class: "kv-grid", "data-group": g, role: "list", "aria-label": `physical blocks of ${groupName(g)}` });
      const n = GROUPS[g].num_blocks;
      const ids = n <= MAX_DRAWN_BLOCKS ? Array.from({ length: n }, (_, i) => i) : [...listed.keys()];
      for (const id of ids) {
        const e = listed.get(id);
        const kind = e ? DATA.block_kind[e[1]] : id === 0 ? "null" : "free";
        const holders = e ? pairs(e[2]) : [], released = e ? pairs(e[3]) : [], stale = e ? pairs(e[4]) : [];
        const text = e ? blockText(kind, holders, released, stale) : kind;
        const w = written.has(id);
        const owner = kind === "held" ? holders[0][0] : null;
        const label = `${groupName(g)}, physical block ${id}: ${text}${w ? ", written this step" : ""}`;
        grid.append(el("div", { class: `block ${kind}${w ? " written" : ""}`, "data-block": id, "data-group": g, "data-kind": kind,
          title: label, role: "listitem", "aria-label": label, style: owner === null ? null : `--c:${colour(owner)}` },
          el("span", { class: "id" }, id), w ? " ✎" : null, el("br"), text));
      }
      box.append(el("div", { class: "kv-group" }, el("h3", { text: groupName(g) + (n > MAX_DRAWN_BLOCKS ? `: the ${ids.length} listed blocks of ${n}` : "") }), grid));
    });
  }

  function renderChanges(s) {
    const ul = document.getElementById("changes");
    ul.replaceChildren();
    for (const [kind, , text] of s.changes) ul.append(el("li", { "data-kind": kind }, el("span", { class: "kind", text: kind }), text));
    if (s.changes.length === 0) ul.append(el("li", { text: "nothing changed" }));
  }

  function renderSched(s) {
    const dl = document.getElementById("sched");
    dl.replaceChildren();
    const sc = s.sched;
    const item = (name, value) => dl.append(el("dt", { text: name }), el("dd", { text: value }));
    item("new_requests", sc.new.length ? sc.new.map(([r, len, c, b]) => `${req(r)}: ${len} prompt tokens, num_computed_tokens ${c}, block_ids ${tables(b)}`).join("; ") : "()");
    item("cached_requests", sc.cached.length ? sc.cached.map(([r, c, b, resumed]) => `${req(r)}: num_computed_tokens ${c}, new_block_ids ${b === null ? "None" : tables(b)}${resumed ? ", resumed" : ""}`).join("; ") : "()");
    item("num_scheduled_tokens", "{" + sc.order.map(([r, n]) => `${req(r)}: ${n}`).join(", ") + "}");
    item("finished_req_ids", "{" + sc.finished.map(req).join(", ") + "}");
    if (sc.drafts.length) item("scheduled_spec_decode_tokens", "{" + sc.drafts.map(([r, d]) => `${req(r)}: ${list(d)}`).join(", ") + "}");
    item("pad_to", sc.pad === null ? "None" : sc.pad);
  }

  // ---- one token --------------------------------------------------------------------------
  function select(t, focus) {
    const s = STEPS[view.step];
    const n = s.tokens.position.length;
    document.querySelectorAll(".hl").forEach((node) => node.classList.remove("hl"));
    const path = document.getElementById("path");
    path.replaceChildren();
    if (n === 0) { path.append(el("p", { text: "no tokens in this step" })); return; }
    view.flat = Math.max(0, Math.min(t, n - 1));
    t = view.flat;
    document.querySelectorAll(".token").forEach((node) => { node.tabIndex = -1; node.setAttribute("aria-pressed", "false"); });
    const button = document.querySelector(`.token[data-flat="${t}"]`);
    button.tabIndex = 0;
    button.setAttribute("aria-pressed", "true");
    button.classList.add("hl");
    if (focus) button.focus();
    document.querySelectorAll(`.slot[data-flat="${t}"]`).forEach((node) => node.classList.add("hl"));
    history.replaceState(null, "", `#step=${view.step + 1}&token=${t}`);
    const tok = s.tokens;
    const b = tok.batch[t];
    if (b < 0) {
      path.append(el("p", { id: "path-padding" }, `flat token ${t} is padding: no request, position ${tok.position[t]}, input id ${tok.input_id[t]}, slot `,
        el("span", { class: "value", "data-field": "slot", "data-group": 0 }, tok.groups[0].slot[t]), " (PAD_SLOT_ID) in every group: write_kv skips it."));
      return;
    }
    const [r, rowIdx, , start, end] = s.batch[b];
    const row = s.rows.find((x) => x[0] === rowIdx);
    const computed = row[2];
    document.querySelector(`.state-row[data-row="${rowIdx}"]`).classList.add("hl");
    document.querySelector(`.batch-row[data-batch="${b}"]`).classList.add("hl");
    const v = (field, value, g) => el("span", { class: "value", "data-field": field, "data-group": g }, value);
    const draft = tok.draft && tok.draft[t];
    path.append(el("p", {}, reqLabel(r), draft ? " — a draft token: its input id is the drafter's guess, not a known token until accepted" : ""));
    path.append(el("ol", { id: "path-common" },
      el("li", {}, "req_state_idx ", v("req_state_idx", rowIdx), `: the row of ${req(r)} in the pool`),
      el("li", {}, "batch_idx ", v("batch_idx", b), `: index_mapping[${b}] = ${rowIdx}`),
      el("li", {}, "flat index ", v("flat", t), `: query_start_loc[${b}] = ${start} ≤ ${t} < ${end} = query_start_loc[${b + 1}]`),
      el("li", {}, "position ", v("position", tok.position[t]), ` = num_computed_tokens ${computed} + (${t} − ${start}); input id `, v("input_id", tok.input_id[t])),
      tok.logits_row && tok.logits_row[t] >= 0 ? el("li", {}, `logits row ${tok.logits_row[t]} (logits_indices): its logits decide ${tok.verifies[t]}`) : null));
    tok.groups.forEach((grp, g) => {
      const bs = GROUPS[g].block_size;
      const logical = grp.logical[t], offset = grp.offset[t], physical = grp.physical[t], slot = grp.slot[t];
      path.append(el("h3", { text: groupName(g) }), el("ol", { class: "path-group", "data-group": g, start: "5" },
        el("li", {}, "logical block ", v("logical", logical, g), ", offset ", v("offset", offset, g), `: ${tok.position[t]} = ${logical} * ${bs} + ${offset}`),
        el("li", {}, "physical block ", v("physical", physical, g), `: block_table[${rowIdx}][${logical}]`),
        el("li", {}, "slot ", v("slot", slot, g), ": ", el("span", { class: "formula", "data-group": g, "data-field": "formula" }, `${physical} * ${bs} + ${offset} = ${slot}`))));
      const entry = document.querySelector(`.state-row[data-row="${rowIdx}"] .entry[data-group="${g}"][data-logical="${logical}"]`);
      if (entry) entry.classList.add("hl");
      const block = document.querySelector(`.kv-grid[data-group="${g}"] .block[data-block="${physical}"]`);
      if (block) block.classList.add("hl");
    });
  }

  // ---- controls ---------------------------------------------------------------------------
  function go(step, token, focus) {
    view.step = Math.max(0, Math.min(step, STEPS.length - 1));
    renderStep();
    select(token === undefined ? view.flat : token, focus);
  }
  document.getElementById("step-prev").addEventListener("click", () => go(view.step - 1));
  document.getElementById("step-next").addEventListener("click", () => go(view.step + 1));
  slider.addEventListener("input", () => go(Number(slider.value) - 1));
  document.getElementById("tokens").addEventListener("keydown", (event) => {
    const n = STEPS[view.step].tokens.position.length;
    const to = { ArrowLeft: view.flat - 1, ArrowRight: view.flat + 1, Home: 0, End: n - 1 }[event.key];
    if (to === undefined) return;
    event.preventDefault();
    select(to, true);
  });
  document.addEventListener("keydown", (event) => {
    if (event.target instanceof HTMLInputElement || event.ctrlKey || event.metaKey || event.altKey) return;
    const onToken = document.activeElement !== null && document.activeElement.classList.contains("token");
    if (event.key === "n") go(view.step + 1, undefined, onToken);
    else if (event.key === "p") go(view.step - 1, undefined, onToken);
  });
  const hash = new URLSearchParams(location.hash.slice(1));
  go(Number(hash.get("step") || DATA.start_step) - 1, Number(hash.get("token") || 0));
})();
