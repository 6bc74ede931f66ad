// sentencepiece's "nmt_nfkc" normalizer: Unicode NFKC plus the rules sentencepiece adds for
// machine translation (builder.cc, BuildNmtNFKCMap). The model stores it as a compiled table of
// 225,276 rules; tests/test_web_tokenizer.py checks this code against every one of them.

// Code points where nmt_nfkc differs from plain NFKC (String.prototype.normalize, Unicode 15+).
const REMOVED = [...range(0x01, 0x08), 0x0b, ...range(0x0e, 0x1f), 0x7f, 0x8f, 0x9f];
const TO_SPACE = [0x09, 0x0a, 0x0c, 0x0d, 0x061c, 0x1680, 0x200b, 0x200c, 0x200e, 0x200f, 0x2028,
  0x2029, 0x2581, 0xfeff, 0xfffd];
const KEPT = [0xff5e]; // FULLWIDTH TILDE: NFKC folds it to "~", nmt_nfkc leaves it

export const NMT_EXCEPTIONS = new Map([
  ...REMOVED.map((cp) => [cp, '']),
  ...TO_SPACE.map((cp) => [cp, ' ']),
  ...KEPT.map((cp) => [cp, String.fromCodePoint(cp)]),
]);

function range(a, b) {
  return Array.from({ length: b - a + 1 }, (_, i) => a + i);
}

/** The text after the model's normalization rule (before whitespace handling). */
export function normalizeRule(text, name) {
  if (name === 'identity') return text;
  if (name !== 'nmt_nfkc' && name !== 'nfkc') {
    throw new Error(`normalizer ${JSON.stringify(name)} is not supported; expected "nmt_nfkc", "nfkc" or "identity"`);
  }
  if (name === 'nfkc') return text.normalize('NFKC');
  let out = '';
  let run = '';
  for (const ch of text) {
    const rule = NMT_EXCEPTIONS.get(ch.codePointAt(0));
    if (rule === undefined) {
      run += ch;
    } else {
      out += run.normalize('NFKC') + rule;
      run = '';
    }
  }
  return out + run.normalize('NFKC');
}

/**
 * sentencepiece's Normalizer::Normalize: the rule, then (remove_extra_whitespaces) no leading,
 * trailing or repeated spaces, (add_dummy_prefix) a space in front, (escape_whitespaces) every
 * space written as "▁" (U+2581).
 */
export function normalize(text, spec) {
  let s = normalizeRule(text, spec.name);
  if (spec.remove_extra_whitespaces) s = s.replace(/ +/g, ' ').replace(/^ | $/g, '');
  if (s === '') return '';
  if (spec.add_dummy_prefix) s = ' ' + s;
  if (spec.escape_whitespaces) s = s.replaceAll(' ', '\u2581');
  return s;
}
