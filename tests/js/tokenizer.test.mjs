// Unit tests of book/_static/translator/tokenizer.js on the shipped tokenizer (node --test tests/js/);
// the comparison with sentencepiece on whole corpora is tests/test_web_tokenizer.py's.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import { test } from 'node:test';
import { Tokenizer } from '../../book/_static/translator/tokenizer.js';

const spec = JSON.parse(fs.readFileSync(new URL('../../book/model/web/tokenizer.json', import.meta.url), 'utf8'));
const tokenizer = new Tokenizer(spec);

test('a sentence: sentencepiece\'s pieces and ids, and back', () => {
  const text = 'Ein Hund läuft im Schnee.';
  assert.deepEqual(tokenizer.encodeAsPieces(text), ['▁Ein', '▁Hund', '▁läuft', '▁im', '▁Schnee', '.']);
  assert.deepEqual(tokenizer.encode(text), [27, 226, 699, 159, 849, 7916]);
  assert.deepEqual(tokenizer.encode(text, { bos: true, eos: true }), [2, 27, 226, 699, 159, 849, 7916, 3]);
  assert.equal(tokenizer.decode(tokenizer.encode(text)), text);
});

test('whitespace is normalized: tabs, repeats, ends, no-break spaces', () => {
  const ids = tokenizer.encode('Ein Hund');
  for (const text of ['Ein  Hund', ' Ein Hund ', 'Ein\tHund\n', 'Ein\u00a0Hund', 'Ein\u200bHund']) {
    assert.deepEqual(tokenizer.encode(text), ids, JSON.stringify(text));
  }
  assert.deepEqual(tokenizer.encode('   '), []);
});

test('a run of unknown characters is one <unk>, decoded as " ⁇ "', () => {
  assert.deepEqual(tokenizer.encodeAsPieces('Hund 🐶🐕 ok'), ['▁Hund', '▁', '🐶🐕', '▁o', 'k']);
  assert.deepEqual(tokenizer.encode('Hund 🐶🐕 ok'), [226, 7900, 1, 40, 7921]);
  assert.equal(tokenizer.decode([226, 7900, 1, 40, 7921]), 'Hund  \u2047  ok');
});

test('decode drops control pieces and the first leading space', () => {
  assert.equal(tokenizer.decode([2, 24, 3]), 'A');
  assert.equal(tokenizer.decode([7900, 7900, 24]), 'A');
  assert.throws(() => tokenizer.decode([8000]), /id 8000/);
});

test('a tokenizer.json of another format is refused', () => {
  assert.throws(() => new Tokenizer({ ...spec, format: 'x' }), /format "x"/);
  assert.throws(() => new Tokenizer({ ...spec, model_type: 'unigram' }), /only "bpe"/);
});
