// Unit tests of book/_static/translator/search.js on tiny fake models (node --test tests/js/).
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { beamSearch, greedySearch, lengthPenalty, logSoftmax, outputLimit, topK } from '../../book/_static/translator/search.js';
import { BOS, EOS, fakeStep } from './fake_model.mjs';

// A model given as a table: the next-token probabilities after each prefix (ids after BOS, joined by ',').
function tableStep(table, V = 6) {
  return (prefixes) => prefixes.map((ys) => {
    const probs = table[ys.slice(1).join(',')] ?? { [EOS]: 1 };
    return Array.from({ length: V }, (_, v) => Math.log(probs[v] ?? 1e-12));
  });
}

test('the length penalty is GNMT\'s ((5 + len) / 6) ** alpha', () => {
  assert.equal(lengthPenalty(1, 0.6), 1);
  assert.equal(lengthPenalty(7, 1), 2);
  assert.equal(lengthPenalty(10, 0), 1);
});

test('the output limit is the source length + extraLen, within maxLen - 1', () => {
  assert.equal(outputLimit(5), 55);
  assert.equal(outputLimit(5, { extraLen: 0 }), 5);
  assert.equal(outputLimit(2000), 1023);
  assert.throws(() => outputLimit(0), /srcLength=0/);
});

test('logSoftmax sums to one and topK sorts by probability', () => {
  const lp = logSoftmax([1, 2, 3, 1000]);
  assert.ok(Math.abs(lp.reduce((s, x) => s + Math.exp(x), 0) - 1) < 1e-12);
  assert.deepEqual(topK(lp, 2).map((t) => t.id), [3, 2]);
});

test('greedy search takes the most probable token and stops at EOS', async () => {
  const table = { '': { 4: 0.6, 5: 0.4 }, '4': { 5: 0.9, [EOS]: 0.1 }, '4,5': { [EOS]: 1 } };
  const out = await greedySearch(tableStep(table), { srcLength: 3, bos: BOS, eos: EOS });
  assert.deepEqual(out.ids, [4, 5]);
  assert.equal(out.steps.length, 3);
  assert.equal(out.steps[0].top[0].id, 4);
  assert.ok(Math.abs(out.steps[0].top[0].p - 0.6) < 1e-9);
});

test('greedy search stops at the output limit', async () => {
  const loop = (prefixes) => prefixes.map(() => [0, 0, 0, 0, 5, 0]); // always token 4, never EOS
  const out = await greedySearch(loop, { srcLength: 2, bos: BOS, eos: EOS, extraLen: 1 });
  assert.deepEqual(out.ids, [4, 4, 4]);
});

test('beam search finds what greedy misses', async () => {
  // greedy: 4 (0.5) then 5 or 4 (0.5 each) -> P = 0.25; beam: 5 (0.4) then EOS (1.0) -> P = 0.4
  const table = { '': { 4: 0.5, 5: 0.4, [EOS]: 0.1 }, '4': { 4: 0.5, 5: 0.5 }, '5': { [EOS]: 1 } };
  const greedy = await greedySearch(tableStep(table), { srcLength: 3, bos: BOS, eos: EOS });
  assert.deepEqual(greedy.ids.slice(0, 2), [4, 4]);
  const beam = await beamSearch(tableStep(table), { srcLength: 3, bos: BOS, eos: EOS, beamSize: 2 });
  assert.deepEqual(beam.ids, [5]);
  assert.ok(Math.abs(beam.logP - Math.log(0.4)) < 1e-9);
  assert.ok(Math.abs(beam.score - Math.log(0.4) / lengthPenalty(2)) < 1e-9);
});

test('the length penalty lets a longer hypothesis win', async () => {
  // short: EOS now, log P = log 0.3 over lp(1) = 1; long: 4 4 EOS, log P = log(0.28 * 0.9 * 0.9)
  const table = { '': { [EOS]: 0.3, 4: 0.28, 5: 0.42 }, '4': { 4: 0.9, 5: 0.1 }, '4,4': { [EOS]: 0.9, 5: 0.1 },
    '5': { 4: 0.34, 5: 0.33, 1: 0.33 } };
  const options = { srcLength: 3, bos: BOS, eos: EOS, beamSize: 3 };
  const plain = await beamSearch(tableStep(table), { ...options, alpha: 0 });
  const normalized = await beamSearch(tableStep(table), { ...options, alpha: 1.5 });
  assert.deepEqual(plain.ids, []); // log 0.3 > log 0.2268
  assert.deepEqual(normalized.ids, [4, 4]);
});

test('beam size 1 is greedy search on the fake model', async () => {
  for (let n = 1; n <= 20; n++) {
    const src = [...Array.from({ length: n % 7 + 1 }, (_, i) => 4 + ((n * 7 + i * 3) % 8)), EOS];
    const options = { srcLength: src.length, bos: BOS, eos: EOS, extraLen: 3 };
    const greedy = await greedySearch(fakeStep(src), options);
    const beam = await beamSearch(fakeStep(src), { ...options, beamSize: 1 });
    assert.deepEqual(beam.ids, greedy.ids, `source ${src}`);
  }
});

test('bad arguments say what was wrong', async () => {
  await assert.rejects(beamSearch(fakeStep([3]), { srcLength: 1, bos: BOS, eos: EOS, beamSize: 0 }), /beamSize=0/);
  await assert.rejects(beamSearch(fakeStep([3]), { srcLength: 1, bos: BOS, eos: EOS, alpha: -1 }), /alpha=-1/);
});
