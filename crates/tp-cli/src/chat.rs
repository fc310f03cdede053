//! `tp chat`: an interactive, multi-turn conversation with the chat template applied, through
//! tp-engine's `Engine`: the KV cache keeps the conversation; each turn feeds only the tokens
//! the cache does not hold.

use crate::generate::{engine_error, print_logprobs, report, SamplingArgs, SpecArgs};
use crate::model_run::{run_model_holding, ModelArgs};
use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::Duration;
use tp_engine::Engine;
use tp_tokenizer::ChatMessage;

#[derive(clap::Args, Clone, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// A system message that opens the conversation.
    #[arg(long)]
    pub system: Option<String>,
}

/// How often the leader tells waiting followers it is still there.
const HEARTBEAT: Duration = Duration::from_secs(1);

pub fn run(args: &ChatArgs) -> anyhow::Result<ExitCode> {
    let params = args.sampling.params()?;
    // Checked before any rank starts; each lead builds its own.
    args.spec.drafting()?;
    let out = run_model_holding(&args.model, None, args.spec.draft_path(), |s| {
        let spec = args.spec.speculator(s, &args.model)?;
        let mut engine = Engine::new(s);
        engine.set_speculation(spec);
        let lines = stdin_lines();
        eprintln!(
            "# chat: type a message and press Enter; /reset starts over, /exit or Ctrl-D quits"
        );
        let mut messages: Vec<ChatMessage> = args
            .system
            .iter()
            .map(|m| ChatMessage::new("system", m.clone()))
            .collect();
        loop {
            print!("> ");
            std::io::stdout().flush()?;
            let line = match next_line(&mut engine, &lines)? {
                Input::Line(line) => line,
                Input::NotUtf8 => {
                    eprintln!(
                        "# that line is not valid UTF-8 text and was not sent; type it again"
                    );
                    continue;
                }
                Input::End => {
                    println!();
                    break;
                }
            };
            let line = line.trim();
            match line {
                "" => continue,
                "/exit" | "/quit" => break,
                "/reset" => {
                    messages.retain(|m| m.role == "system");
                    engine.reset()?;
                    eprintln!("# conversation cleared");
                    continue;
                }
                _ => {}
            }
            messages.push(ChatMessage::new("user", line));
            // Message text stays plain text: typed special-token text cannot open a turn.
            let ids = match engine.tokenizer().encode_chat(&messages, true) {
                Ok(ids) => ids,
                Err(e) => {
                    eprintln!("# this message cannot be sent: {e}");
                    messages.pop();
                    continue;
                }
            };
            if ids.len() + 1 >= engine.ctx_size() {
                eprintln!(
                    "# the conversation ({} tokens) no longer fits the context of {}; /reset to start over or raise --ctx-size",
                    ids.len(),
                    engine.ctx_size()
                );
                messages.pop();
                continue;
            }
            // The cache keeps the prefix the new prompt shares with it.
            let reply = engine
                .reply(&ids, &params, &mut std::io::stdout())
                .map_err(engine_error)?;
            println!();
            print_logprobs(&reply, params.logprobs);
            if !args.model.quiet {
                report(&reply);
            }
            messages.push(ChatMessage::new("assistant", reply.text));
        }
        Ok(())
    })?;
    Ok(match out {
        Ok(_) => ExitCode::SUCCESS,
        Err(failed) => failed.into(),
    })
}

/// One line of stdin.
enum Input {
    Line(String),
    /// A line that is not UTF-8: refused, the conversation goes on.
    NotUtf8,
    /// End of input.
    End,
}

/// Lines of stdin from a reader thread, so the leader can keep followers alive while it waits.
/// Lines are read as bytes, so one line that is not UTF-8 does not end the input.
fn stdin_lines() -> mpsc::Receiver<std::io::Result<Input>> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin().lock();
        let mut buf = Vec::new();
        loop {
            buf.clear();
            let item = match stdin.read_until(b'\n', &mut buf) {
                Ok(0) => return,
                Ok(_) => {
                    if buf.last() == Some(&b'\n') {
                        buf.pop();
                        if buf.last() == Some(&b'\r') {
                            buf.pop();
                        }
                    }
                    Ok(match String::from_utf8(std::mem::take(&mut buf)) {
                        Ok(line) => Input::Line(line),
                        Err(_) => Input::NotUtf8,
                    })
                }
                Err(e) => Err(e),
            };
            let failed = item.is_err();
            if tx.send(item).is_err() || failed {
                return;
            }
        }
    });
    rx
}

/// The next line, sending an idle heartbeat to the followers every second meanwhile.
fn next_line(
    engine: &mut Engine<'_>,
    lines: &mpsc::Receiver<std::io::Result<Input>>,
) -> anyhow::Result<Input> {
    loop {
        match lines.recv_timeout(HEARTBEAT) {
            Ok(item) => return Ok(item?),
            Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(Input::End),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                engine.keep_alive()?;
            }
        }
    }
}
