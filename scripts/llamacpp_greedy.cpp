// llama.cpp's greedy token ids for given prompt ids: what gptpipe's agreement check (gptpipe.export.agreement)
// compares with the fp32 model. llama-simple prints text only, and text cannot say which ids made it.
// Built by scripts/build_llamacpp.sh against the same static libraries as llama-simple.
//
//   gptpipe-llama-greedy MODEL.gguf N_PREDICT [--logits] < prompt ids (whitespace-separated)
//
// Prints one JSON line: {"ids": [...]}, the generated ids, ending with the end-of-generation token (EOS, EOT...)
// where llama.cpp stops at one; with --logits also "logits": every step's logits over the vocabulary.
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

// One decode step: `tokens` at consecutive positions from `pos`, logits for the last one.
static bool decode(llama_context * ctx, llama_batch_ext * batch, const std::vector<llama_token> & tokens,
                   llama_pos pos) {
    llama_batch_ext_clear(batch);
    for (size_t i = 0; i < tokens.size(); ++i) {
        const int32_t idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
        const llama_pos p = pos + (llama_pos) i;
        llama_batch_ext_set_pos(batch, idx, &p);
    }
    llama_batch_ext_set_output_logits(batch, (int32_t) tokens.size() - 1, true);
    return llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch) == 0;
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf N_PREDICT [--logits] < prompt ids\n", argv[0]);
        return 2;
    }
    const int n_predict = std::stoi(argv[2]);
    const bool with_logits = argc > 3 && strcmp(argv[3], "--logits") == 0;
    std::vector<llama_token> prompt;
    for (long id; std::cin >> id;) {
        prompt.push_back((llama_token) id);
    }
    if (prompt.empty() || n_predict < 1) {
        fprintf(stderr, "no prompt ids on stdin, or N_PREDICT < 1\n");
        return 2;
    }

    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model * model = llama_model_load_from_file(argv[1], llama_model_default_params());
    if (model == nullptr) {
        fprintf(stderr, "unable to load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    for (llama_token id : prompt) {
        if (id < 0 || id >= n_vocab) {
            fprintf(stderr, "prompt id %d is outside the vocabulary (%d tokens)\n", id, n_vocab);
            return 2;
        }
    }
    llama_context_params params = llama_context_default_params();
    params.n_ctx = (uint32_t) (prompt.size() + n_predict);
    params.n_batch = (uint32_t) prompt.size();
    llama_context * ctx = llama_init_from_model(model, params);
    if (ctx == nullptr) {
        fprintf(stderr, "unable to create a context\n");
        return 1;
    }
    llama_sampler * greedy = llama_sampler_init_greedy();
    llama_batch_ext * batch = llama_batch_ext_init(ctx);

    std::string ids, logits;
    std::vector<llama_token> step = prompt;
    llama_pos pos = 0;
    for (int n = 0; n < n_predict; ++n) {
        if (!decode(ctx, batch, step, pos)) {
            fprintf(stderr, "decoding failed at generated token %d\n", n);
            return 1;
        }
        pos += (llama_pos) step.size();
        if (with_logits) {
            const float * row = llama_get_logits_ith(ctx, -1);
            logits += n ? ", [" : "[";
            for (int i = 0; i < n_vocab; ++i) {
                char number[32];
                snprintf(number, sizeof(number), i ? ", %.9g" : "%.9g", row[i]);
                logits += number;
            }
            logits += "]";
        }
        const llama_token id = llama_sampler_sample(greedy, ctx, -1);
        ids += (n ? ", " : "") + std::to_string(id);
        if (llama_vocab_is_eog(vocab, id)) {
            break;
        }
        step.assign(1, id);
    }
    printf("{\"ids\": [%s]%s%s%s}\n", ids.c_str(), with_logits ? ", \"logits\": [" : "", logits.c_str(),
           with_logits ? "]" : "");

    llama_batch_ext_free(batch);
    llama_sampler_free(greedy);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
