// Takes the README's picture of XProf's trace viewer (scripts/book-picture
// runs it): opens URL in headless Chromium at 1600x900, expands GPU 0 and
// the host's CPUs, folds GPU 1 and the mock's host threads, zooms the
// timeline to [fromMs, toMs] and writes OUT.png.
// Usage: node trace-viewer-shot.js URL OUT.png [fromMs] [toMs]
const puppeteer = require('puppeteer-core');
const [url, out, loArg, hiArg] = process.argv.slice(2);
const lo = Number(loArg || 1100), hi = Number(hiArg || 1350);
const sleep = ms => new Promise(r => setTimeout(r, ms));
(async () => {
  const browser = await puppeteer.launch({executablePath: process.env.CHROMIUM || '/usr/bin/chromium', headless: true,
    args: ['--no-sandbox', '--disable-gpu', '--hide-scrollbars'], defaultViewport: {width: 1600, height: 900}});
  try {
    const page = await browser.newPage();
    await page.goto(url, {waitUntil: 'networkidle0', timeout: 60000});
    // Close XProf's side bar (the menu button) so the timeline gets the width.
    await page.click('button');
    let tf;
    for (let i = 0; i < 60 && !tf; i++) { tf = page.frames().find(f => f.url().includes('trace_viewer_index')); if (!tf) await sleep(500); }
    // Helpers inside the trace viewer (catapult runs under the Shadow DOM polyfill: elements' JS objects are wrappers).
    await tf.waitForFunction(() => {
      window.__find = (pred) => { const all = []; (function walk(n) { if (n.nodeType === 1 && pred(n)) all.push(n);
        if (n.shadowRoot) walk(n.shadowRoot); for (const c of (n.children || [])) walk(c); })(document.documentElement); return all; };
      window.__wrap = (n) => { const k = Object.keys(n).find(k => k.startsWith('__wrapper')); return k ? n[k] : n; };
      return window.__find(n => n.classList.contains('process-track-name')).length >= 4;
    }, {timeout: 60000, polling: 500});
    await sleep(2000);
    const state = await tf.evaluate(() => {
      const want = {'/device:GPU:0 ': true, '/device:GPU:1 ': false, '/host:CPU ': false, '/host:CPUs ': true};
      for (const name of __find(n => n.classList.contains('process-track-name'))) {
        const track = __wrap(name.parentElement.parentElement);
        for (const [k, v] of Object.entries(want)) if (name.textContent.includes(k)) track.expanded = v;
      }
      return __find(n => n.classList.contains('process-track-name')).map(n => n.textContent.trim() + ':' + n.parentElement.parentElement.className);
    });
    console.log(state.join('\n'));
    await sleep(1000);
    // Fold GPU:0's "Framework Name Scope" line to one row (its arrow), to leave room for more CPU thread lines.
    const arrow = await tf.evaluate(() => {
      const h = __find(n => n.id === 'arrow' && n.textContent.includes('▾') && n.getBoundingClientRect().width > 0 &&
        n.parentElement.textContent.includes('Framework Name Scope'))[0];
      if (!h) return null; const r = h.getBoundingClientRect(); return {x: r.x + r.width / 2, y: r.y + r.height / 2};
    });
    console.log('arrow', JSON.stringify(arrow));
    if (arrow) { const fb0 = await (await tf.frameElement()).boundingBox(); await page.mouse.click(fb0.x + arrow.x, fb0.y + arrow.y); await sleep(800); }
    // Zoom the timeline to [lo, hi] ms (what 'w'/'s' and the mouse wheel do, set exactly).
    const range = await tf.evaluate((lo, hi) => {
      const tv = __wrap(__find(n => n.tagName.toLowerCase() === 'tr-ui-timeline-track-view')[0]);
      const vp = tv.viewport; const dt = new tr.ui.TimelineDisplayTransform(vp.currentDisplayTransform);
      dt.xSetWorldBounds(lo, hi, tv.modelTrackContainer_.canvas.width);
      vp.setDisplayTransformImmediately(dt);
      return [tv.model_.bounds.min, tv.model_.bounds.max];
    }, lo, hi);
    console.log('model bounds (ms)', JSON.stringify(range));
    await page.mouse.move(5, 890);
    await sleep(1500);
    await page.screenshot({path: out});
  } finally { await browser.close(); }
})();
