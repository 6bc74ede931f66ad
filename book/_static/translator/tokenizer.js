// sentencepiece's BPE encoder and decoder in plain JavaScript, reading book/model/web/tokenizer.json
// (written from book/model/tokenizer.model by the web export). Runs in Node 20 and in a browser.
// The steps and their sources in sentencepiece: normalizer.cc (Normalize), bpe_model.cc (Encode),
// sentencepiece_processor.cc (runs of unknown pieces merged; Decode).
import { CharsMap, normalize } from './normalizer.js';

export const FORMAT = 'transformer-book/sentencepiece-bpe/1';
const NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6;
const UNK_SURFACE = ' \u2047 '; // " ⁇ ", sentencepiece's default unk_surface
const SPACE = '\u2581'; // "▁"

export class Tokenizer {
  /** `spec`: the parsed tokenizer.json. */
  constructor(spec) {
    if (!spec || spec.format !== FORMAT) {
      throw new Error(`tokenizer.json has format ${JSON.stringify(spec && spec.format)}; expected ${JSON.stringify(FORMAT)}`);
    }
    if (spec.model_type !== 'bpe') throw new Error(`model_type=${JSON.stringify(spec.model_type)}: only "bpe" is supported`);
    this.pieces = spec.pieces.map((p) => p[0]);
    this.types = spec.pieces.map((p) => p[2]);
    const unsupported = this.types.findIndex((t) => t === USER_DEFINED || t === BYTE);
    if (unsupported >= 0) {
      throw new Error(`piece ${unsupported} (${JSON.stringify(this.pieces[unsupported])}) has type ${this.types[unsupported]}: ` +
        'user-defined and byte pieces (byte_fallback) are not supported');
    }
    this.unkId = spec.unk_id;
    this.bosId = spec.bos_id;
    this.eosId = spec.eos_id;
    this.padId = spec.pad_id;
    this.normalizer = spec.normalizer;
    // the model's compiled rule table when tokenizer.json carries it (base64): exact normalization
    const table = spec.normalizer.precompiled_charsmap;
    this.charsMap = table ? CharsMap.fromBase64(table) : null;
    // pieces that merges may form (sentencepiece's pieces_: normal and unused), with their scores
    this.merges = new Map();
    // the id of every piece (control and unknown ones too, as PieceToId)
    this.ids = new Map();
    spec.pieces.forEach(([piece, score, type], id) => {
      if (type === NORMAL || type === UNUSED) this.merges.set(piece, score);
      if (!this.ids.has(piece)) this.ids.set(piece, id);
    });
    this.size = spec.pieces.length;
  }

  /** Load from a URL (browser) or a path (Node; use `fromFile`). */
  static async fromURL(url) {
    const response = await fetch(url);
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    return new Tokenizer(await response.json());
  }

  /** The normalized text sentencepiece segments: "▁"-escaped, with the dummy prefix. */
  normalize(text) {
    if (typeof text !== 'string') throw new TypeError(`text must be a string, got ${typeof text}`);
    return normalize(text, this.normalizer, this.charsMap);
  }

  /** The pieces of `text` (strings), runs of unknown characters kept as one piece. */
  encodeAsPieces(text) {
    return this.#segment(this.normalize(text)).map(([piece]) => piece);
  }

  /** Token ids of `text`, as SentencePieceProcessor.encode(text) (no BOS/EOS). */
  encode(text, { bos = false, eos = false } = {}) {
    const ids = this.#segment(this.normalize(text)).map(([, id]) => id);
    if (bos) ids.unshift(this.bosId);
    if (eos) ids.push(this.eosId);
    return ids;
  }

