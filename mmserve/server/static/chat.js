// The playground's talk with the server: media files as OpenAI content parts, and a streamed chat completion
// read as server-sent events. No DOM here.

import { apiFetch } from "./common.js";

/** An HTTP error answered before the stream started (or in-band, mid-stream). */
export class ApiError extends Error {
  constructor(status, message, code = "") {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** "image" | "video" | "audio" for a File, or null for anything else. */
export function modalityOf(file) {
  const kind = (file.type || "").split("/")[0];
  return ["image", "video", "audio"].includes(kind) ? kind : null;
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

/** The content part carrying one attached file, inline as a data: URL. */
export async function mediaPart(file) {
  const url = await readAsDataUrl(file);
  const modality = modalityOf(file);
  const key = `${modality}_url`; // image_url, video_url, audio_url
  return { type: key, [key]: { url } };
}

async function errorOf(response) {
  let message = `HTTP ${response.status}`;
  let code = "";
  try {
    const body = await response.json();
    message = body.error?.message ?? message;
    code = body.error?.code ?? "";
  } catch {
    // not JSON: keep the status line
  }
  return new ApiError(response.status, message, code);
}

/** POST a streamed chat completion; yields each event's JSON object until [DONE]. Throws ApiError. */
export async function* streamChat(body, signal) {
  const response = await apiFetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ApiError(parsed.error.status ?? 500, parsed.error.message, parsed.error.code);
        yield parsed;
      }
    }
  }
}
