//! Non-streaming responses: every choice of a request collected, in index order, into one
//! OpenAI answer with the usage of them all.

use super::{log_done, Choice, ResponseMeta};
use crate::error::ApiError;
use crate::http::choices::{failure, next_event, Choices};
use crate::http::server::{drain_error, drain_expired, AppState};
use crate::scheduler::{Event, Usage};
use serde_json::Value;
use std::time::Instant;
use tp_engine::{FinishReason, LogprobEntry};

/// The body of a whole answer (`logprobs`: each choice carries its log-probabilities), once
/// every choice has finished; the request's end is logged. Any choice failing fails the
/// request.
pub(crate) async fn whole_response(
    st: &AppState,
    meta: &ResponseMeta,
    logprobs: bool,
    choices: Choices,
    arrived: Instant,
) -> std::result::Result<Value, ApiError> {
    let (answers, usage) = collect(st, choices).await?;
    let finishes: Vec<FinishReason> = answers.iter().map(|a| a.finish).collect();
    log_done(st, meta.endpoint, &meta.id, &finishes, usage, arrived);
    let choices: Vec<Choice<'_>> = answers
        .iter()
        .map(|a| Choice {
            text: &a.text,
            finish_reason: a.finish.as_str(),
            logprobs: logprobs.then_some(a.logprobs.as_slice()),
        })
        .collect();
    Ok(meta.full(&choices, usage))
}

/// One choice of a non-streaming request, whole.
struct Answer {
    text: String,
    logprobs: Vec<LogprobEntry>,
    finish: FinishReason,
}

/// Waits for the whole answer of a non-streaming request: its choices in index order and the
/// usage of them all. Any choice failing fails the request (dropping the others).
async fn collect(
    st: &AppState,
    mut choices: Choices,
) -> std::result::Result<(Vec<Answer>, Usage), ApiError> {
    let mut parts: Vec<(String, Vec<LogprobEntry>, Option<FinishReason>)> =
        (0..choices.len()).map(|_| Default::default()).collect();
    let mut usage = Usage::default();
    while !choices.all_finished() {
        let (i, event) = tokio::select! {
            e = next_event(st, &mut choices) => e?,
            _ = drain_expired(st) => return Err(drain_error(st)),
        };
        let (text, entries, finish) = &mut parts[i];
        match event {
            Event::Text { text: t, logprobs } => {
                text.push_str(&t);
                entries.extend(logprobs);
            }
            Event::Done {
                finish: f,
                usage: u,
                ..
            } => {
                *finish = Some(f);
                usage = usage.with_choice(u);
            }
            Event::Failed {
                message,
                shutting_down,
            } => return Err(failure(message, shutting_down)),
        }
    }
    let answers = parts
        .into_iter()
        .map(|(text, logprobs, finish)| {
            finish.map(|finish| Answer {
                text,
                logprobs,
                finish,
            })
        })
        .collect::<Option<Vec<Answer>>>()
        .ok_or_else(|| ApiError::internal("a choice ended without finishing"))?;
    Ok((answers, usage))
}
