// llama.cpp's token ids for many texts in one process, each as `llama-tokenize --stdin --ids --no-escape` gives
// them for one (BOS when the GGUF asks for it, special-token text kept as text unless --parse-special). The
// held-out check of `gptpipe gguf` reads 200 passages: one llama-tokenize process each took ~65 ms, mostly
// loading the vocabulary. Built by scripts/build_llamacpp.sh against the same static libraries as llama-simple.
//
//   gptpipe-llama-tokenize MODEL.gguf [--parse-special] < texts
//
// stdin: each text as its length in bytes on a line of its own, then that many bytes (UTF-8, any characters).
// stdout: one line per text, its ids as a JSON array.
#include "llama.h"

#include <clocale>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

static void quiet(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.gguf [--parse-special] < texts (each: its byte count on a line, then it)\n",
                argv[0]);
        return 2;
    }
    const bool parse_special = argc > 2 && strcmp(argv[2], "--parse-special") == 0;

    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;  // tokenizing needs no weights
    llama_model * model = llama_model_load_from_file(argv[1], params);
    if (model == nullptr) {
        fprintf(stderr, "unable to load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const bool add_bos = llama_vocab_get_add_bos(vocab);  // as llama-tokenize: BOS (only) where the GGUF wants it

    std::string header, text;
    std::vector<llama_token> ids;
    while (std::getline(std::cin, header)) {
        const size_t length = std::stoul(header);
        text.resize(length);
        if (length && !std::cin.read(&text[0], (std::streamsize) length)) {
            fprintf(stderr, "stdin ended inside a text of %zu bytes\n", length);
            return 2;
        }
        ids.resize(length + 2);
        int n = llama_tokenize(vocab, text.data(), (int32_t) length, ids.data(), (int32_t) ids.size(), add_bos,
                               parse_special);
        if (n < 0) {  // more ids than bytes + 2: -n is the count
            ids.resize(-n);
            n = llama_tokenize(vocab, text.data(), (int32_t) length, ids.data(), (int32_t) ids.size(), add_bos,
                               parse_special);
        }
        std::string line = "[";
        for (int i = 0; i < n; ++i) {
            line += (i ? ", " : "") + std::to_string(ids[i]);
        }
        puts((line + "]").c_str());
    }
    llama_model_free(model);
    return 0;
}
