//! The built-in chat page in a real browser (headless Chromium over the DevTools protocol)
//! against a synthetic model served at tp 2: a message typed and sent with the keyboard gets
//! a streamed answer equal to the API's own greedy answer, with its tokens/s; text with
//! `<script>`, `<img onerror>` and `javascript:` links, from the user or in a model reply (an
//! imported conversation), is shown as text; with an API key the page asks for it.
//! Screenshots go to `target/tmp/artifacts/`. Skips, saying so, where no Chromium is
//! installed (fails instead with `TP_REQUIRE_BROWSER=1`).

mod browser;
mod common;

use browser::{artifact, Browser};
use common::{config, with_server};
use serde_json::json;
use std::time::Duration;
use tp_serve::client::Client;
use tp_serve::ServeConfig;

/// One browser and server at a time: the tests share 2 cores here, and the dashboard's cost
/// figure is measured against step time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Room for the payload as a chat prompt in bytes.
const CTX: usize = 512;

const PAYLOAD: &str = "<script>window.__xss = 1</script> <img src=x onerror=\"window.__xss = 2\"> [click me](javascript:window.__xss=3) **bold**";

/// Sends `text` from the composer with the keyboard and waits for the reply's statistics.
fn send(b: &mut Browser, text: &str) {
    b.eval("document.getElementById('input').focus()");
    b.type_text(text);
    b.press("Enter", 13);
    b.wait_for(
        "!document.getElementById('send').disabled && document.querySelector('#messages .msg.assistant:last-child .stats').textContent !== ''",
        Duration::from_secs(30),
    );
    let last = b.eval("document.querySelector('#messages .msg.assistant:last-child').innerText");
    assert!(
        last.as_str().unwrap().contains("tokens/s"),
        "the reply failed: {last}"
    );
}

/// No element or script came from message text: no script or image in the messages, no
/// `javascript:` link, nothing ran.
fn assert_inert(b: &mut Browser) {
    let r = b.eval(
        "({scripts: document.querySelectorAll('#messages script').length,
           imgs: document.querySelectorAll('#messages img').length,
           js_links: [...document.querySelectorAll('#messages a')].filter(a => !a.href.startsWith('http')).length,
           ran: window.__xss === undefined ? null : window.__xss})",
    );
    assert_eq!(
        r,
        json!({"scripts": 0, "imgs": 0, "js_links": 0, "ran": null}),
        "{r}"
    );
}

