// Parse AsyncAPI documents with the official parser and print its diagnostics as JSON.
// Usage: node validate.mjs FILE...  -> [{"file", "severity", "code", "message", "path"}, ...]
// Severity as the parser reports it: 0 error, 1 warning, 2 information, 3 hint.
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { Parser } = require("@asyncapi/parser");

const parser = new Parser();
const found = [];
for (const file of process.argv.slice(2)) {
  const { document, diagnostics } = await parser.parse(readFileSync(file, "utf8"), {
    source: file,
  });
  for (const d of diagnostics) {
    found.push({ file, severity: d.severity, code: d.code, message: d.message, path: d.path });
  }
  if (document === undefined && !diagnostics.some((d) => d.severity === 0)) {
    found.push({ file, severity: 0, code: "no-document", message: "parser gave no document" });
  }
}
process.stdout.write(JSON.stringify(found));
