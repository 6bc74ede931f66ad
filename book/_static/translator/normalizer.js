// sentencepiece's normalizer in two forms:
// - exact: the model's compiled rule table (normalizer_spec.precompiled_charsmap: a double-array
//   trie over UTF-8 bytes and the replacement strings), applied as sentencepiece applies it, the
//   longest matching rule at each position (normalizer.cc, NormalizePrefix);
// - rules: "nmt_nfkc" as Unicode NFKC plus the rules sentencepiece adds for machine translation
//   (builder.cc, BuildNmtNFKCMap), for a tokenizer.json without the table. It gives the same text
//   as each of the table's 225,276 rules and on all of Multi30k; it differs where NFKC composes or
//   reorders combining marks across two of the table's matches (a few in 10,000 random strings of
//   mixed scripts and marks; tests/test_web_tokenizer.py).

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

/** The compiled table: `bytes` (Uint8Array) = uint32 LE trie size, the trie (uint32 units),
 *  then the replacement strings, each ending in NUL. */
export class CharsMap {
  constructor(bytes) {
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const trieSize = view.getUint32(0, true);
    if (trieSize % 4 !== 0 || trieSize + 4 > bytes.length) throw new Error(`precompiled_charsmap: trie size ${trieSize} does not fit ${bytes.length} bytes`);
    this.units = new Uint32Array(trieSize / 4);
    for (let i = 0; i < this.units.length; i++) this.units[i] = view.getUint32(4 + 4 * i, true);
    this.strings = bytes.subarray(4 + trieSize);
    this.decoder = new TextDecoder('utf-8');
  }

  static fromBase64(text) {
    const binary = atob(text);
    return new CharsMap(Uint8Array.from(binary, (c) => c.charCodeAt(0)));
  }

  /** The longest rule at `bytes[start..]`: [length in bytes, replacement], or null (darts-clone's
   *  commonPrefixSearch, keeping the longest match). */
  longestMatch(bytes, start) {
    const units = this.units;
    let pos = offset(units[0]);
    let found = null;
    for (let i = start; i < bytes.length; i++) {
      pos ^= bytes[i];
      const unit = units[pos];
      if (unit === undefined || (unit & 0x800000ff) >>> 0 !== bytes[i]) break; // label
      pos ^= offset(unit);
      if ((unit >>> 8) & 1) found = [i + 1 - start, units[pos] & 0x7fffffff]; // has_leaf: the value
    }
    if (found === null) return null;
    const end = this.strings.indexOf(0, found[1]);
    return [found[0], this.decoder.decode(this.strings.subarray(found[1], end))];
  }

  /** The text with every position's longest rule applied; other characters copied. */
  apply(text) {
    const bytes = new TextEncoder().encode(text);
    let out = '';
    for (let i = 0; i < bytes.length;) {
      const match = this.longestMatch(bytes, i);
      if (match) {
        out += match[1];
        i += match[0];
      } else {
        const n = bytes[i] < 0x80 ? 1 : bytes[i] < 0xe0 ? 2 : bytes[i] < 0xf0 ? 3 : 4; // one UTF-8 character
        out += this.decoder.decode(bytes.subarray(i, i + n));
        i += n;
      }
    }
    return out;
  }
}

function offset(unit) {
  return (unit >>> 10) << ((unit & (1 << 9)) >>> 6);
}

/**
 * sentencepiece's Normalizer::Normalize: the rule, then (remove_extra_whitespaces) no leading,
 * trailing or repeated spaces, (add_dummy_prefix) a space in front, (escape_whitespaces) every
 * space written as "▁" (U+2581).
 */
export function normalize(text, spec, charsMap = null) {
  let s = charsMap ? charsMap.apply(text) : normalizeRule(text, spec.name);
  if (spec.remove_extra_whitespaces) s = s.replace(/ +/g, ' ').replace(/^ | $/g, '');
  if (s === '') return '';
  if (spec.add_dummy_prefix) s = ' ' + s;
  if (spec.escape_whitespaces) s = s.replaceAll(' ', '\u2581');
  return s;
}
