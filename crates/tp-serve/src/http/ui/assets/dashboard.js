// The dashboard page: reads /dashboard.json once a second and shows the server's figures,
// a row per rank (the slowest marked) and charts of the last minutes. Text only: every
// element is built with textContent.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY = 'tp-api-key';
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const fmt = (v, digits) => (v === null || v === undefined ? '–' : Number(v).toFixed(digits));
  const bytes = (b) => {
    if (b >= 1e9) return (b / 1e9).toFixed(2) + ' GB';
    if (b >= 1e6) return (b / 1e6).toFixed(1) + ' MB';
    if (b >= 1e3) return (b / 1e3).toFixed(1) + ' kB';
    return Math.round(b) + ' B';
  };

  function askKey(why) {
    return new Promise((resolve) => {
      $('key-why').textContent = why;
      const form = $('key-form');
      const submit = (e) => {
        e.preventDefault();
        const k = $('key').value.trim();
        if (!k) return;
        sessionStorage.setItem(KEY, k);
        form.removeEventListener('submit', submit);
        $('key-dialog').close();
        resolve();
      };
      form.addEventListener('submit', submit);
      $('key-dialog').showModal();
      $('key').focus();
    });
  }

  async function fetchFigures() {
    for (;;) {
      const h = {};
      const k = sessionStorage.getItem(KEY);
      if (k) h.authorization = 'Bearer ' + k;
      const resp = await fetch('/dashboard.json', { headers: h, cache: 'no-store' });
      if (resp.status === 401) {
        const body = await resp.json().catch(() => null);
        await askKey((body && body.error && body.error.message) || 'This server needs an API key.');
        continue;
      }
      if (!resp.ok) throw new Error(resp.status + ' ' + resp.statusText);
      return resp.json();
    }
  }

  function cards(d) {
    const s = d.server;
    const items = [
      ['Queue', s.queue],
      ['Running', s.running],
      ['Tokens/s', fmt(s.tokens_per_second, 1)],
      ['TTFT p50 ms', fmt(s.ttft_p50_ms, 1)],
      ['TTFT p99 ms', fmt(s.ttft_p99_ms, 1)],
      ['TPOT p50 ms', fmt(s.tpot_p50_ms, 2)],
      ['TPOT p99 ms', fmt(s.tpot_p99_ms, 2)],
      ['Prefix-cache hits', s.prefix_cache_hits],
      ['Preemptions', s.preemptions],
      ['Generated tokens', s.generated_tokens],
      ['Steps', s.steps],
      ['KV blocks', s.kv_blocks_total],
    ];
    if (d.canary) {
      items.push(['Canary', (d.canary.drift ? 'DRIFT' : 'pass') + ' (' + d.canary.runs + ' runs)']);
    }
    const r = d.rollout;
    if (r && (r.switches > 0 || r.rollbacks > 0 || r.reload_failures > 0 || r.models.length > 1 || r.loading)) {
      items.push(['Live model', 'model ' + r.live.id + (r.live.name ? ' (' + r.live.name + ')' : '')]);
      items.push(['Switches / rollbacks', r.switches + ' / ' + r.rollbacks]);
      items.push(['Failed reloads', r.reload_failures]);
      if (r.loading) {
        items.push(['Loading', r.loading]);
      }
      if (r.last_event) {
        items.push(['Last model event', r.last_event]);
      }
    }
    $('cards').replaceChildren(
      ...items.map(([label, value]) => {
        const c = el('div', 'card');
        c.append(el('div', 'label', label), el('div', 'value', String(value)));
        return c;
      }),
    );
  }

  function ranks(d) {
    const body = $('ranks').querySelector('tbody');
    body.replaceChildren(
      ...d.ranks.map((r) => {
        const tr = el('tr', r.slowest ? 'slowest' : '');
        tr.dataset.rank = r.rank;
        const first = el('td', '', String(r.rank));
        if (r.slowest) first.append(el('span', 'badge', 'slowest'));
        tr.append(
          first,
          el('td', '', r.host),
          el('td', 'compute', fmt(r.compute_ms_per_step, 3)),
          el('td', 'collective', fmt(r.collective_ms_per_step, 3)),
          el('td', 'wait', fmt(r.wait_ms_per_step, 3)),
          el('td', 'sent-step', bytes(r.bytes_sent_per_step)),
          el('td', 'sent', bytes(r.bytes_sent_total)),
          el('td', 'kv-used', String(r.kv_blocks_used)),
          el('td', 'kv-free', String(r.kv_blocks_free)),
          el('td', 'load', fmt(r.load_seconds, 3)),
          el('td', 'memory', bytes(r.memory_bytes)),
        );
        return tr;
      }),
    );
    const c = d.collection;
    $('collection').textContent =
      'Collecting these figures: ' + c.busy_polls + ' polls while serving, ' + fmt(c.mean_poll_ms, 3) +
      ' ms each, ' + fmt(c.share_of_step_time * 100, 3) + '% of step time.';
  }

  const COLORS = ['#2457c5', '#c53d24', '#2a9d3c', '#a15c00', '#7b3fc5', '#0f8b8d', '#b5179e', '#555'];

  // One chart: `series` is a list of [name, values] over the samples' times.
  function chart(title, times, series) {
    const box = el('div', 'chart');
    box.append(el('div', 'label', title));
    const canvas = el('canvas');
    canvas.width = 520;
    canvas.height = 140;
    canvas.setAttribute('role', 'img');
    const last = series.map(([name, v]) => name + ' ' + fmt(v[v.length - 1], 2)).join(', ');
    canvas.setAttribute('aria-label', title + ': latest ' + last);
    box.append(canvas);
    const legend = el('div', 'stats');
    series.forEach(([name], i) => {
      const s = el('span', '', '■ ' + name + '  ');
      s.style.color = COLORS[i % COLORS.length];
      legend.append(s);
    });
    box.append(legend);
    const ctx = canvas.getContext('2d');
    const values = series.flatMap(([, v]) => v.filter((x) => x !== null && x !== undefined));
    const max = Math.max(1e-9, ...values);
    const t0 = times.length ? times[0] : 0;
    const span = Math.max(1, (times.length ? times[times.length - 1] : 1) - t0);
    ctx.strokeStyle = '#d9dce1';
    ctx.strokeRect(0.5, 0.5, canvas.width - 1, canvas.height - 1);
    ctx.fillStyle = '#666b75';
    ctx.font = '11px sans-serif';
    ctx.fillText(fmt(max, 2), 4, 12);
    series.forEach(([, v], i) => {
      ctx.strokeStyle = COLORS[i % COLORS.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let pen = false;
      v.forEach((y, j) => {
        if (y === null || y === undefined) {
          pen = false;
          return;
        }
        const x = ((times[j] - t0) / span) * (canvas.width - 8) + 4;
        const py = canvas.height - 4 - (y / max) * (canvas.height - 20);
        if (pen) ctx.lineTo(x, py);
        else ctx.moveTo(x, py);
        pen = true;
      });
      ctx.stroke();
    });
    return box;
  }

  function charts(d) {
    const h = d.history;
    const t = h.map((s) => s.t);
    const perRank = (key) => d.ranks.map((r) => ['rank ' + r.rank, h.map((s) => s[key][r.rank] ?? null)]);
    $('charts').replaceChildren(
      chart('Tokens/s', t, [['tokens/s', h.map((s) => s.tokens_per_second)]]),
      chart('Queue and running', t, [
        ['queue', h.map((s) => s.queue)],
        ['running', h.map((s) => s.running)],
      ]),
      chart('Compute ms per step', t, perRank('compute_ms')),
      chart('Collective ms per step', t, perRank('collective_ms')),
      chart('Waiting ms per step', t, perRank('wait_ms')),
    );
  }

  async function tick() {
    try {
      const d = await fetchFigures();
      $('model').textContent = d.model + ' · tp ' + d.tp + ' · up ' + Math.round(d.uptime_seconds) + ' s';
      cards(d);
      const alarm = $('alarm');
      alarm.hidden = !(d.canary && d.canary.drift);
      alarm.textContent = alarm.hidden
        ? ''
        : 'Drift alarm: the canary failed (' + d.canary.mismatches + ' of ' + d.canary.cases +
          ' continuations differ, largest mean-logprob shift ' + fmt(d.canary.max_logprob_shift, 4) + '): ' + d.canary.detail;
      ranks(d);
      charts(d);
      $('status').textContent = 'updated ' + new Date().toLocaleTimeString();
      $('status').classList.remove('error');
      window.tpDashboard = d;
    } catch (e) {
      $('status').textContent = 'cannot read the figures: ' + e.message;
      $('status').classList.add('error');
    } finally {
      setTimeout(tick, 1000);
    }
  }

  tick();
})();
