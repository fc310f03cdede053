// Markdown for the chat: paragraphs, headings, lists, fenced code blocks, inline code,
// bold, italics and links, built as DOM nodes from text only. Nothing here hands text to the
// HTML parser: `<script>` or `<img onerror>` in a message stay characters, and a link is made
// only for an http(s) address (a `javascript:` link stays text).
'use strict';

window.tpMarkdown = (() => {
  const el = (tag) => document.createElement(tag);
  const text = (s) => document.createTextNode(s);

  // The address of a link if it is http or https, else null.
  function safeUrl(raw) {
    try {
      const url = new URL(raw, window.location.href);
      return url.protocol === 'http:' || url.protocol === 'https:' ? url.href : null;
    } catch (e) {
      return null;
    }
  }

  // `code`, **bold**, *italics* and [text](address) inside one block.
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

  function inline(s, parent) {
    const re = new RegExp(INLINE.source, 'g');
    let last = 0;
    let m;
    while ((m = re.exec(s)) !== null) {
      if (m.index > last) parent.append(text(s.slice(last, m.index)));
      if (m[1] !== undefined) {
        const c = el('code');
        c.textContent = m[2];
        parent.append(c);
      } else if (m[3] !== undefined) {
        const b = el('strong');
        inline(m[3], b);
        parent.append(b);
      } else if (m[4] !== undefined) {
        const i = el('em');
        inline(m[4], i);
        parent.append(i);
      } else {
        const url = safeUrl(m[6]);
        if (url) {
          const a = el('a');
          a.href = url;
          a.rel = 'noopener noreferrer nofollow';
          a.target = '_blank';
          a.textContent = m[5];
          parent.append(a);
        } else {
          parent.append(text(m[0]));
        }
      }
      last = re.lastIndex;
    }
    if (last < s.length) parent.append(text(s.slice(last)));
  }

  const FENCE = /^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/;
  const ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;

  // Replaces `root`'s children with `src` rendered.
  function render(src, root) {
    root.replaceChildren();
    const lines = String(src).replace(/\r\n?/g, '\n').split('\n');
    let para = [];
    const flush = () => {
      if (para.length) {
        const p = el('p');
        inline(para.join('\n'), p);
        root.append(p);
        para = [];
      }
    };
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(FENCE);
      if (fence) {
        flush();
        const body = [];
        i++;
        while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
        i++;
        const pre = el('pre');
        const code = el('code');
        if (fence[2]) code.dataset.lang = fence[2];
        code.textContent = body.join('\n');
        pre.append(code);
        root.append(pre);
        continue;
      }
      const h = line.match(HEADING);
      if (h) {
        flush();
        const e = el('h' + Math.min(6, h[1].length + 2));
        inline(h[2], e);
        root.append(e);
        i++;
        continue;
      }
      const item = line.match(ITEM);
      if (item) {
        flush();
        const list = el(/\d/.test(item[1]) ? 'ol' : 'ul');
        let m;
        while (i < lines.length && (m = lines[i].match(ITEM)) !== null) {
          const li = el('li');
          inline(m[2], li);
          list.append(li);
          i++;
        }
        root.append(list);
        continue;
      }
      if (!line.trim()) {
        flush();
      } else {
        para.push(line);
      }
      i++;
    }
    flush();
  }

  return { render, safeUrl };
})();