#[test]
fn chat_page_streams_answers_and_shows_markup_as_text() {
    let _one = serial();
    let Some(mut b) = Browser::launch("chat_page") else {
        return;
    };
    with_server(2, CTX, config(), |ready| {
        let url = format!("http://{}/", ready.addr);
        b.open(&url);
        b.wait_for(
            "document.getElementById('model').textContent.includes('synthetic')",
            Duration::from_secs(10),
        );
        b.eval("document.getElementById('max_tokens').value = '300'; document.getElementById('temperature').value = '0'; document.getElementById('seed').value = '5'; true");
        // The reply's length at each repaint, to see it arrive in pieces.
        b.eval(
            "window.__seen = new Set();
             const render = window.tpMarkdown.render;
             window.tpMarkdown.render = (text, root) => { window.__seen.add(text.length); render(text, root); };
             true",
        );
        send(&mut b, PAYLOAD);
        let state = b.eval("window.tpChat.state().conversations[0]");
        let reply = state["messages"][1]["content"]
            .as_str()
            .unwrap()
            .to_string();
        let seen = b.eval("[...window.__seen]");
        eprintln!("reply {reply:?}; lengths seen while streaming: {seen}");
        assert!(
            seen.as_array()
                .unwrap()
                .iter()
                .filter(|n| n.as_u64() > Some(0))
                .count()
                >= 2,
            "the reply did not arrive in pieces: {seen}"
        );
        // The oracle: the same request through the API, not streamed.
        let api = Client::new(ready.addr)
            .post_json(
                "/v1/chat/completions",
                &json!({"messages": [{"role": "user", "content": PAYLOAD}],
                    "max_tokens": 300, "temperature": 0, "top_p": 1, "seed": 5}),
            )
            .unwrap();
        assert_eq!(api.status, 200, "{}", api.text());
        assert_eq!(
            reply,
            api.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
        );
        let stats = b.eval(
            "document.querySelector('#messages .msg.assistant:last-child .stats').textContent",
        );
        let tokens = api.json()["usage"]["completion_tokens"].as_u64().unwrap();
        assert!(
            stats
                .as_str()
                .unwrap()
                .starts_with(&format!("{tokens} tokens")),
            "{stats}"
        );
        // The user's markup is text: the message shows the characters.
        let shown = b.eval("document.querySelector('#messages .msg.user .content').textContent");
        assert!(
            shown
                .as_str()
                .unwrap()
                .contains("<script>window.__xss = 1</script>")
                && shown.as_str().unwrap().contains("<img src=x onerror"),
            "{shown}"
        );
        assert_inert(&mut b);
        b.screenshot(&artifact("chat.png"));

        // A model reply with markup, in an imported conversation.
        let reply = format!(
            "Here is code:\n\n```html\n{PAYLOAD}\n```\n\n{PAYLOAD}\n\n- a [safe link](https://example.com/)\n- `<b>inline</b>`"
        );
        let file = artifact("import.json");
        std::fs::write(
            &file,
            json!({"conversations": [{"title": "imported", "messages": [
                {"role": "user", "content": "show me"},
                {"role": "assistant", "content": reply}]}]})
            .to_string(),
        )
        .unwrap();
        let doc = b.call("DOM.getDocument", json!({}));
        let input = b.call(
            "DOM.querySelector",
            json!({"nodeId": doc["root"]["nodeId"], "selector": "#import"}),
        );
        b.call(
            "DOM.setFileInputFiles",
            json!({"files": [file], "nodeId": input["nodeId"]}),
        );
        b.wait_for(
            "document.querySelector('.conversation.current').textContent === 'imported'",
            Duration::from_secs(10),
        );
        assert_inert(&mut b);
        let r = b.eval(
            "(() => { const m = document.querySelector('#messages .msg.assistant .content');
               return {code: m.querySelector('pre code').textContent,
                       strong: m.querySelector('p strong').textContent,
                       link: m.querySelector('a').href,
                       links: m.querySelectorAll('a').length,
                       inline: m.querySelector('li code').textContent,
                       text: m.textContent}; })()",
        );
        assert_eq!(r["code"], PAYLOAD, "{r}");
        assert_eq!(r["strong"], "bold", "{r}");
        assert_eq!(r["link"], "https://example.com/", "{r}");
        assert_eq!(r["links"], 1, "{r}");
        assert_eq!(r["inline"], "<b>inline</b>", "{r}");
        assert!(
            r["text"]
                .as_str()
                .unwrap()
                .contains("[click me](javascript:window.__xss=3)"),
            "{r}"
        );
        b.screenshot(&artifact("chat-markup.png"));

        // Regenerate gives the same greedy reply again; edit-and-resend replaces the turn.
        b.eval(
            "document.querySelector('.conversations li:nth-child(2) .conversation').click(); true",
        );
        b.eval("document.getElementById('regenerate').click(); true");
        b.wait_for(
            "!document.getElementById('send').disabled && document.querySelectorAll('#messages .msg').length === 2 && document.querySelector('#messages .msg.assistant .stats').textContent.includes('tokens/s')",
            Duration::from_secs(30),
        );
        let again = b.eval("window.tpChat.state().conversations[1].messages[1].content");
        assert_eq!(again, json!(state["messages"][1]["content"]));
        b.eval("document.querySelector('#messages .msg.user .edit').click(); true");
        let input = b.eval("document.getElementById('input').value");
        assert_eq!(input, PAYLOAD);
        b.eval("document.getElementById('input').value = ''; true");
        send(&mut b, "hello");
        let conv = b.eval("window.tpChat.state().conversations[1].messages.map(m => m.role + ':' + m.content.length)");
        assert_eq!(conv.as_array().unwrap().len(), 2, "{conv}");
        let first = b.eval("window.tpChat.state().conversations[1].messages[0].content");
        assert_eq!(first, "hello");
    });
}

