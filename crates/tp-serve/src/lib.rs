//! tp-serve: an OpenAI-compatible HTTP server over the tensor-parallel engine. Rank 0 runs
//! the [`scheduler`] (continuous batching over the step protocol, plain engine-side events)
//! on its own thread and the [`http`] front end (axum) on a tokio runtime thread; they talk
//! through channels. [`service::serve`] starts both.

pub mod banner;
pub mod bench_ranks;
pub mod bench_report;
pub mod canary;
pub mod client;
pub mod dashboard;
pub mod error;
pub mod fdlimit;
pub mod http;
pub mod load;
pub mod metrics;
pub mod rollout;
pub mod scheduler;
pub mod service;
pub mod spec;

pub use error::{ApiError, Result, ServeError};
pub use http::auth::check_api_key;
pub use http::conn::ConnLimits;
pub use http::request::DEFAULT_MAX_N;
pub use http::server::{Server, ServerConfig, StopHandle, DEFAULT_MAX_BODY_BYTES};
pub use metrics::Metrics;
pub use rollout::{DrainReport, SwapPolicy};
pub use scheduler::{Control, Event, Job, Load, SchedulerConfig, SchedulerHandle, Usage};
pub use service::{kv_plan, serve, KvBudget, KvPlan, Ready, ServeConfig, SwapConfig};
pub use spec::{ServeSpec, SpecBatch};
