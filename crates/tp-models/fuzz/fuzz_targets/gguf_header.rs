//! cargo-fuzz target: the GGUF header parser on arbitrary bytes returns a header whose every
//! tensor lies inside the input, or a typed error; it never panics or over-allocates.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = tp_models::GgufHeader::parse(data, "fuzz.gguf") {
        for t in &h.tensors {
            let r = h.data_range(t);
            assert!(
                r.start <= r.end && r.end <= data.len(),
                "{} outside the input",
                t.name
            );
        }
    }
});
