//! Opens whatever `--model` names: a GGUF file, an HF directory, or a `.safetensors` file
//! inside one; every failure is a typed error naming the path and what to pass instead.

use crate::checkpoint::Checkpoint;
use crate::error::{ModelError, Result};
use crate::gguf::GgufCheckpoint;
use crate::hf::HfCheckpoint;
use std::path::Path;

/// The checkpoint at `path`, with a clear error when it is neither format.
pub fn open_checkpoint(path: &Path) -> Result<Box<dyn Checkpoint>> {
    if path.is_dir() {
        return Ok(Box::new(HfCheckpoint::open(path)?));
    }
    if !path.exists() {
        return Err(ModelError::Input(format!(
            "model {} does not exist; give a GGUF file or an HF directory (config.json + *.safetensors)",
            path.display()
        )));
    }
    if path.extension().is_some_and(|e| e == "safetensors") {
        if let Some(dir) = path.parent().filter(|d| d.join("config.json").is_file()) {
            return Ok(Box::new(HfCheckpoint::open(dir)?));
        }
        return Err(ModelError::Input(format!(
            "{} is a safetensors file without a config.json beside it; give its directory, which holds config.json",
            path.display()
        )));
    }
    if path.file_name().is_some_and(|n| n == "config.json") {
        if let Some(dir) = path.parent() {
            return Ok(Box::new(HfCheckpoint::open(dir)?));
        }
    }
    Ok(Box::new(GgufCheckpoint::open(path)?))
}
