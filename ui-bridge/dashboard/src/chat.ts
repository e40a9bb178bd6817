// The dashboard's chat panel: try the model without a client. It streams
// /v1/chat/completions (OpenAI's server-sent events) with fetch on the page's own origin.

export interface ChatMessage {
  role: "system" | "user" | "assistant";
  content: string;
}

/** One parsed event of the stream: text to append, the end, or an error. */
export type ChatChunk =
  | { kind: "text"; text: string }
  | { kind: "reasoning"; text: string }
  | { kind: "done"; finishReason: string | null }
  | { kind: "error"; message: string };

/**
 * Split `buffer` (what arrived so far) into the events it completes and the text left
 * over (an event cut in the middle waits for the next read). Events are `data: <json>`
 * lines separated by blank lines; `data: [DONE]` ends the stream.
 */
export function parseSse(buffer: string): { chunks: ChatChunk[]; rest: string } {
  const chunks: ChatChunk[] = [];
  const blocks = buffer.replace(/\r\n/g, "\n").split("\n\n");
  const rest = blocks.pop() ?? "";
  for (const block of blocks) {
    const data = block
      .split("\n")
      .filter((line) => line.startsWith("data:"))
      .map((line) => line.slice(5).trimStart())
      .join("\n");
    if (!data) continue;
    if (data === "[DONE]") {
      chunks.push({ kind: "done", finishReason: null });
      continue;
    }
    let event: {
      error?: { message?: string };
      choices?: { delta?: { content?: string | null; reasoning_content?: string | null }; finish_reason?: string | null }[];
    };
    try {
      event = JSON.parse(data);
    } catch {
      chunks.push({ kind: "error", message: `the service sent an event that is not JSON: ${data.slice(0, 80)}` });
      continue;
    }
    if (event.error) {
      chunks.push({ kind: "error", message: event.error.message ?? "the service reported an error" });
      continue;
    }
    const choice = event.choices?.[0];
    if (choice?.delta?.reasoning_content) chunks.push({ kind: "reasoning", text: choice.delta.reasoning_content });
    if (choice?.delta?.content) chunks.push({ kind: "text", text: choice.delta.content });
    if (choice?.finish_reason) chunks.push({ kind: "done", finishReason: choice.finish_reason });
  }
  return { chunks, rest };
}

/** The request body for one turn: the conversation so far, streamed. */
export function chatBody(messages: ChatMessage[], maxTokens: number): Record<string, unknown> {
  return { model: "default", messages, stream: true, max_tokens: maxTokens };
}

/** The error of a non-2xx answer, as the person should read it. */
export async function httpError(response: Response): Promise<string> {
  const text = await response.text();
  let message = text.slice(0, 300);
  try {
    message = (JSON.parse(text) as { error?: { message?: string } }).error?.message ?? message;
  } catch {
    /* not JSON: the text itself */
  }
  const hint = response.status === 401 ? " (this service was started with --api-key: enter the key)" : "";
  return `${response.status}: ${message}${hint}`;
}

/**
 * Send one turn and call `onChunk` for each event as it arrives. Resolves when the
 * stream ends; an HTTP error or a broken stream comes as an `error` chunk, never as a
 * rejection (an abort through `signal` rejects, as fetch does).
 */
export async function streamChat(
  messages: ChatMessage[],
  onChunk: (chunk: ChatChunk) => void,
  options: { apiKey?: string; maxTokens?: number; signal?: AbortSignal; fetch?: typeof fetch } = {},
): Promise<void> {
  const headers: Record<string, string> = { "Content-Type": "application/json" };
  if (options.apiKey) headers.Authorization = `Bearer ${options.apiKey}`;
  const fetchFn = options.fetch ?? globalThis.fetch.bind(globalThis);
  const response = await fetchFn("/v1/chat/completions", {
    method: "POST",
    headers,
    body: JSON.stringify(chatBody(messages, options.maxTokens ?? 512)),
    signal: options.signal,
  });
  if (!response.ok || !response.body) {
    onChunk({ kind: "error", message: await httpError(response) });
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let ended = false;
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value, { stream: !done });
    const { chunks, rest } = parseSse(done ? `${buffer}\n\n` : buffer);
    buffer = rest;
    for (const chunk of chunks) {
      if (chunk.kind === "done" && chunk.finishReason === null) ended = true;
      onChunk(chunk);
    }
    if (done) break;
  }
  if (!ended) onChunk({ kind: "error", message: "the stream ended before [DONE]" });
}
