//! Step-protocol commands that hold a second model beside the live one (a server's reload
//! without downtime): every rank loads its shard of a new model in the background while it
//! keeps executing steps, adopts it once loaded (all ranks agree whether every one of them
//! succeeded), selects which held model later commands apply to, and drops one. Each held
//! model has its own KV pool and slots, so a sequence always belongs to one model.
//!
//! When two models do not fit, a server drains first and then replaces the selected model in
//! place ([`ModelCommand::Replace`]): every rank frees its shard before it loads the new one,
//! so for that time no model serves (the downtime a drain swap reports).
//!
//! Wire form (inside [`crate::Command::Model`]): header `[OP_MODEL, op, id, payload words]`;
//! a load's (and a replace's) payload is the path's byte length then its UTF-8 bytes, four to
//! a word.

use crate::error::{EngineError, Result};

/// Longest model path a command carries (bytes).
pub const MAX_PATH_BYTES: usize = 4096;

/// What every rank does with its held models.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelCommand {
    /// Start loading this rank's shard of the model at `path` in the background, to be held
    /// as model `id` once adopted.
    Load { id: u32, path: String },
    /// Wait for the background load of `id` (within the load deadline), then learn whether
    /// every rank has its shard: held by all, or dropped by all.
    Adopt { id: u32 },
    /// Later slot and forward commands apply to model `id`.
    Select { id: u32 },
    /// Free model `id` (not the selected one) with its KV cache.
    Drop { id: u32 },
    /// Free the selected model (the only one held: nothing open on it) with its KV cache,
    /// then load this rank's shard of `path` as model `id`, selected; every rank learns
    /// whether all succeeded. When some rank failed, every rank is left without a model
    /// (only another replace runs then).
    Replace { id: u32, path: String },
}

const LOAD: u32 = 1;
const ADOPT: u32 = 2;
const SELECT: u32 = 3;
const DROP: u32 = 4;
const REPLACE: u32 = 5;

/// A path as payload words: its byte length, then its bytes four to a word.
fn path_words(path: &str) -> Vec<u32> {
    let bytes = path.as_bytes();
    let mut payload = vec![bytes.len() as u32];
    payload.extend(bytes.chunks(4).map(|c| {
        let mut w = [0u8; 4];
        w[..c.len()].copy_from_slice(c);
        u32::from_le_bytes(w)
    }));
    payload
}

impl ModelCommand {
    /// `(op, id, payload)`.
    pub(crate) fn encode(&self) -> (u32, u32, Vec<u32>) {
        match self {
            ModelCommand::Load { id, path } => (LOAD, *id, path_words(path)),
            ModelCommand::Replace { id, path } => (REPLACE, *id, path_words(path)),
            ModelCommand::Adopt { id } => (ADOPT, *id, Vec::new()),
            ModelCommand::Select { id } => (SELECT, *id, Vec::new()),
            ModelCommand::Drop { id } => (DROP, *id, Vec::new()),
        }
    }

    /// The command of `(op, id, payload)`; `bad` words a malformed one.
    pub(crate) fn decode(
        op: u32,
        id: u32,
        payload: &[u32],
        bad: impl Fn(String) -> EngineError,
    ) -> Result<ModelCommand> {
        let no_payload = |cmd: ModelCommand| {
            if payload.is_empty() {
                Ok(cmd)
            } else {
                Err(bad(format!("{cmd:?} with {} payload words", payload.len())))
            }
        };
        let path = || -> Result<String> {
            let Some((&len, words)) = payload.split_first() else {
                return Err(bad("a model load without its path".into()));
            };
            let len = len as usize;
            if len == 0 || len > MAX_PATH_BYTES || words.len() != len.div_ceil(4) {
                return Err(bad(format!(
                    "a model path of {len} bytes in {} words",
                    words.len()
                )));
            }
            let bytes: Vec<u8> = words
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .take(len)
                .collect();
            String::from_utf8(bytes).map_err(|_| bad("a model path that is not UTF-8".into()))
        };
        match op {
            LOAD => Ok(ModelCommand::Load { id, path: path()? }),
            REPLACE => Ok(ModelCommand::Replace { id, path: path()? }),
            ADOPT => no_payload(ModelCommand::Adopt { id }),
            SELECT => no_payload(ModelCommand::Select { id }),
            DROP => no_payload(ModelCommand::Drop { id }),
            op => Err(bad(format!("unknown model op {op}"))),
        }
    }

    /// Checks a path before it is sent: non-empty, at most [`MAX_PATH_BYTES`].
    pub fn check_path(path: &str) -> Result<()> {
        if path.is_empty() || path.len() > MAX_PATH_BYTES {
            return Err(EngineError::Param {
                name: "model path",
                message: format!("must be 1 to {MAX_PATH_BYTES} bytes, not {}", path.len()),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bad(m: String) -> EngineError {
        EngineError::Internal(m)
    }

    #[test]
    fn model_commands_round_trip() {
        for c in [
            ModelCommand::Load {
                id: 3,
                path: "/tmp/ckpt/step-00000300".into(),
            },
            ModelCommand::Load {
                id: 1,
                path: "m\u{e9}.gguf".into(),
            },
            ModelCommand::Adopt { id: 3 },
            ModelCommand::Select { id: 0 },
            ModelCommand::Drop { id: 7 },
            ModelCommand::Replace {
                id: 2,
                path: "/models/b.gguf".into(),
            },
        ] {
            let (op, id, p) = c.encode();
            assert_eq!(ModelCommand::decode(op, id, &p, bad).unwrap(), c);
        }
    }

    #[test]
    fn malformed_model_commands_are_errors() {
        assert!(ModelCommand::decode(LOAD, 1, &[], bad).is_err());
        // 5 bytes need 2 words.
        assert!(ModelCommand::decode(LOAD, 1, &[5, 0x6161_6161], bad).is_err());
        assert!(ModelCommand::decode(LOAD, 1, &[0], bad).is_err());
        // Not UTF-8.
        assert!(ModelCommand::decode(LOAD, 1, &[1, 0xff], bad).is_err());
        assert!(ModelCommand::decode(REPLACE, 1, &[], bad).is_err());
        assert!(ModelCommand::decode(ADOPT, 1, &[1], bad).is_err());
        assert!(ModelCommand::decode(99, 1, &[], bad).is_err());
        assert!(ModelCommand::check_path("").is_err());
        assert!(ModelCommand::check_path(&"a".repeat(MAX_PATH_BYTES + 1)).is_err());
    }
}
