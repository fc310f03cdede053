// The chat page: conversations kept in this browser (localStorage) with JSON import and
// export, replies streamed from POST /v1/chat/completions, stop, regenerate and
// edit-and-resend, sampling settings per conversation, the API key asked for when the server
// wants one (kept for this tab only), tokens/s of each reply. Every element is built from
// text (see markdown.js); no text is ever parsed as HTML.
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const STORE = 'tp-chat-v1';
  const KEY = 'tp-api-key';
  const ROLES = ['system', 'user', 'assistant'];

  let state = loadState();
  let controller = null;

  function loadState() {
    try {
      const s = JSON.parse(localStorage.getItem(STORE));
      if (s && Array.isArray(s.conversations)) return s;
    } catch (e) {
      // A damaged store starts afresh.
    }
    return { conversations: [], current: null };
  }

  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(state));
    } catch (e) {
      status('could not save the conversations in this browser: ' + e.message, true);
    }
  }

  function newId() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  function defaults() {
    return { system: '', temperature: 0.7, top_p: 1, max_tokens: 256, seed: null };
  }

  function newConversation() {
    const c = { id: newId(), title: 'New chat', settings: defaults(), messages: [] };
    state.conversations.unshift(c);
    state.current = c.id;
    save();
    return c;
  }

  function current() {
    return state.conversations.find((c) => c.id === state.current) || newConversation();
  }

  function status(message, isError) {
    const s = $('status');
    s.textContent = message || '';
    s.classList.toggle('error', Boolean(isError));
  }

  // ---- the API key ----

  function headers() {
    const h = { 'content-type': 'application/json' };
    const k = sessionStorage.getItem(KEY);
    if (k) h.authorization = 'Bearer ' + k;
    return h;
  }

  // Asks for the key; resolves true once one is given, false if cancelled.
  function askKey(why) {
    return new Promise((resolve) => {
      const dialog = $('key-dialog');
      $('key-why').textContent = why;
      $('key').value = '';
      const done = (ok) => {
        $('key-form').removeEventListener('submit', submit);
        $('key-cancel').removeEventListener('click', cancel);
        dialog.removeEventListener('cancel', cancel);
        if (dialog.open) dialog.close();
        resolve(ok);
      };
      const submit = (e) => {
        e.preventDefault();
        const k = $('key').value.trim();
        if (!k) return;
        sessionStorage.setItem(KEY, k);
        done(true);
      };
      const cancel = (e) => {
        e.preventDefault();
        done(false);
      };
      $('key-form').addEventListener('submit', submit);
      $('key-cancel').addEventListener('click', cancel);
      dialog.addEventListener('cancel', cancel);
      dialog.showModal();
      $('key').focus();
    });
  }

  // fetch with the key; on 401 asks for it and tries again.
  async function api(path, init) {
    for (;;) {
      const resp = await fetch(path, { ...init, headers: headers() });
      if (resp.status !== 401) return resp;
      const body = await resp.json().catch(() => null);
      const why = (body && body.error && body.error.message) || 'This server needs an API key.';
      if (!(await askKey(why))) throw new Error('no API key given: ' + why);
    }
  }

  async function errorOf(resp) {
    const body = await resp.json().catch(() => null);
    return (body && body.error && body.error.message) || resp.status + ' ' + resp.statusText;
  }

  // ---- rendering ----

  function renderConversations() {
    const list = $('conversations');
    list.replaceChildren();
    for (const c of state.conversations) {
      const li = document.createElement('li');
      const open = document.createElement('button');
      open.type = 'button';
      open.className = 'conversation' + (c.id === state.current ? ' current' : '');
      open.textContent = c.title;
      if (c.id === state.current) open.setAttribute('aria-current', 'true');
      open.addEventListener('click', () => {
        if (controller) return;
        state.current = c.id;
        save();
        renderAll();
      });
      const del = document.createElement('button');
      del.type = 'button';
      del.className = 'small';
      del.textContent = '×';
      del.setAttribute('aria-label', 'Delete conversation ' + c.title);
      del.addEventListener('click', () => {
        if (controller) return;
        state.conversations = state.conversations.filter((x) => x.id !== c.id);
        if (state.current === c.id) state.current = state.conversations.length ? state.conversations[0].id : null;
        save();
        renderAll();
      });
      li.append(open, del);
      list.append(li);
    }
  }

  function statsText(m) {
    if (!m.stats) return '';
    const s = m.stats;
    const parts = [s.tokens + ' tokens', s.seconds.toFixed(2) + ' s'];
    if (s.tokens_per_second !== null && s.tokens_per_second !== undefined) {
      parts.push(s.tokens_per_second.toFixed(1) + ' tokens/s');
    }
    if (m.finish) parts.push('finish: ' + m.finish);
    return parts.join(' · ');
  }

  function messageView(m, index) {
    const box = document.createElement('article');
    box.className = 'msg ' + m.role;
    const head = document.createElement('div');
    head.className = 'msg-head';
    const who = document.createElement('span');
    who.className = 'role';
    who.textContent = m.role;
    head.append(who);
    if (m.role === 'user') {
      const edit = document.createElement('button');
      edit.type = 'button';
      edit.className = 'small edit';
      edit.textContent = 'Edit';
      edit.setAttribute('aria-label', 'Edit this message and send it again');
      edit.addEventListener('click', () => editFrom(index));
      head.append(edit);
    }
    const body = document.createElement('div');
    body.className = 'content';
    window.tpMarkdown.render(m.content, body);
    const foot = document.createElement('div');
    foot.className = 'stats';
    foot.textContent = statsText(m);
    box.append(head, body, foot);
    if (m.error) {
      const err = document.createElement('div');
      err.className = 'error';
      err.textContent = m.error;
      box.append(err);
    }
    return box;
  }

  function renderMessages() {
    const c = current();
    const list = $('messages');
    list.replaceChildren(...c.messages.map(messageView));
    list.scrollTop = list.scrollHeight;
  }

  function renderSettings() {
    const s = current().settings;
    $('system').value = s.system || '';
    $('temperature').value = s.temperature;
    $('top_p').value = s.top_p;
    $('max_tokens').value = s.max_tokens;
    $('seed').value = s.seed === null || s.seed === undefined ? '' : s.seed;
  }

  function renderAll() {
    renderConversations();
    renderMessages();
    renderSettings();
    setBusy(Boolean(controller));
  }

  function setBusy(busy) {
    $('send').disabled = busy;
    $('regenerate').disabled = busy;
    $('stop').disabled = !busy;
    $('new-chat').disabled = busy;
  }

  // ---- settings ----

  function number(id, min, max) {
    const raw = $(id).value.trim();
    if (raw === '') return null;
    const v = Number(raw);
    if (!Number.isFinite(v) || v < min || v > max) {
      throw new Error($(id).labels[0].textContent + ' must be a number from ' + min + ' to ' + max);
    }
    return v;
  }

  function readSettings() {
    const s = current().settings;
    s.system = $('system').value;
    s.temperature = number('temperature', 0, 2) ?? 0.7;
    s.top_p = number('top_p', 0, 1) ?? 1;
    s.max_tokens = Math.round(number('max_tokens', 1, 1e9) ?? 256);
    const seed = number('seed', 0, Number.MAX_SAFE_INTEGER);
    s.seed = seed === null ? null : Math.round(seed);
    save();
    return s;
  }

  // ---- generation ----

  async function generate() {
    const c = current();
    let s;
    try {
      s = readSettings();
    } catch (e) {
      status(e.message, true);
      return;
    }
    const messages = [];
    if (s.system.trim()) messages.push({ role: 'system', content: s.system });
    for (const m of c.messages) messages.push({ role: m.role, content: m.content });
    const body = {
      messages,
      stream: true,
      stream_options: { include_usage: true },
      temperature: s.temperature,
      top_p: s.top_p,
      max_tokens: s.max_tokens,
    };
    if (s.seed !== null) body.seed = s.seed;
    const reply = { role: 'assistant', content: '', stats: null };
    c.messages.push(reply);
    renderMessages();
    const view = $('messages').lastElementChild;
    const content = view.querySelector('.content');
    controller = new AbortController();
    setBusy(true);
    status('generating…');
    const t0 = performance.now();
    let first = null;
    let pieces = 0;
    let usage = null;
    try {
      const resp = await api('/v1/chat/completions', {
        method: 'POST',
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!resp.ok) throw new Error(await errorOf(resp));
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = '';
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, '\n');
        let end;
        while ((end = buf.indexOf('\n\n')) >= 0) {
          const event = buf.slice(0, end);
          buf = buf.slice(end + 2);
          for (const line of event.split('\n')) {
            if (!line.startsWith('data:')) continue;
            const data = line.slice(5).trim();
            if (data === '[DONE]') continue;
            const chunk = JSON.parse(data);
            if (chunk.error) throw new Error(chunk.error.message);
            if (chunk.usage) usage = chunk.usage;
            const choice = chunk.choices && chunk.choices[0];
            if (!choice) continue;
            const delta = choice.delta && choice.delta.content;
            if (delta) {
              if (first === null) first = performance.now();
              pieces++;
              reply.content += delta;
              window.tpMarkdown.render(reply.content, content);
              $('messages').scrollTop = $('messages').scrollHeight;
            }
            if (choice.finish_reason) reply.finish = choice.finish_reason;
          }
        }
      }
      status('');
    } catch (e) {
      if (e.name === 'AbortError') {
        reply.finish = 'stopped';
        status('stopped');
      } else {
        reply.error = e.message;
        status(e.message, true);
      }
    } finally {
      const t1 = performance.now();
      const tokens = usage ? usage.completion_tokens : pieces;
      // Decode speed: the tokens after the first over the time since the first arrived.
      const rate = first !== null && tokens > 1 && t1 > first ? ((tokens - 1) * 1000) / (t1 - first) : null;
      reply.stats = { tokens, seconds: (t1 - t0) / 1000, tokens_per_second: rate };
      controller = null;
      save();
      renderAll();
      $('input').focus();
    }
  }

  function send() {
    if (controller) return;
    try {
      readSettings();
    } catch (e) {
      status(e.message, true);
      return;
    }
    const text = $('input').value;
    if (!text.trim()) {
      status('type a message first', true);
      return;
    }
    const c = current();
    if (!c.messages.length) c.title = text.trim().slice(0, 40);
    c.messages.push({ role: 'user', content: text });
    $('input').value = '';
    save();
    renderAll();
    generate();
  }

  function regenerate() {
    if (controller) return;
    const c = current();
    while (c.messages.length && c.messages[c.messages.length - 1].role === 'assistant') c.messages.pop();
    if (!c.messages.length) {
      status('nothing to regenerate', true);
      return;
    }
    save();
    renderAll();
    generate();
  }

  // Puts message `index` back in the input and drops it and everything after it.
  function editFrom(index) {
    if (controller) return;
    const c = current();
    $('input').value = c.messages[index].content;
    c.messages.splice(index);
    save();
    renderAll();
    $('input').focus();
    status('edit the message and send it again');
  }

  // ---- import and export ----

  function exportJson() {
    const blob = new Blob([JSON.stringify({ format: 'tp-chat', version: 1, conversations: state.conversations }, null, 2)], {
      type: 'application/json',
    });
    const a = document.createElement('a');
    a.href = URL.createObjectURL(blob);
    a.download = 'tp-chat-conversations.json';
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  // Checks an imported file's conversations; throws naming what is wrong.
  function checkImport(data) {
    const list = Array.isArray(data) ? data : data && data.conversations;
    if (!Array.isArray(list)) throw new Error('expected {"conversations": [...]} or a list of conversations');
    return list.map((c, i) => {
      if (!c || !Array.isArray(c.messages)) throw new Error('conversation ' + i + ' has no "messages" list');
      const messages = c.messages.map((m, j) => {
        if (!m || !ROLES.includes(m.role) || typeof m.content !== 'string') {
          throw new Error('conversation ' + i + ', message ' + j + ': needs a role (' + ROLES.join(', ') + ') and a text content');
        }
        const out = { role: m.role, content: m.content };
        if (m.stats && typeof m.stats.tokens === 'number' && typeof m.stats.seconds === 'number') {
          out.stats = { tokens: m.stats.tokens, seconds: m.stats.seconds, tokens_per_second: typeof m.stats.tokens_per_second === 'number' ? m.stats.tokens_per_second : null };
        }
        return out;
      });
      const settings = { ...defaults(), ...(c.settings && typeof c.settings === 'object' ? c.settings : {}) };
      return { id: newId(), title: typeof c.title === 'string' ? c.title : 'Imported chat', settings, messages };
    });
  }

  async function importJson(file) {
    try {
      const list = checkImport(JSON.parse(await file.text()));
      state.conversations = list.concat(state.conversations);
      if (list.length) state.current = list[0].id;
      save();
      renderAll();
      status('imported ' + list.length + ' conversation(s)');
    } catch (e) {
      status('could not import ' + file.name + ': ' + e.message, true);
    }
  }

  // ---- wiring ----

  async function showModel() {
    try {
      const resp = await api('/v1/models', { method: 'GET' });
      if (!resp.ok) throw new Error(await errorOf(resp));
      const body = await resp.json();
      const m = body.data && body.data[0];
      if (m) $('model').textContent = m.id + ' · context ' + m.max_model_len;
    } catch (e) {
      status(e.message, true);
    }
  }

  $('composer').addEventListener('submit', (e) => {
    e.preventDefault();
    send();
  });
  $('input').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener('keydown', (e) => {
    if (e.key === 'Escape' && controller) controller.abort();
  });
  $('stop').addEventListener('click', () => controller && controller.abort());
  $('regenerate').addEventListener('click', regenerate);
  $('new-chat').addEventListener('click', () => {
    newConversation();
    renderAll();
    $('input').focus();
  });
  $('export').addEventListener('click', exportJson);
  $('import').addEventListener('change', (e) => {
    const f = e.target.files && e.target.files[0];
    if (f) importJson(f);
    e.target.value = '';
  });
  for (const id of ['system', 'temperature', 'top_p', 'max_tokens', 'seed']) {
    $(id).addEventListener('input', () => {
      try {
        readSettings();
        status('');
      } catch (err) {
        status(err.message, true);
      }
    });
  }

  window.tpChat = { checkImport, state: () => state };
  renderAll();
  $('input').focus();
  showModel();
})();
