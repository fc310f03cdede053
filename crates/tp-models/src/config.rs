//! The model description is tp-spec's; this adapts candle's GGUF metadata to its reader and
//! maps its errors into [`ModelError`]s.

use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::Value;
use std::collections::HashMap;
pub use tp_spec::{Arch, Experts, ModelConfig, RopeStyle};
use tp_spec::{MetaValue, Metadata, SpecError};

/// candle's metadata map seen through tp-spec's [`Metadata`].
struct CandleMeta<'a>(&'a HashMap<String, Value>);

impl Metadata for CandleMeta<'_> {
    fn meta(&self, key: &str) -> Option<MetaValue> {
        Some(match self.0.get(key)? {
            Value::U8(x) => MetaValue::Uint(u64::from(*x)),
            Value::U16(x) => MetaValue::Uint(u64::from(*x)),
            Value::U32(x) => MetaValue::Uint(u64::from(*x)),
            Value::U64(x) => MetaValue::Uint(*x),
            Value::I8(x) => MetaValue::Int(i64::from(*x)),
            Value::I16(x) => MetaValue::Int(i64::from(*x)),
            Value::I32(x) => MetaValue::Int(i64::from(*x)),
            Value::I64(x) => MetaValue::Int(*x),
            Value::F32(x) => MetaValue::Float(f64::from(*x)),
            Value::F64(x) => MetaValue::Float(*x),
            Value::Bool(x) => MetaValue::Bool(*x),
            Value::String(s) => MetaValue::Text(s.clone()),
            Value::Array(a) => MetaValue::Array { len: a.len() },
        })
    }
}

/// The config of a GGUF from its metadata ([`ModelConfig::from_gguf`]).
pub fn config_from_gguf(
    md: &HashMap<String, Value>,
    embed_rows: Option<usize>,
    has_output: bool,
) -> Result<ModelConfig> {
    Ok(ModelConfig::from_gguf(
        &CandleMeta(md),
        embed_rows,
        has_output,
    )?)
}

impl From<SpecError> for ModelError {
    fn from(e: SpecError) -> Self {
        match e {
            SpecError::Config(m) => ModelError::Config(m),
            SpecError::MissingMetadata { key, hint } => ModelError::MissingMetadata {
                key,
                hint,
                path: String::new(),
            },
            SpecError::UnsupportedArch { arch } => ModelError::UnsupportedArch {
                arch,
                path: String::new(),
            },
            reason @ SpecError::Experts { .. } => ModelError::Unsupported {
                reason,
                path: String::new(),
            },
        }
    }
}