  /** [piece, id] pairs; consecutive unknown pieces merged into one <unk>. */
  #segment(normalized) {
    const out = [];
    const revMerge = new Map();
    for (const piece of this.#bpe(normalized, revMerge)) {
      for (const p of this.#resegment(piece, revMerge)) {
        const id = this.ids.get(p) ?? this.unkId;
        const last = out[out.length - 1];
        if (id === this.unkId && last && last[1] === this.unkId) last[0] += p;
        else out.push([p, id]);
      }
    }
    return out;
  }

  /** BPE: from code points, merge the adjacent pair whose concatenation is the highest-scoring
   *  piece (a tie: the leftmost pair) until no adjacent pair forms a piece. As bpe_model.cc: the
   *  symbols are a linked list and the candidate pairs a heap, so n code points cost O(n log n)
   *  (rescanning every pair at each merge was O(n^2): 40,000 characters took a minute). */
  #bpe(normalized, revMerge) {
    const piece = Array.from(normalized);
    const n = piece.length;
    const prev = Array.from({ length: n }, (_, i) => i - 1);
    const next = Array.from({ length: n }, (_, i) => (i + 1 < n ? i + 1 : -1));
    const heap = new PairHeap();
    const offer = (left, right) => {
      if (left < 0 || right < 0) return;
      const score = this.merges.get(piece[left] + piece[right]);
      if (score !== undefined) heap.push({ score, left, right, size: piece[left].length + piece[right].length });
    };
    for (let i = 0; i + 1 < n; i++) offer(i, i + 1);
    while (heap.size) {
      const { left, right, size } = heap.pop();
      // stale: a symbol of the pair was merged away or grew since the pair was offered
      if (piece[left] === '' || piece[right] === '' || piece[left].length + piece[right].length !== size) continue;
      const merged = piece[left] + piece[right];
      if (this.types[this.ids.get(merged)] === UNUSED) revMerge.set(merged, [piece[left], piece[right]]);
      piece[left] = merged;
      piece[right] = '';
      next[left] = next[right];
      if (next[right] >= 0) prev[next[right]] = left;
      offer(prev[left], left);
      offer(left, next[left]);
    }
    return piece.filter((p) => p !== '');
  }

  /** An unused piece that merging formed goes back to the two pieces it was merged from. */
  #resegment(piece, revMerge) {
    const pair = revMerge.get(piece);
    if (pair === undefined) return [piece];
    return [...this.#resegment(pair[0], revMerge), ...this.#resegment(pair[1], revMerge)];
  }

  /** Text of `ids`, as SentencePieceProcessor.decode: control pieces dropped, <unk> shown as " ⁇ ",
   *  "▁" as a space, the first non-empty piece's leading "▁" dropped. */
  decode(ids) {
    let text = '';
    let atStart = true;
    for (const id of ids) {
      if (!Number.isInteger(id) || id < 0 || id >= this.size) {
        throw new RangeError(`id ${id} is not a token id (0 <= id < ${this.size})`);
      }
      const type = this.types[id];
      let surface;
      if (type === CONTROL) surface = '';
      else if (type === UNKNOWN) surface = UNK_SURFACE;
      else {
        let piece = this.pieces[id];
        if (atStart && piece.startsWith(SPACE)) piece = piece.slice(SPACE.length);
        surface = piece.replaceAll(SPACE, ' ');
      }
      if (surface !== '') atStart = false;
      text += surface;
    }
    return text;
  }
}

/** A binary max-heap of candidate pairs: the highest score first, a tie the leftmost. */
class PairHeap {
  #items = [];
  get size() { return this.#items.length; }
  #before(a, b) { return a.score > b.score || (a.score === b.score && a.left < b.left); }
  push(item) {
    const items = this.#items;
    let i = items.push(item) - 1;
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if (!this.#before(items[i], items[parent])) break;
      [items[i], items[parent]] = [items[parent], items[i]];
      i = parent;
    }
  }
  pop() {
    const items = this.#items;
    const top = items[0], last = items.pop();
    if (items.length) {
      items[0] = last;
      for (let i = 0; ;) {
        const l = 2 * i + 1, r = l + 1;
        let best = i;
        if (l < items.length && this.#before(items[l], items[best])) best = l;
        if (r < items.length && this.#before(items[r], items[best])) best = r;
        if (best === i) break;
        [items[i], items[best]] = [items[best], items[i]];
        i = best;
      }
    }
    return top;
  }
}
