// llama_ids: prints llama.cpp's token ids for texts read from stdin (the oracle for
// tp-tokenizer's fixtures). Built and driven by make_fixture.py; not part of the crate.
//
// usage: llama_ids MODEL.gguf [PRE_OVERRIDE] < texts
//   stdin: texts separated by NUL bytes; stdout: one line of space-separated ids per text.
//   PRE_OVERRIDE replaces tokenizer.ggml.pre (to test other pre-tokenizers on one vocab).
// Tokenizes with add_special=true (BOS when the model asks for it) and parse_special=true.
#include "llama.h"

#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

static void quiet_log(ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [PRE_OVERRIDE] < texts\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    std::vector<llama_model_kv_override> overrides(2);
    std::memset(overrides.data(), 0, sizeof(llama_model_kv_override) * overrides.size());
    if (argc >= 3) {
        overrides[0].tag = LLAMA_KV_OVERRIDE_TYPE_STR;
        std::snprintf(overrides[0].key, sizeof(overrides[0].key), "%s", "tokenizer.ggml.pre");
        std::snprintf(overrides[0].val_str, sizeof(overrides[0].val_str), "%s", argv[2]);
        params.kv_overrides = overrides.data();  // the zeroed second entry ends the list
    }
    llama_model * model = llama_model_load_from_file(argv[1], params);
    if (model == nullptr) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);

    std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    size_t start = 0;
    while (start <= input.size()) {
        size_t end = input.find('\0', start);
        if (end == std::string::npos) {
            end = input.size();
        }
        const std::string text = input.substr(start, end - start);
        std::vector<llama_token> ids(text.size() + 16);
        int n = llama_tokenize(vocab, text.data(), (int32_t) text.size(), ids.data(), (int32_t) ids.size(), true, true);
        if (n < 0) {
            std::fprintf(stderr, "tokenize failed (%d)\n", n);
            return 1;
        }
        for (int i = 0; i < n; i++) {
            std::printf(i ? " %d" : "%d", ids[i]);
        }
        std::printf("\n");
        if (end == input.size()) {
            break;
        }
        start = end + 1;
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