#[test]
fn chat_page_asks_for_the_api_key_and_works_from_the_keyboard() {
    let _one = serial();
    let Some(mut b) = Browser::launch("chat_key") else {
        return;
    };
    let cfg = ServeConfig {
        api_key: Some("sk-web-test".into()),
        ..config()
    };
    with_server(2, CTX, cfg, |ready| {
        b.open(&format!("http://{}/", ready.addr));
        // The model list needs the key: the dialog opens with the key field focused.
        b.wait_for(
            "document.getElementById('key-dialog').open && document.activeElement.id === 'key'",
            Duration::from_secs(10),
        );
        b.screenshot(&artifact("chat-key.png"));
        b.type_text("sk-web-test");
        b.press("Enter", 13);
        b.wait_for(
            "!document.getElementById('key-dialog').open && document.getElementById('model').textContent.includes('synthetic')",
            Duration::from_secs(10),
        );
        // Settings from the keyboard: focus walks to max tokens by Tab.
        b.eval("document.getElementById('top_p').focus(); true");
        b.press("Tab", 9);
        assert_eq!(b.eval("document.activeElement.id"), "max_tokens");
        b.eval("document.activeElement.select(); true");
        b.type_text("8");
        send(&mut b, "hi there");
        let m = b.eval("window.tpChat.state().conversations[0].messages[1]");
        assert!(m["error"].is_null(), "{m}");
        assert_eq!(m["stats"]["tokens"], 8, "{m}");

        // Escape stops a long reply: it ends early, marked stopped, and the page is ready.
        b.eval("document.getElementById('max_tokens').value = '300'; document.getElementById('input').focus(); true");
        b.type_text("go on");
        b.press("Enter", 13);
        b.wait_for(
            "!document.getElementById('stop').disabled",
            Duration::from_secs(10),
        );
        b.press("Escape", 27);
        b.wait_for(
            "!document.getElementById('send').disabled",
            Duration::from_secs(30),
        );
        let m = b.eval("window.tpChat.state().conversations[0].messages[3]");
        assert_eq!(m["finish"], "stopped", "{m}");
        assert!(m["stats"]["tokens"].as_u64().unwrap() < 300, "{m}");
    });
}

