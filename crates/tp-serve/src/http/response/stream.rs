//! Streaming responses: server-sent events in OpenAI's chunk format, the choices of a request
//! interleaved as their events arrive, ending with `data: [DONE]`; a failure (or the drain
//! timeout) ends the stream with an error event.

use super::{log_done, ResponseMeta};
use crate::http::choices::{failure, next_event, Choices};
use crate::http::request::Endpoint;
use crate::http::server::{drain_error, drain_expired, AppState};
use crate::scheduler::{Event, Usage};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tp_engine::FinishReason;

/// What the SSE stream does next.
enum Phase {
    /// Chat's opening role chunk of each choice, from this index on.
    Start(usize),
    Body,
    /// Every choice's finish chunk went out; the usage chunk (if asked) and `[DONE]` follow.
    Usage(Usage),
    Done,
    End,
}

struct StreamState {
    st: Arc<AppState>,
    meta: ResponseMeta,
    include_usage: bool,
    /// Text chunks carry the log-probabilities of their tokens.
    logprobs: bool,
    choices: Choices,
    /// How the choices ended so far (in the order they ended) and their usage.
    finishes: Vec<FinishReason>,
    usage: Usage,
    phase: Phase,
    arrived: Instant,
}

/// Server-sent events in OpenAI's chunk format, each chunk naming its choice's `index`, the
/// choices interleaved as their events arrive, ending with `data: [DONE]` once all have
/// finished. Dropping the stream (the client went away) drops every choice's receiver, which
/// the scheduler sees at its next step.
pub(crate) fn stream_response(
    st: Arc<AppState>,
    meta: ResponseMeta,
    include_usage: bool,
    logprobs: bool,
    choices: Choices,
    arrived: Instant,
) -> Sse<impl futures_util::Stream<Item = std::result::Result<SseEvent, Infallible>>> {
    let state = StreamState {
        st,
        meta,
        include_usage,
        logprobs,
        choices,
        finishes: Vec::new(),
        usage: Usage::default(),
        phase: Phase::Start(0),
        arrived,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        let data = match std::mem::replace(&mut s.phase, Phase::Body) {
            Phase::Start(i) => match s.meta.endpoint {
                Endpoint::Chat if i < s.choices.len() => {
                    s.phase = Phase::Start(i + 1);
                    s.meta.chunk(i, true, Some(""), None, None).to_string()
                }
                _ => return next_body(s).await,
            },
            Phase::Body => return next_body(s).await,
            Phase::Usage(usage) => {
                s.phase = Phase::Done;
                if s.include_usage {
                    s.meta.usage_chunk(usage).to_string()
                } else {
                    s.phase = Phase::End;
                    "[DONE]".to_string()
                }
            }
            Phase::Done => {
                s.phase = Phase::End;
                "[DONE]".to_string()
            }
            Phase::End => return None,
        };
        Some((Ok(SseEvent::default().data(data)), s))
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

async fn next_body(
    mut s: StreamState,
) -> Option<(std::result::Result<SseEvent, Infallible>, StreamState)> {
    let event = tokio::select! {
        e = next_event(&s.st, &mut s.choices) => e,
        _ = drain_expired(&s.st) => Err(drain_error(&s.st)),
    };
    let data = match event {
        Ok((i, Event::Text { text, logprobs })) => {
            s.phase = Phase::Body;
            let entries = s.logprobs.then_some(logprobs.as_slice());
            s.meta
                .chunk(i, false, Some(&text), None, entries)
                .to_string()
        }
        Ok((i, Event::Done { finish, usage, .. })) => {
            s.finishes.push(finish);
            s.usage = s.usage.with_choice(usage);
            s.phase = if s.choices.all_finished() {
                log_done(
                    &s.st,
                    s.meta.endpoint,
                    &s.meta.id,
                    &s.finishes,
                    s.usage,
                    s.arrived,
                );
                Phase::Usage(s.usage)
            } else {
                Phase::Body
            };
            s.meta
                .chunk(i, false, None, Some(finish.as_str()), None)
                .to_string()
        }
        Ok((
            _,
            Event::Failed {
                message,
                shutting_down,
            },
        )) => {
            s.choices.close();
            s.phase = Phase::Done;
            failure(message, shutting_down).body().to_string()
        }
        Err(e) => {
            s.choices.close();
            s.phase = Phase::Done;
            e.body().to_string()
        }
    };
    Some((Ok(SseEvent::default().data(data)), s))
}
