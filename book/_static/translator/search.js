// Greedy search and beam search for the translator, written against an abstract model step so
// they run on the ONNX decoder in a page and on a fake model in the tests. They copy
// transformer/decoding.py (chapter 9): the same output limit, stopping rules and GNMT length penalty.
//
// `step(prefixes)`: prefixes is an array of token-id arrays (each starts with BOS); it returns (or
// resolves to) one array of next-token logits per prefix.

/** GNMT's lp(Y) = ((5 + |Y|) / 6) ** alpha; |Y| counts output tokens, EOS included. */
export function lengthPenalty(length, alpha = 0.6) {
  return ((5 + length) / 6) ** alpha;
}

/** How many tokens (EOS included) an output may have: the source length (its EOS included) +
 *  extraLen, within the model's maxLen (decoding.py's _output_limits). */
export function outputLimit(srcLength, { extraLen = 50, maxLen = 1024 } = {}) {
  if (!Number.isInteger(srcLength) || srcLength < 1) {
    throw new RangeError(`srcLength=${srcLength} must be an int >= 1 (the source ids, EOS included)`);
  }
  return Math.max(1, Math.min(srcLength + extraLen, maxLen - 1));
}

/** log softmax in float64. */
export function logSoftmax(logits) {
  let max = -Infinity;
  for (const x of logits) if (x > max) max = x;
  let sum = 0;
  for (const x of logits) sum += Math.exp(x - max);
  const logZ = max + Math.log(sum);
  return Array.from(logits, (x) => x - logZ);
}

/** The k most probable next tokens: [{id, p}], most probable first. */
export function topK(logProbs, k = 5) {
  return Array.from(logProbs, (lp, id) => ({ id, lp }))
    .sort((a, b) => b.lp - a.lp || a.id - b.id)
    .slice(0, k)
    .map(({ id, lp }) => ({ id, p: Math.exp(lp) }));
}

function untilEos(ids, eos, pad) {
  const out = [];
  for (const id of ids) {
    if (id === eos) break;
    if (id !== pad) out.push(id);
  }
  return out;
}

/**
 * Greedy search for one sentence: the most probable next token until EOS or the output limit.
 * Returns {ids (no BOS, no EOS), steps: [{id, top: [{id, p}] (the `top` most probable)}]}.
 */
export async function greedySearch(step, { srcLength, bos, eos, pad = 0, extraLen = 50, maxLen = 1024, top = 5 }) {
  const limit = outputLimit(srcLength, { extraLen, maxLen });
  const ys = [bos];
  const steps = [];
  for (let t = 0; t < limit; t++) {
    const [logits] = await step([ys]);
    let next = 0;
    for (let v = 1; v < logits.length; v++) if (logits[v] > logits[next]) next = v; // a tie: the lower id, as torch.argmax
    steps.push({ id: next, top: topK(logSoftmax(logits), top) });
    ys.push(next);
    if (next === eos) break;
  }
  return { ids: untilEos(ys.slice(1), eos, pad), steps };
}

/**
 * Beam search for one sentence (decoding.py's beam_search with B = 1). Each step extends the K
 * hypotheses by every token and takes the 2K best extensions by log P: an EOS among the first K
 * finishes a hypothesis, scored log P / lp(its length, EOS included); the K best that are not
 * EOS go on. At the output limit the kept ones finish too (without EOS). It stops when K
 * hypotheses have finished or none goes on; the best normalized score wins (a tie keeps the
 * earlier). Returns {ids (no BOS, no EOS; [] if none finished), score (normalized), logP}.
 */
export async function beamSearch(step, { srcLength, bos, eos, pad = 0, beamSize = 4, alpha = 0.6, extraLen = 50, maxLen = 1024 }) {
  if (!Number.isInteger(beamSize) || beamSize < 1) throw new RangeError(`beamSize=${beamSize} must be an int >= 1`);
  if (!(alpha >= 0)) throw new RangeError(`alpha=${alpha} must be >= 0`);
  const K = beamSize;
  const limit = outputLimit(srcLength, { extraLen, maxLen });
  let beams = [{ ys: [bos], score: 0 }]; // the live hypotheses, best first; at most K
  let best = { ids: [], score: -Infinity, logP: -Infinity };
  let ended = 0;
  for (let t = 0; t < limit; t++) {
    const logits = await step(beams.map((b) => b.ys));
    const cand = [];
    beams.forEach((b, k) => {
      const logProbs = logSoftmax(logits[k]);
      logProbs.forEach((lp, token) => cand.push({ k, token, score: b.score + lp, flat: k * logProbs.length + token }));
    });
    cand.sort((a, b) => b.score - a.score || a.flat - b.flat);
    const top = cand.slice(0, 2 * K).filter((c) => Number.isFinite(c.score));
    const full = t + 1 >= limit;
    const finished = []; // in decoding.py's order: the EOS ones among the first K, then (at the limit) the kept ones
    const kept = [];
    top.forEach((c, i) => {
      if (c.token === eos) {
        if (i < K) finished.push({ ...c, ids: beams[c.k].ys.slice(1) });
      } else if (kept.length < K) {
        kept.push(c);
      }
    });
    if (full) kept.forEach((c) => finished.push({ ...c, ids: [...beams[c.k].ys.slice(1), c.token] }));
    const lp = lengthPenalty(t + 1, alpha);
    for (const f of finished) {
      if (f.score / lp > best.score) best = { ids: untilEos(f.ids, eos, pad), score: f.score / lp, logP: f.score };
    }
    ended += finished.length;
    if (ended >= K || full || kept.length === 0) break;
    beams = kept.map((c) => ({ ys: [...beams[c.k].ys, c.token], score: c.score }));
  }
  return best;
}
