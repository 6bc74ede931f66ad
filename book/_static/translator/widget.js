// The trained model in a page: type a German sentence, press Translate, and read the translation,
// the five most probable next pieces at each step (a slider) and the cross-attention of a chosen
// layer and head (source pieces x target pieces).
//
// A classic script, not a module, so that a page opened from disk (file://) still loads without
// an error; the book build (book/_ext/translator_site.py) adds it, with widget.css, only to pages
// that hold a <div class="book-translator">. Until the reader first presses Translate it loads
// nothing else: then it imports onnxruntime-web (single-threaded WASM: no cross-origin isolation
// needed) and translator.js, and fetches the web export (appendix I: config.json, tokenizer.json,
// the two graphs and their shared int8 weights), all from the site itself, never from elsewhere.
//
// The div's attributes: data-size="small" (the front page: the translation and a link to the
// trace), data-trace-page="11_traced.html" (where that link goes). The page's `?sentence=...`
// (and `&beam=4`) fills in the box and translates at once; each translation writes them back into
// the address, so a reader can share a link to it. The box takes MAX_CHARS characters, and a longer
// `?sentence=` is cut to them before anything runs: a shared link cannot freeze a reader's tab (the
// model reads 255 pieces of the source at most, about a thousand characters). Timings are recorded
// as performance measures named "book-translator:load", ":translate" and ":trace"; the div's
// data-state says where it is (idle, loading, translating, tracing, done, error).
(() => {
  'use strict';
  const BASE = new URL('.', document.currentScript.src); // _static/translator/
  const RUNTIME = new URL('ort/', BASE); // onnxruntime-web's files, copied from its npm package
  const MODEL = new URL('model/', BASE); // book/model/web/
  const SVG = 'http://www.w3.org/2000/svg';
  const MAX_CHARS = 2000; // what the box takes (said under it); the model reads the first 255 pieces
  let engine = null; // the promise of one Translator, shared by every widget of the page

  function el(tag, attrs = {}, ...children) {
    const node = tag.startsWith('svg:') ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === 'text') node.textContent = v;
      else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    node.append(...children);
    return node;
  }

  async function fetchOk(url) {
    const response = await fetch(url);
    if (!response.ok) throw new Error(`${url.pathname}: HTTP ${response.status}`);
    return response;
  }

  /** onnxruntime-web, translator.js and the model, once per page. */
  async function loadEngine() {
    performance.mark('book-translator:load-start');
    const [ort, { Translator }] = await Promise.all([
      import(new URL('ort.wasm.bundle.min.js', RUNTIME).href), import(new URL('translator.js', BASE).href)]);
    ort.env.wasm.numThreads = 1;
    ort.env.wasm.wasmPaths = { wasm: new URL('ort-wasm-simd-threaded.wasm', RUNTIME).href }; // its loader is in the bundle
    const translator = await Translator.fromFiles(ort, async (name) =>
      new Uint8Array(await (await fetchOk(new URL(name, MODEL))).arrayBuffer()), { executionProviders: ['wasm'] });
    performance.measure('book-translator:load', 'book-translator:load-start');
    return translator;
  }

  function mount(root) {
    const small = root.dataset.size === 'small';
    const input = el('input', { type: 'text', class: 'bt-input', 'aria-label': 'A German sentence',
      placeholder: 'Ein Hund läuft im Schnee.', value: 'Ein Hund läuft im Schnee.', spellcheck: 'false',
      maxlength: String(MAX_CHARS) });
    const cap = (text) => Array.from(text).slice(0, MAX_CHARS).join(''); // by code points: a pair is never split
    const search = el('select', { class: 'bt-search', 'aria-label': 'Search' },
      el('option', { value: '1', text: 'greedy' }), el('option', { value: '4', text: 'beam 4' }));
    const button = el('button', { type: 'submit', class: 'bt-button', text: 'Translate' });
    const form = el('form', { class: 'bt-form' }, input, search, button);
    const status = el('p', { class: 'bt-status', role: 'status', 'aria-live': 'polite',
      text: 'The model and its runtime load from this site when you first press Translate.' });
    const output = el('p', { class: 'bt-output', lang: 'en' });
    const note = el('p', { class: 'bt-note', text: `Up to ${MAX_CHARS.toLocaleString('en')} characters; the model reads the first 255 pieces.` });
    const parts = [form, note, status, output];
    let trace = null;
    if (small) {
      trace = el('a', { class: 'bt-link', hidden: '' });
      parts.push(el('p', {}, trace));
    } else {
      trace = el('div', { class: 'bt-trace', hidden: '' });
      parts.push(trace);
    }
    root.replaceChildren(...parts);
    root.dataset.state = 'idle';
    let busy = false;

    async function translate() {
      const text = cap(input.value.trim());
      if (!text || busy) return;
      busy = true;
      button.disabled = true;
      const beamSize = Number(search.value);
      try {
        if (!engine) {
          root.dataset.state = 'loading';
          status.textContent = 'Loading the model and onnxruntime-web (once)…';
          engine = loadEngine();
        }
        let translator;
        try {
          translator = await engine;
        } catch (error) {
          engine = null; // a later press tries again
          throw error;
        }
        root.dataset.state = 'translating';
        status.textContent = beamSize === 1 ? 'Translating (greedy)…' : `Translating (beam ${beamSize})…`;
        performance.mark('book-translator:translate-start');
        const out = await translator.translate(text, { beamSize });
        performance.measure('book-translator:translate', 'book-translator:translate-start');
        output.textContent = out.text;
        const url = new URL(location.href);
        url.searchParams.set('sentence', text);
        if (beamSize === 1) url.searchParams.delete('beam');
        else url.searchParams.set('beam', String(beamSize));
        history.replaceState(history.state, '', url);
        if (small) {
          const page = new URL(root.dataset.tracePage || '11_traced.html', location.href);
          page.search = url.search;
          page.hash = 'try-your-own-sentence';
          trace.href = page.href;
          trace.textContent = 'Step through it, with its attention, in chapter 11 →';
          trace.hidden = false;
          status.textContent = '';
        } else {
          root.dataset.state = 'tracing';
          status.textContent = 'Tracing each step…';
          performance.mark('book-translator:trace-start');
          const steps = await translator.trace(out.srcIds, out.ids);
          performance.measure('book-translator:trace', 'book-translator:trace-start');
          drawTrace(trace, translator, out, steps);
          status.textContent = '';
        }
        root.dataset.state = 'done';
      } catch (error) {
        root.dataset.state = 'error';
        status.textContent = location.protocol === 'file:'
          ? 'The translator needs the book served over http(s): a page opened from disk cannot load its modules.'
          : `The translator failed: ${error && error.message ? error.message : error}`;
        console.warn('book-translator:', error);
      } finally {
        busy = false;
        button.disabled = false;
      }
    }

    form.addEventListener('submit', (event) => {
      event.preventDefault();
      translate();
    });
    const params = new URLSearchParams(location.search);
    if (params.get('beam') === '4') search.value = '4';
    if (params.get('sentence')) {
      input.value = cap(params.get('sentence'));
      translate();
    }
  }

  /** The step slider with the top 5, and the cross-attention map of a chosen layer and head. */
  function drawTrace(box, translator, out, steps) {
    const pieces = translator.tokenizer.pieces;
    const source = out.srcIds.map((id) => pieces[id]); // "▁" marks the start of a word, as in the chapter
    const written = steps.map((s) => pieces[s.id]);
    const L = steps[0].attention.length, H = steps[0].attention[0].length;
    const slider = el('input', { type: 'range', min: '0', max: String(steps.length - 1), value: '0',
      class: 'bt-slider', 'aria-label': 'Step' });
    const caption = el('p', { class: 'bt-caption' });
    const top = el('table', { class: 'bt-top' });
    const layer = el('select', { 'aria-label': 'Layer' },
      ...Array.from({ length: L }, (_, l) => el('option', { value: String(l), text: `layer ${l + 1}` })));
    layer.value = String(L - 1);
    const head = el('select', { 'aria-label': 'Head' }, el('option', { value: 'mean', text: 'mean of heads' }),
      ...Array.from({ length: H }, (_, h) => el('option', { value: String(h), text: `head ${h + 1}` })));
    const map = el('div', { class: 'bt-map' });

    function weights(t) {
      const a = steps[t].attention[Number(layer.value)];
      if (head.value !== 'mean') return a[Number(head.value)];
      return a[0].map((_, s) => a.reduce((sum, row) => sum + row[s], 0) / H);
    }

    function drawStep() {
      const t = Number(slider.value);
      const before = translator.tokenizer.decode(out.ids.slice(0, t));
      caption.replaceChildren(`Step ${t + 1} of ${steps.length}: after “${before || '<s>'}” the model writes `,
        el('code', { text: written[t] }), '.');
      top.replaceChildren(el('tr', {}, el('th', { text: 'next piece' }), el('th', { text: 'probability' })),
        ...steps[t].top.map(({ id, p }) => el('tr', id === steps[t].id ? { class: 'bt-chosen' } : {},
          el('td', {}, el('code', { text: pieces[id] })),
          el('td', {}, el('span', { class: 'bt-bar', style: `width:${(100 * p).toFixed(1)}%` }),
            el('span', { class: 'bt-p', text: `${(100 * p).toFixed(1)}%` })))));
      for (const row of map.querySelectorAll('.bt-row')) row.classList.toggle('bt-current', Number(row.dataset.step) === t);
    }

    function drawMap() {
      const cell = 22, char = 7.2;
      const left = 10 + char * Math.max(...written.map((p) => p.length));
      const topMargin = 10 + char * Math.max(...source.map((p) => p.length));
      const w = left + cell * source.length, h = topMargin + cell * written.length;
      const rows = steps.map((_, t) => weights(t));
      const max = Math.max(...rows.flat()) || 1;
      const svg = el('svg:svg', { viewBox: `0 0 ${w} ${h}`, width: String(w), height: String(h), role: 'img',
        'aria-label': `Cross-attention, layer ${Number(layer.value) + 1}, ${head.value === 'mean' ? 'mean of heads' : `head ${Number(head.value) + 1}`}` });
      source.forEach((p, s) => svg.append(el('svg:text', { x: '0', y: '0', class: 'bt-label',
        transform: `translate(${left + cell * s + cell / 2 + 4},${topMargin - 6}) rotate(-90)`, text: p })));
      rows.forEach((row, t) => {
        const g = el('svg:g', { class: 'bt-row', 'data-step': String(t) });
        g.append(el('svg:text', { x: String(left - 6), y: String(topMargin + cell * t + cell / 2 + 4), class: 'bt-label',
          'text-anchor': 'end', text: written[t] }));
        row.forEach((a, s) => g.append(el('svg:rect', { x: String(left + cell * s), y: String(topMargin + cell * t),
          width: String(cell - 1), height: String(cell - 1), class: 'bt-cell', 'fill-opacity': (a / max).toFixed(3) },
        el('svg:title', { text: `${written[t]} ← ${source[s]}: ${a.toFixed(3)}` }))));
        g.append(el('svg:rect', { x: String(left - 2), y: String(topMargin + cell * t - 1), width: String(cell * source.length + 2),
          height: String(cell + 1), class: 'bt-outline' }));
        g.addEventListener('click', () => { slider.value = String(t); drawStep(); });
        svg.append(g);
      });
      map.replaceChildren(svg);
      map.dataset.rows = String(written.length);
      map.dataset.columns = String(source.length);
      drawStep();
    }

    slider.addEventListener('input', drawStep);
    layer.addEventListener('change', drawMap);
    head.addEventListener('change', drawMap);
    box.replaceChildren(
      el('div', { class: 'bt-steps' }, el('label', {}, 'step ', slider), caption, top),
      el('div', { class: 'bt-attention' },
        el('p', { class: 'bt-controls' }, 'Cross-attention of ', layer, ' ', head,
          ': each row is a written piece, each column a source piece; darker is more attention.'),
        map));
    drawMap();
    box.hidden = false;
  }

  const start = () => document.querySelectorAll('.book-translator').forEach(mount);
  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
