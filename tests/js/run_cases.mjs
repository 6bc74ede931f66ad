// The Node half of tests/test_web_tokenizer.py: reads a JSON request, runs the translator's
// JavaScript on it, writes the JSON answer to stdout. Python compares it with sentencepiece and
// transformer/decoding.py.
//   node tests/js/run_cases.mjs tokenize request.json   {tokenizer, texts, decode} -> {ids, pieces, decoded}
//   node tests/js/run_cases.mjs rules request.json      {name, charsmap?, rules: [[from, to], ...]} -> {wrong: [[from, to, got]]}
//   node tests/js/run_cases.mjs search request.json     {cases: [{src, beamSize, alpha, extraLen}]} -> {results}
//   node tests/js/run_cases.mjs onnx request.json       {web, texts, beamSize, trace, runtime, sessionOptions} -> {results: [{text, ids, srcIds}], traces}
//     runtime "node" (the default): onnxruntime-node from tests/js/node_modules (npm ci --prefix tests/js);
//     "web": onnxruntime-web's WASM from book/_static/translator/node_modules (npm ci --prefix book/_static/translator)
import fs from 'node:fs';
import { CharsMap, normalizeRule } from '../../book/_static/translator/normalizer.js';
import { beamSearch, greedySearch } from '../../book/_static/translator/search.js';
import { Tokenizer } from '../../book/_static/translator/tokenizer.js';
import { Translator } from '../../book/_static/translator/translator.js';
import { BOS, EOS, PAD, fakeStep } from './fake_model.mjs';

const [mode, file] = process.argv.slice(2);
const request = JSON.parse(fs.readFileSync(file, 'utf8'));
let answer;
if (mode === 'tokenize') {
  const tokenizer = new Tokenizer(JSON.parse(fs.readFileSync(request.tokenizer, 'utf8')));
  answer = {
    ids: request.texts.map((text) => tokenizer.encode(text)),
    pieces: request.texts.map((text) => tokenizer.encodeAsPieces(text)),
    decoded: request.decode.map((ids) => tokenizer.decode(ids)),
  };
} else if (mode === 'rules') {
  const table = request.charsmap ? CharsMap.fromBase64(request.charsmap) : null;
  const apply = (text) => (table ? table.apply(text) : normalizeRule(text, request.name));
  answer = { wrong: request.rules.map(([from, to]) => [from, to, apply(from)]).filter(([, to, got]) => to !== got) };
} else if (mode === 'search') {
  answer = { results: [] };
  for (const { src, beamSize, alpha, extraLen } of request.cases) {
    const options = { srcLength: src.length, bos: BOS, eos: EOS, pad: PAD, extraLen, alpha, beamSize };
    answer.results.push(beamSize === 1 ? await greedySearch(fakeStep(src), options) : await beamSearch(fakeStep(src), options));
  }
} else if (mode === 'onnx') {
  let translator;
  if ((request.runtime ?? 'node') === 'node') {
    const { default: ort } = await import('onnxruntime-node');
    const read = (name) => JSON.parse(fs.readFileSync(`${request.web}/${name}`, 'utf8'));
    const config = read('config.json');
    translator = await Translator.create(ort, {
      config, tokenizer: read(config.tokenizer), encoder: `${request.web}/${config.encoder}`, decoder: `${request.web}/${config.decoder}`,
    }, { intraOpNumThreads: 1, interOpNumThreads: 1, ...request.sessionOptions });
  } else {
    // the page's runtime: onnxruntime-web's single-threaded WASM, the very file the book's site serves,
    // loaded through the widget's own path (Translator.fromFiles)
    const ort = await import(new URL('../../book/_static/translator/node_modules/onnxruntime-web/dist/ort.wasm.bundle.min.mjs', import.meta.url));
    ort.env.wasm.numThreads = 1;
    translator = await Translator.fromFiles(ort, async (name) => new Uint8Array(fs.readFileSync(`${request.web}/${name}`)),
      { executionProviders: ['wasm'], ...request.sessionOptions });
  }
  answer = { results: [], traces: [] };
  for (const text of request.texts) {
    const out = await translator.translate(text, { beamSize: request.beamSize });
    answer.results.push(out);
    if (request.trace) answer.traces.push(await translator.trace(out.srcIds, out.ids));
  }
} else {
  throw new Error(`mode ${JSON.stringify(mode)}: expected tokenize, rules, search or onnx`);
}
process.stdout.write(JSON.stringify(answer));
