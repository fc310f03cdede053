//! The HTTP front end (axum on its own tokio runtime thread), one module per concern:
//! [`server`] (settings, the runtime thread, graceful shutdown), [`conn`] (the accept loop,
//! connection cap and deadlines), `routes` (which handler answers what), [`auth`] (the API
//! key), [`request`] (bodies into validated, tokenized requests), `choices` (a request's
//! scheduler jobs and their events) and [`response`] (OpenAI JSON, server-sent events, whole
//! answers), and [`ui`] (the built-in chat and dashboard pages). It talks to the scheduler only through channels, and the conversion of the
//! scheduler's events to the OpenAI wire format happens here.

pub mod admin;
pub mod auth;
pub(crate) mod choices;
pub mod conn;
pub mod request;
pub mod response;
pub(crate) mod routes;
pub mod server;
pub mod ui;
