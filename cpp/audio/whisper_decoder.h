// The whisper text decoder for speech recognition (not the audio-chat towers: those are
// tower.h): token embedding + learned positions, pre-LN blocks of causal self-attention
// with its own KV cache, cross-attention over the encoder rows (K and V computed once per
// window by set_encoder), GELU MLP, final LN, and the output tied to the embedding. It
// reads the d.* tensors and whisper.decoder.* keys `dasllama convert` writes beside the
// encoder's a.* tensors; it composes the Backend ops the encoder uses (no op of its own).
// Greedy (or seeded sampled) decoding with whisper's suppression and timestamp rules runs here, per token.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/backend.h"
#include "encoder/blocks.h"
#include "gguf/gguf.h"

namespace dl::audio {

struct WhisperDecoderConfig {
  int dim = 0, n_layers = 0, n_heads = 0, ffn_dim = 0, n_ctx = 0, vocab = 0;
  float eps = 1e-5f;
};

// What a greedy decode is told: the forced prompt, the token lists whisper suppresses, and
// (timestamp_begin > 0) the timestamp rules.
struct GreedyOptions {
  std::vector<int32_t> prompt;
  std::vector<int32_t> suppress;        // every step
  std::vector<int32_t> suppress_begin;  // the first generated step only
  int32_t eot = -1;
  int32_t no_timestamps = -1;   // suppressed when timestamps are on
  int32_t timestamp_begin = 0;  // > 0: apply the timestamp rules (tokens >= this are timestamps)
  int max_initial_timestamp = 50;  // the first timestamp is at most this index (1.0 s at 0.02 s)
  int max_new = 0;
  // > 0: sample each token from softmax(logits / temperature) (after suppression and the
  // timestamp rules) instead of taking the argmax, with a generator seeded by `seed`, so a
  // call is reproducible (whisper's temperature fallback).
  float temperature = 0;
  uint64_t seed = 0;
};

struct GreedyResult {
  std::vector<int32_t> tokens;  // generated, without the prompt or the end of text
  double sum_logprob = 0;       // of the generated tokens (end of text included), after suppression,
                                // from the untempered logits (as whisper sums them)
  float no_speech_prob = 0;     // P(no_speech_id) after the prompt's first token (<|startoftranscript|>)
};

class WhisperDecoder {
 public:
  // Whether the file holds a whisper decoder (d.token_embd.weight).
  static bool probe(const gguf::File& f);
  static std::shared_ptr<WhisperDecoder> load(const std::string& path, const std::string& device, int n_threads);

  const WhisperDecoderConfig& config() const { return cfg_; }
  Backend& backend() { return *backend_; }

  // Cross-attention K and V of every layer from n_enc encoder rows (host, n_enc x dim);
  // also empties the self-attention cache.
  void set_encoder(const float* rows, int64_t n_enc);
  // Feeds n tokens at positions [pos0, pos0 + n) (the cache keeps rows < pos0 from earlier
  // calls) and writes the logits of the last token, or of all n with all_logits, into out.
  void forward(const int32_t* ids, int64_t n, int64_t pos0, bool all_logits, float* out);
  // no_speech_id >= 0: also the probability of that token after prompt[sot_index]
  // (<|startoftranscript|>, which follows <|startofprev|> and earlier text when conditioned).
  GreedyResult greedy(const GreedyOptions& o, int32_t no_speech_id = -1, int sot_index = 0);

 private:
  struct Layer : encoder::Layer {  // the encoder block's weights, plus cross-attention's
    Vec lnx_w, lnx_b, xbq, xbk, xbv, xbo;
    Weight xq, xk, xv, xo;
  };
  WhisperDecoder() = default;
  void load_weights();
  float* buf(int i, int64_t floats);
  void step_logits_rules(float* logits, const GreedyOptions& o, const std::vector<int32_t>& gen) const;

  std::shared_ptr<gguf::File> file_;
  std::shared_ptr<Backend> backend_;
  WhisperDecoderConfig cfg_;
  // One call at a time (set_encoder, forward, greedy, which calls forward): the caches and
  // scratch below are shared.
  std::recursive_mutex mu_;
  Weight tok_rows_, tok_out_;  // the one table: read by get_rows, and as the tied output matmul
  Vec pos_emb_, out_w_, out_b_;
  std::vector<Layer> layers_;
  int64_t n_enc_ = 0;
  std::vector<BufferPtr> self_kv_, cross_kv_;  // per layer: [K rows][V rows], f32, one page
  enum { B_IDS, B_POS, B_XPOS, B_H, B_XN, B_Q, B_K, B_V, B_A, B_O, B_U, B_LOGITS, B_ENC, B_COUNT };
  BufferPtr bufs_[B_COUNT];
  BufferPtr page0_;
};

}  // namespace dl::audio
