//! tp-tokenizer: a model's tokenizer and chat template from GGUF metadata or tokenizer.json.
