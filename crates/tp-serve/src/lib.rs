//! tp-serve: an OpenAI-compatible HTTP server over the tensor-parallel engine. Rank 0 runs
//! the [`scheduler`] (continuous batching over the step protocol) on its own thread and the
//! [`server`] (axum) on a tokio runtime thread; they talk through channels.

pub mod api;
pub mod banner;
pub mod client;
pub mod conn;
pub mod error;
pub mod fdlimit;
pub mod load;
pub mod metrics;
pub mod response;
pub mod scheduler;
pub mod server;
pub mod service;

pub use api::DEFAULT_MAX_N;
pub use conn::ConnLimits;
pub use error::{ApiError, Result, ServeError};
pub use metrics::Metrics;
pub use scheduler::{Control, Event, Job, Load, SchedulerConfig, SchedulerHandle};
pub use server::{check_api_key, Server, ServerConfig, StopHandle, DEFAULT_MAX_BODY_BYTES};
pub use service::{kv_plan, serve, KvBudget, KvPlan, Ready, ServeConfig};
