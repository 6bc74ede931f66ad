// A deterministic fake translation model, defined identically in tests/test_web_tokenizer.py
// (fake_logits): the logits of the next token are a 32-bit FNV-1a hash of (source, prefix, token)
// with murmur3's finalizer, rounded to float32 as an ONNX decoder's are, with EOS made likelier
// as the output grows.
export const V = 12, PAD = 0, BOS = 2, EOS = 3;

export function fakeLogits(src, prefix) {
  const logits = [];
  for (let v = 0; v < V; v++) {
    let h = 2166136261;
    for (const x of [...src, 0xffff, ...prefix, v]) {
      h = Math.imul((h ^ x) >>> 0, 16777619) >>> 0;
    }
    h ^= h >>> 16; h = Math.imul(h, 0x85ebca6b) >>> 0; // murmur3's finalizer: mixes the last token in
    h ^= h >>> 13; h = Math.imul(h, 0xc2b2ae35) >>> 0;
    h = (h ^ (h >>> 16)) >>> 0;
    let logit = (h / 2 ** 32) * 8 - 4;
    if (v === EOS) logit += 0.35 * (prefix.length - 1);
    if (v === PAD || v === BOS) logit = -30; // never chosen, as in the trained model
    logits.push(Math.fround(logit));
  }
  return logits;
}

/** The `step` function of search.js for one source sentence. */
export function fakeStep(src) {
  return (prefixes) => prefixes.map((prefix) => fakeLogits(src, prefix));
}
