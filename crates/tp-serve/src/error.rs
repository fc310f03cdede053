//! Errors: [`ApiError`] is what a client sees (an OpenAI error body with an HTTP status);
//! [`ServeError`] is what the server itself can fail with.

use serde_json::{json, Value};
use thiserror::Error;

/// An error answered to a client as `{"error": {"message", "type", "param", "code"}}`.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{status} {message}")]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request parameter at fault (`max_tokens`, `messages[0].content`, ...).
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 naming `param`.
    pub fn invalid(
        param: impl Into<String>,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.into()),
            code: Some(code),
        }
    }

    /// 400 about the body as a whole (not JSON, not UTF-8, ...).
    pub fn bad_body(code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some(code),
        }
    }

    /// A parameter of the wrong JSON type.
    pub fn wrong_type(param: &str, expected: &str, got: &Value) -> Self {
        Self::invalid(
            param,
            "invalid_type",
            format!(
                "invalid type for '{param}': expected {expected}, got {}",
                json_kind(got)
            ),
        )
    }

    /// 401; `hint` (from [`crate::ServerConfig::auth_hint`]) follows the message in
    /// parentheses: how the key is set, in the starting program's terms.
    pub fn unauthorized(hint: Option<&str>) -> Self {
        let mut message = "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key the server was started with".to_string();
        if let Some(h) = hint {
            message.push_str(&format!(" ({h})"));
        }
        ApiError {
            status: 401,
            message,
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        ApiError {
            status: 404,
            message: what.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    pub fn too_large(limit: usize) -> Self {
        ApiError {
            status: 413,
            message: format!(
                "the request body is larger than this server accepts ({limit} bytes); send a shorter prompt"
            ),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// The server cannot take the request now (queue full, shutting down).
    pub fn unavailable(status: u16, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some(code),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: 500,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

/// "a string", "a number", ... for error messages.
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// What starting or running the server can fail with.
#[derive(Debug, Error)]
pub enum ServeError {
    /// The address is taken or not ours; the CLI names its --port and --host flags.
    #[error("cannot listen on {addr} (choose another port or address)")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Boxed: the engine's errors carry flight records and are large.
    #[error(transparent)]
    Engine(Box<tp_engine::EngineError>),
    #[error("invalid setting {name}: {message}")]
    Config { name: &'static str, message: String },
    #[error("the HTTP server thread failed: {0}")]
    Server(String),
    /// The KV budget per rank is more than the machine has: admissions would outrun memory
    /// instead of queueing.
    #[error("a KV budget of {budget} bytes per rank is more than this machine's {machine} bytes")]
    KvOverMachine { budget: u64, machine: u64 },
    /// The KV budget per rank holds no whole block.
    #[error("a KV budget of {budget} bytes per rank holds {blocks} blocks of 32 positions ({per_block} bytes each); it must hold at least one")]
    KvTooSmall {
        budget: u64,
        blocks: usize,
        per_block: usize,
    },
}

impl From<tp_engine::EngineError> for ServeError {
    fn from(e: tp_engine::EngineError) -> Self {
        ServeError::Engine(Box::new(e))
    }
}

impl From<Box<tp_engine::EngineError>> for ServeError {
    fn from(e: Box<tp_engine::EngineError>) -> Self {
        ServeError::Engine(e)
    }
}

pub type Result<T> = std::result::Result<T, ServeError>;
