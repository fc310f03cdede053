//! Typed errors of the planner: bad presets, bad cluster shapes, unreadable or
//! malformed model/cluster files, inconsistent workloads.

use std::path::PathBuf;

/// Everything that can go wrong while planning. No variant is a panic.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("unknown model preset `{name}`; valid presets: {valid}")]
    UnknownModelPreset { name: String, valid: String },
    #[error("unknown accelerator preset `{name}`; valid presets: {valid}")]
    UnknownAcceleratorPreset { name: String, valid: String },
    #[error("the number of GPUs must be at least 1")]
    ZeroGpus,
    #[error("the number of GPUs per node must be at least 1")]
    ZeroGpusPerNode,
    #[error("{gpus} GPUs cannot be split into whole nodes of {per_node} GPUs")]
    GpusNotDivisibleByNode { gpus: u64, per_node: u64 },
    #[error("cannot read `{path}`")]
    FileRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed model config `{path}`: {message}")]
    MalformedModelConfig { path: PathBuf, message: String },
    #[error("malformed GGUF file `{path}`: {message}")]
    MalformedGguf { path: PathBuf, message: String },
    #[error("malformed cluster file `{path}`: {message}")]
    MalformedClusterFile { path: PathBuf, message: String },
    #[error("invalid model `{name}`: {message}")]
    InvalidModel { name: String, message: String },
    #[error("invalid workload: {0}")]
    InvalidWorkload(String),
    #[error("invalid cluster: {0}")]
    InvalidCluster(String),
    #[error("cannot serialize the plan to JSON")]
    Json(#[from] serde_json::Error),
}
