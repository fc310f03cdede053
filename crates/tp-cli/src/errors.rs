//! How the CLI prints an error: the message and each cause under it, once each.
//!
//! The project's convention (ARCHITECTURE.md, "Errors"): a library error's message may quote
//! its cause so that it reads completely on its own (in an HTTP body, a log line); such a
//! variant does not also return that cause from `source()`. anyhow contexts added by the CLI
//! are the only layers walked here, and a cause whose text the line already holds (a context
//! that formats its error in) is skipped rather than printed twice.

/// `e` and its causes joined by ": ", each text once.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut line = e.to_string();
    let mut next = e.source();
    while let Some(cause) = next {
        let text = cause.to_string();
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        next = cause.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    /// A message that quotes its cause and also returns it from `source()` (what the
    /// convention rules out, and what some foreign errors do).
    #[derive(Debug)]
    struct Embeds {
        source: std::io::Error,
    }

    impl std::fmt::Display for Embeds {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot read model.gguf: {}; check the path", self.source)
        }
    }

    impl std::error::Error for Embeds {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.source)
        }
    }

    fn missing() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::NotFound, "No such file or directory")
    }

    #[test]
    fn every_cause_once() {
        let e = Err::<(), _>(missing())
            .context("cannot open the tokenizer file tok.json")
            .context("cannot load the tokenizer of m.gguf")
            .unwrap_err();
        assert_eq!(
            chain(e.as_ref()),
            "cannot load the tokenizer of m.gguf: cannot open the tokenizer file tok.json: No such file or directory"
        );
    }

    #[test]
    fn an_embedded_cause_is_not_repeated() {
        let e = Err::<(), _>(Embeds { source: missing() })
            .context("cannot load the model m.gguf")
            .unwrap_err();
        let line = chain(e.as_ref());
        assert_eq!(
            line.matches("No such file or directory").count(),
            1,
            "{line}"
        );
        assert!(
            line.starts_with("cannot load the model m.gguf: cannot read model.gguf"),
            "{line}"
        );
    }
}
