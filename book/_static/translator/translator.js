// The trained model in a page (or in Node): the tokenizer, the two ONNX graphs of the web export
// (book/model/web/: encoder.onnx, decoder.onnx, config.json) and the searches of search.js.
// `ort` is onnxruntime-web in a browser, onnxruntime-node in Node: both have InferenceSession and
// Tensor, which is all this uses.
import { beamSearch, greedySearch, logSoftmax, topK } from './search.js';
import { Tokenizer } from './tokenizer.js';

export const WEB_FORMAT = 'transformer-book/web/1';

export class Translator {
  constructor({ ort, encoder, decoder, tokenizer, config }) {
    if (config.format !== WEB_FORMAT) throw new Error(`config.json has format ${JSON.stringify(config.format)}; expected ${JSON.stringify(WEB_FORMAT)}`);
    Object.assign(this, { ort, encoder, decoder, tokenizer, config });
  }

  /** `files`: {config, tokenizer} (parsed JSON) and {encoder, decoder} (what
   *  ort.InferenceSession.create takes: a path in Node, a URL or bytes in a browser). */
  static async create(ort, { config, tokenizer, encoder, decoder }, sessionOptions = {}) {
    const [enc, dec] = await Promise.all([encoder, decoder].map((m) => ort.InferenceSession.create(m, sessionOptions)));
    return new Translator({ ort, encoder: enc, decoder: dec, tokenizer: new Tokenizer(tokenizer), config });
  }

  /** The web export read file by file: `read(name)` resolves to the bytes (a Uint8Array) of a file
   *  of book/model/web/ (a fetch in a page, fs in Node). The shared weights (config.external_data)
   *  are read once and handed to both graphs: what onnxruntime-web needs, and -node accepts. */
  static async fromFiles(ort, read, sessionOptions = {}) {
    const text = new TextDecoder();
    const config = JSON.parse(text.decode(await read('config.json')));
    const names = [config.tokenizer, config.encoder, config.decoder, ...config.external_data];
    const [tokenizer, encoder, decoder, ...shared] = await Promise.all(names.map((name) => read(name)));
    const externalData = config.external_data.map((path, i) => ({ path, data: shared[i] }));
    return Translator.create(ort, { config, tokenizer: JSON.parse(text.decode(tokenizer)), encoder, decoder },
      { ...sessionOptions, externalData });
  }

  /** The source ids the model reads: the pieces, then EOS (cut to max_len as chapter 9's translate). */
  sourceIds(text) {
    const ids = this.tokenizer.encode(text);
    const max = this.config.max_len;
    return ids.length + 1 > max ? [...ids.slice(0, max - 1), this.config.eos_id] : [...ids, this.config.eos_id];
  }

  #ids(rows) {
    const data = BigInt64Array.from(rows.flat(), (x) => BigInt(x));
    return new this.ort.Tensor('int64', data, [rows.length, rows[0].length]);
  }

  /** Encode once; return the search's `step` for this source. The decoder's cross-attention of the
   *  last call is kept in `step.attention`: [layer][row][head][source position]. */
  async prepare(srcIds) {
    const { memory } = await this.encoder.run({ src: this.#ids([srcIds]) });
    const [, S, d] = memory.dims;
    const step = async (prefixes) => {
      const N = prefixes.length;
      const mem = new Float32Array(N * S * d);
      for (let n = 0; n < N; n++) mem.set(memory.data, n * S * d);
      const out = await this.decoder.run({
        tgt: this.#ids(prefixes),
        memory: new this.ort.Tensor('float32', mem, [N, S, d]),
        src: this.#ids(prefixes.map(() => srcIds)),
      });
      const V = out.log_probs.dims[1];
      const [L, , H] = out.cross_attention.dims;
      const a = out.cross_attention.data;
      step.attention = Array.from({ length: L }, (_, l) => Array.from({ length: N }, (_, n) =>
        Array.from({ length: H }, (_, h) => Array.from(a.subarray(((l * N + n) * H + h) * S, ((l * N + n) * H + h + 1) * S)))));
      return Array.from({ length: N }, (_, n) => out.log_probs.data.subarray(n * V, (n + 1) * V));
    };
    return step;
  }

  /** Translate `text`: greedy search (beamSize 1) or beam search. Returns {text, ids, srcIds, score?}. */
  async translate(text, { beamSize = 1, alpha = this.config.alpha, extraLen = this.config.extra_len } = {}) {
    const srcIds = this.sourceIds(text);
    const step = await this.prepare(srcIds);
    const options = { srcLength: srcIds.length, bos: this.config.bos_id, eos: this.config.eos_id, pad: this.config.pad_id,
      extraLen, maxLen: this.config.max_len, beamSize, alpha };
    const out = beamSize === 1 ? await greedySearch(step, options) : await beamSearch(step, options);
    return { text: this.tokenizer.decode(out.ids), ids: out.ids, srcIds, score: out.score };
  }

  /** What the model saw at each step of producing `ids` (teacher forcing): the `top` most probable
   *  next pieces and the cross-attention [layer][head][source position]; the last step predicts EOS. */
  async trace(srcIds, ids, top = 5) {
    const step = await this.prepare(srcIds);
    const prefix = [this.config.bos_id];
    const steps = [];
    for (const id of [...ids, this.config.eos_id]) {
      const [logProbs] = await step([prefix]);
      steps.push({ id, top: topK(logSoftmax(logProbs), top), attention: step.attention.map((layer) => layer[0]) });
      prefix.push(id);
    }
    return steps;
  }
}