/// `/dashboard` of a tp 2 server under load: a row per rank with non-zero compute,
/// collective, bytes sent, load time and memory, the slowest rank marked, the server's
/// figures and the charts; the JSON behind it agrees, `/metrics` has the same series per
/// rank, and gathering them cost under 1% of the step time.
#[test]
fn dashboard_shows_every_rank_of_a_tp2_server() {
    let _one = serial();
    let Some(mut b) = Browser::launch("dashboard") else {
        return;
    };
    with_server(2, CTX, config(), |ready| {
        let addr = ready.addr;
        // Four clients for 4 s: steps run through several polls.
        let load = std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            std::thread::scope(|s| {
                for i in 0..4 {
                    s.spawn(move || {
                        let c = Client::new(addr);
                        while t0.elapsed() < Duration::from_secs(4) {
                            let r = c
                                .post_json(
                                    "/v1/completions",
                                    &json!({"prompt": format!("client {i} says hello"),
                                        "max_tokens": 64, "ignore_eos": true}),
                                )
                                .unwrap();
                            assert_eq!(r.status, 200, "{}", r.text());
                        }
                    });
                }
            });
        });
        b.open(&format!("http://{addr}/dashboard"));
        std::thread::sleep(Duration::from_millis(2500));
        b.wait_for(
            "document.querySelectorAll('#ranks tbody tr').length === 2 && window.tpDashboard.server.running > 0",
            Duration::from_secs(10),
        );
        b.screenshot(&artifact("dashboard.png"));
        load.join().unwrap();
        let rows = b.eval(
            "[...document.querySelectorAll('#ranks tbody tr')].map(tr => ({
                rank: tr.dataset.rank, slowest: tr.classList.contains('slowest'),
                compute: parseFloat(tr.querySelector('.compute').textContent),
                collective: parseFloat(tr.querySelector('.collective').textContent),
                sent: tr.querySelector('.sent').textContent,
                load: parseFloat(tr.querySelector('.load').textContent),
                memory: tr.querySelector('.memory').textContent}))",
        );
        eprintln!("dashboard rows: {rows}");
        let rows = rows.as_array().unwrap();
        assert_eq!(rows.len(), 2);
        for (r, row) in rows.iter().enumerate() {
            assert_eq!(row["rank"], r.to_string());
            assert!(row["compute"].as_f64().unwrap() > 0.0, "{row}");
            assert!(row["collective"].as_f64().unwrap() > 0.0, "{row}");
            assert!(row["load"].is_number(), "{row}");
            assert_ne!(row["sent"], "0 B", "{row}");
            assert_ne!(row["memory"], "0 B", "{row}");
        }
        assert_eq!(
            rows.iter().filter(|r| r["slowest"] == true).count(),
            1,
            "{rows:?}"
        );
        let charts = b.eval("document.querySelectorAll('#charts canvas').length");
        assert_eq!(charts, 5);

        let c = Client::new(addr);
        let d = c.get("/dashboard.json").unwrap().json();
        let s = &d["server"];
        eprintln!("server: {s}\ncollection: {}", d["collection"]);
        assert!(s["generated_tokens"].as_u64().unwrap() > 0, "{s}");
        assert!(s["ttft_p50_ms"].as_f64().unwrap() > 0.0, "{s}");
        assert!(s["tpot_p99_ms"].as_f64().unwrap() > 0.0, "{s}");
        assert!(d["history"].as_array().unwrap().len() >= 3, "{d}");
        // Both ranks ran the same steps and sent the same all-reduces.
        let sent: Vec<u64> = d["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["bytes_sent_total"].as_u64().unwrap())
            .collect();
        assert!(sent[0] > 0 && sent[1] > 0, "{sent:?}");
        for r in d["ranks"].as_array().unwrap() {
            assert!(r["load_seconds"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["load_bytes"].as_u64().unwrap() > 0, "{r}");
        }
        let col = &d["collection"];
        assert!(col["busy_polls"].as_u64().unwrap() >= 2, "{col}");
        let share = col["share_of_step_time"].as_f64().unwrap();
        assert!(
            share < 0.01,
            "collecting cost {share} of the step time: {col}"
        );
        let text = c.get("/metrics").unwrap().text();
        for r in 0..2 {
            let line = text
                .lines()
                .find(|l| {
                    l.starts_with("tp_rank_compute_seconds_per_step{")
                        && l.contains(&format!("rank=\"{r}\""))
                })
                .unwrap_or_else(|| panic!("no rank {r} series: {text}"));
            let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(v > 0.0, "{line}");
        }
        assert!(text.contains("tp_rank_bytes_sent_total{"), "{text}");
        assert!(text.contains("tp_rank_load_seconds{"), "{text}");
    });
}

/// The README's screenshots, from a server already running at `$TP_SCREENSHOT_SERVER`
/// (`http://HOST:PORT`): a chat turn, then the dashboard. Run by hand with `--ignored`.
#[test]
#[ignore = "needs a running server at $TP_SCREENSHOT_SERVER"]
fn readme_screenshots() {
    let Ok(url) = std::env::var("TP_SCREENSHOT_SERVER") else {
        panic!("set TP_SCREENSHOT_SERVER=http://HOST:PORT");
    };
    let Some(mut b) = Browser::launch("readme") else {
        return;
    };
    b.open(&format!("{url}/"));
    b.wait_for(
        "document.getElementById('model').textContent !== ''",
        Duration::from_secs(10),
    );
    b.eval("document.getElementById('max_tokens').value = '120'; document.getElementById('temperature').value = '0'; true");
    send(&mut b, "Write a Python function that checks whether a number is prime, with a one-line explanation.");
    b.screenshot(&artifact("readme-chat.png"));
    b.open(&format!("{url}/dashboard"));
    std::thread::sleep(Duration::from_millis(2500));
    b.screenshot(&artifact("readme-dashboard.png"));
}
