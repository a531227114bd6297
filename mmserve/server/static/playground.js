// The playground (/): a chat with streamed answers; media attached by file picker, drag-and-drop or paste;
// sampling settings; each answer's timing breakdown (breakdown.js).

import { renderBreakdown } from "./breakdown.js";
import { ApiError, mediaPart, modalityOf, streamChat } from "./chat.js";
import { changeKey, el, ensureKey, servedModel, uiConfig } from "./common.js";

const $ = (id) => document.getElementById(id);
const ui = {
  transcript: $("transcript"),
  empty: $("empty-state"),
  composer: $("composer"),
  prompt: $("prompt"),
  fileInput: $("file-input"),
  attachments: $("attachments"),
  send: $("send"),
  stop: $("stop"),
  overlay: $("drop-overlay"),
  chat: $("chat"),
  model: $("model-name"),
  keyButton: $("key-button"),
};

let model = "";
let history = []; // the conversation as sent: [{role, content}]
let pending = []; // attachments of the next message: [{file, url, modality}]
let controller = null; // aborts the answer being streamed

// -- attachments ----------------------------------------------------------------------------------------
function thumb(attachment, onRemove) {
  const { modality, url, file } = attachment;
  let preview;
  if (modality === "image") preview = el("img", { src: url, alt: file.name });
  else if (modality === "video") preview = el("video", { src: url, muted: true });
  else preview = el("span", { class: "kind", text: `♪ ${file.name}` });
  const node = el("div", { class: "thumb", title: `${file.name} (${modality})` }, preview);
  if (onRemove) {
    const remove = el("button", { type: "button", class: "remove", "aria-label": `remove ${file.name}`, text: "×" });
    remove.addEventListener("click", onRemove);
    node.append(remove);
  }
  return node;
}

function renderAttachments() {
  ui.attachments.replaceChildren(
    ...pending.map((a, i) => thumb(a, () => {
      URL.revokeObjectURL(a.url);
      pending.splice(i, 1);
      renderAttachments();
    })));
}

function attach(files) {
  for (const file of files) {
    const modality = modalityOf(file);
    if (!modality) continue; // not an image, a video or audio: ignored
    pending.push({ file, modality, url: URL.createObjectURL(file) });
  }
  renderAttachments();
}

ui.fileInput.addEventListener("change", () => {
  attach(ui.fileInput.files);
  ui.fileInput.value = "";
});

document.addEventListener("paste", (event) => {
  const files = [...(event.clipboardData?.files ?? [])];
  if (files.length) {
    event.preventDefault();
    attach(files);
  }
});

let dragDepth = 0;
ui.chat.addEventListener("dragenter", (event) => {
  if (!event.dataTransfer?.types.includes("Files")) return;
  dragDepth += 1;
  ui.overlay.hidden = false;
});
ui.chat.addEventListener("dragleave", () => {
  dragDepth = Math.max(0, dragDepth - 1);
  if (!dragDepth) ui.overlay.hidden = true;
});
ui.chat.addEventListener("dragover", (event) => event.preventDefault());
ui.chat.addEventListener("drop", (event) => {
  event.preventDefault();
  dragDepth = 0;
  ui.overlay.hidden = true;
  attach(event.dataTransfer?.files ?? []);
});

// -- settings -------------------------------------------------------------------------------------------
for (const [input, output] of [["temperature", "temperature-value"], ["top-p", "top-p-value"]]) {
  const show = () => { $(output).textContent = Number($(input).value).toFixed(2); };
  $(input).addEventListener("input", show);
  show();
}

function samplingSettings() {
  const settings = {
    max_tokens: Math.max(1, parseInt($("max-tokens").value, 10) || 128),
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
  };
  const seed = $("seed").value.trim();
  if (seed !== "") settings.seed = parseInt(seed, 10);
  return settings;
}

// -- transcript -----------------------------------------------------------------------------------------
function addMessage(role, text, attachments = []) {
  ui.empty.hidden = true;
  const content = el("div", { class: "content", text });
  const node = el("div", { class: `message ${role}` }, el("span", { class: "role", text: role }));
  if (attachments.length) node.append(el("div", { class: "thumbs" }, attachments.map((a) => thumb(a))));
  if (role === "user" && !text) content.hidden = true;
  node.append(content);
  ui.transcript.append(node);
  scrollToEnd();
  return { node, content };
}

function scrollToEnd() {
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
}

function setBusy(busy) {
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.prompt.disabled = busy;
}

async function send() {
  const text = ui.prompt.value.trim();
  if (controller || (!text && !pending.length)) return;
  const attachments = pending;
  pending = [];
  renderAttachments();
  ui.prompt.value = "";
  addMessage("user", text, attachments);
  const parts = await Promise.all(attachments.map((a) => mediaPart(a.file)));
  if (text) parts.push({ type: "text", text });
  history.push({ role: "user", content: parts });

  const answer = addMessage("assistant", "");
  answer.node.classList.add("streaming");
  controller = new AbortController();
  setBusy(true);
  let extra = null;
  let usage = null;
  let reply = "";
  try {
    const system = $("system-prompt").value.trim();
    const messages = system ? [{ role: "system", content: system }, ...history] : history;
    for await (const chunk of streamChat({ model, messages, ...samplingSettings() }, controller.signal)) {
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        reply += delta;
        answer.content.textContent = reply;
        scrollToEnd();
      }
      if (chunk.mmserve) extra = chunk.mmserve;
      if (chunk.usage) usage = chunk.usage;
    }
    history.push({ role: "assistant", content: reply });
    if (extra) answer.node.append(renderBreakdown(extra, usage));
  } catch (error) {
    history.pop(); // the user message is not part of the conversation unless it was answered
    if (error.name === "AbortError") {
      answer.node.append(el("div", { class: "hint", text: "stopped" }));
    } else {
      const status = error instanceof ApiError ? `${error.status} ` : "";
      answer.node.append(el("div", { class: "error", role: "alert", text: `${status}${error.message}` }));
      if (error instanceof ApiError && error.status === 401) await ensureKey("The server refused the key.");
    }
  } finally {
    answer.node.classList.remove("streaming");
    answer.node.dataset.done = "true";
    controller = null;
    setBusy(false);
    scrollToEnd();
    ui.prompt.focus();
  }
}

ui.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
ui.prompt.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
ui.stop.addEventListener("click", () => controller?.abort());

$("new-chat").addEventListener("click", () => {
  controller?.abort();
  history = [];
  for (const media of ui.transcript.querySelectorAll("img, video")) URL.revokeObjectURL(media.src);
  for (const node of ui.transcript.querySelectorAll(".message")) node.remove();
  ui.empty.hidden = false;
});

ui.keyButton.addEventListener("click", async () => {
  await changeKey();
  model = (await servedModel()) || model;
});

// -- start ----------------------------------------------------------------------------------------------
async function start() {
  setBusy(false);
  ui.send.disabled = true;
  await ensureKey();
  const config = await uiConfig();
  ui.keyButton.hidden = !config.auth_required;
  model = await servedModel();
  if (!model) { // a saved key that no longer works: ask again
    await ensureKey("The server refused the saved key.");
    model = await servedModel();
  }
  ui.model.textContent = model || "no model";
  ui.send.disabled = false;
  document.body.dataset.ready = "true";
  ui.prompt.focus();
}

start();
