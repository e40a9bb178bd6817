// The official `openai` Node client against a running headroom server: one streamed
// chat answer and one streamed, forced tool call. Prints what it read as one JSON line
// for the Python test that started the server (tests/test_node_openai_client.py).
// Usage: node scripts/openai-node-check.mjs http://127.0.0.1:PORT
import OpenAI from "openai";

const base = process.argv[2];
if (!base) {
  console.error("usage: node scripts/openai-node-check.mjs BASE_URL");
  process.exit(2);
}
const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", timeout: 300_000 });

async function chat() {
  const stream = await client.chat.completions.create({
    model: "default",
    messages: [{ role: "user", content: "What is the capital of France?" }],
    max_tokens: 16,
    temperature: 0,
    stream: true,
  });
  let text = "";
  let finish = null;
  let chunks = 0;
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    chunks += 1;
    text += choice.delta?.content ?? "";
    finish = choice.finish_reason ?? finish;
  }
  return { text, finish, chunks };
}

async function toolCall() {
  const stream = await client.chat.completions.create({
    model: "default",
    messages: [{ role: "user", content: "What is the weather in Paris?" }],
    tools: [
      {
        type: "function",
        function: {
          name: "get_weather",
          description: "The current weather in a city",
          parameters: {
            type: "object",
            properties: { city: { type: "string" } },
            required: ["city"],
          },
        },
      },
    ],
    tool_choice: "required",
    max_tokens: 64,
    temperature: 0,
    stream: true,
  });
  const calls = [];
  let finish = null;
  for await (const chunk of stream) {
    const choice = chunk.choices[0];
    if (!choice) continue;
    for (const piece of choice.delta?.tool_calls ?? []) {
      const call = (calls[piece.index] ??= { id: "", name: "", arguments: "" });
      call.id += piece.id ?? "";
      call.name += piece.function?.name ?? "";
      call.arguments += piece.function?.arguments ?? "";
    }
    finish = choice.finish_reason ?? finish;
  }
  return { calls, finish };
}

console.log(JSON.stringify({ chat: await chat(), tools: await toolCall() }));
