export * from "./types.js";
export * from "./state.js";
export * from "./client.js";
export * from "./format.js";
