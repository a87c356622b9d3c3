// Teacher-forced token windows through llama.cpp's library, for llmd's quality table.
//
//   llama-windows MODEL.gguf THREADS WINDOWS TOKENS < ids.i32 > out.bin
//
// stdin: WINDOWS x TOKENS token ids (int32, little-endian), the windows llmd measures itself on.
// stdout, per window: TOKENS - 1 float32 negative log-likelihoods of each next token, then TOKENS
// int32 argmax ids (the top-1 prediction at every position). Each window starts on an empty cache.
// Built by bench/build_llama_server.sh against the static libraries of the same llama.cpp build.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

static void quiet(enum ggml_log_level, const char *, void *) {}

int main(int argc, char **argv) {
    if (argc != 5) {
        std::fprintf(stderr, "usage: %s MODEL.gguf THREADS WINDOWS TOKENS < ids.i32 > out.bin\n", argv[0]);
        return 2;
    }
    const int threads = std::atoi(argv[2]), windows = std::atoi(argv[3]), tokens = std::atoi(argv[4]);
    if (threads < 1 || windows < 1 || tokens < 2 || tokens > 1 << 16) {
        std::fprintf(stderr, "llama-windows: bad THREADS, WINDOWS or TOKENS\n");
        return 2;
    }
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        std::fprintf(stderr, "llama-windows: could not load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = cp.n_batch = cp.n_ubatch = tokens;
    cp.n_threads = cp.n_threads_batch = threads;
    llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        std::fprintf(stderr, "llama-windows: could not create a context of %d tokens\n", tokens);
        return 1;
    }
    const int vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    std::vector<int32_t> ids(tokens);
    std::vector<float> nll(tokens - 1);
    std::vector<int32_t> top(tokens);
    llama_batch batch = llama_batch_init(tokens, 0, 1);
    for (int w = 0; w < windows; w++) {
        if (std::fread(ids.data(), sizeof(int32_t), tokens, stdin) != (size_t)tokens) {
            std::fprintf(stderr, "llama-windows: stdin ended in window %d\n", w);
            return 1;
        }
        for (int i = 0; i < tokens; i++) {
            if (ids[i] < 0 || ids[i] >= vocab) {
                std::fprintf(stderr, "llama-windows: token id %d outside the vocabulary of %d\n", ids[i], vocab);
                return 1;
            }
            batch.token[i] = ids[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        batch.n_tokens = tokens;
        llama_memory_clear(llama_get_memory(ctx), true);
        if (llama_decode(ctx, batch) != 0) {
            std::fprintf(stderr, "llama-windows: decode failed in window %d\n", w);
            return 1;
        }
        for (int i = 0; i < tokens; i++) {
            const float *l = llama_get_logits_ith(ctx, i);
            int best = 0;
            double mx = l[0];
            for (int v = 1; v < vocab; v++)
                if (l[v] > mx) mx = l[v], best = v;
            top[i] = best;
            if (i + 1 < tokens) {
                double sum = 0;
                for (int v = 0; v < vocab; v++) sum += std::exp((double)l[v] - mx);
                nll[i] = (float)(mx + std::log(sum) - l[ids[i + 1]]);
            }
        }
        std::fwrite(nll.data(), sizeof(float), tokens - 1, stdout);
        std::fwrite(top.data(), sizeof(int32_t), tokens, stdout);
    }
    std::fflush(stdout);
    llama_batch_free(batch);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
