// A loaded model: config from GGUF metadata, weights in the format its backend asks
// for (converted on the host where needed, then made resident), the family's traits,
// and the shared decoder forward pass.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "core/backend.h"
#include "gguf/gguf.h"
#include "kv/pool.h"
#include "model/arch.h"
#include "sample/sampler.h"
#include "tokenizer/tokenizer.h"

namespace dl {

// An M-RoPE image inside a forward call: rows [lo, hi) of the call, grid w wide, top-left at
// rope position base.
struct MropeGrid {
  int64_t lo = 0, hi = 0, base = 0, first = 0;  // first: the grid row of row lo
  int w = 1;
  // Deepstack inputs (n_deepstack > 0): per row of the call, n_deepstack x dim floats added to
  // the residual stream after decoder layers 0.. n_deepstack - 1; null: none.
  const float* deep = nullptr;
};

struct ModelConfig {
  std::string arch;
  int dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, head_dim_v = 0;
  int ffn_dim = 0, vocab_size = 0, seq_len = 0;
  float norm_eps = 1e-5f;
  // rope
  int n_rot = 0;
  float rope_base = 10000.f, rope_base_swa = 0.f, rope_freq_scale = 1.f, rope_freq_scale_swa = 1.f;
  std::string rope_scaling = "none";
  std::vector<double> rope_inv_freq;  // YaRN: per-pair frequencies (empty: from the base)
  float rope_mscale = 1.f;            // YaRN: cos/sin scale
  // M-RoPE (rope.dimension_sections): rotary pairs split into sections that rope by an image
  // row's temporal, height and width position (text rows: all three equal, i.e. plain rope).
  bool mrope = false;
  int rope_sections[4] = {0, 0, 0, 0};
  // Deepstack (n_deepstack_layers): image rows carry features for the first n decoder layers'
  // outputs as well (Qwen3-VL), added to the residual stream after each of them.
  int n_deepstack = 0;
  // attention
  int sliding_window = 0;
  std::vector<uint8_t> layer_is_swa;
  float attn_scale = 0.f, attn_softcap = 0.f, final_softcap = 0.f;
  // mixture of experts (0 experts: a dense model)
  int n_expert = 0, n_expert_used = 0, expert_ffn_dim = 0, shexp_ffn_dim = 0;
  bool moe_norm_topk = false;
  // Which layers keep KV and where: kv_slot[il] is the layer's slot in the cache geometry, -1
  // for a layer that keeps none (a recurrent layer).
  std::vector<int> kv_slot;
  int n_kv_layers = 0;
  // Recurrent (gated DeltaNet) layers: rec_slot[il] >= 0 for each, their state in the session.
  std::vector<int> rec_slot;
  int n_rec_layers = 0;
  int ssm_conv_k = 0, ssm_nk = 0, ssm_nv = 0, ssm_dk = 0, ssm_dv = 0;
  int64_t ssm_conv_dim = 0;    // the conv's channels: q and k (nk dk each), v (nv dv)
  int64_t rec_state_floats = 0;  // one layer's state: the conv's (k-1) x conv_dim rows, then nv x dk x dv
  // Per-layer shapes, filled for every family (uniform for most; gemma4's sliding and global
  // layers differ in head dim, kv heads and rope dims, its later layers may have a wider FFN).
  // head_dim, n_kv_heads, ffn_dim above are the largest of them (scratch, cache row width).
  std::vector<int> l_head_dim, l_kv_heads, l_n_rot, l_ffn_dim;
  // The layer whose cache layer il attends over: itself, or an earlier layer of its kind whose
  // KV it shares (gemma4's shared_kv_layers: they store nothing, the pool keeps no rows for them).
  std::vector<int> kv_src;
  int ple_dim = 0;  // per-layer embedding width (gemma4 E-series), 0: none
};

struct LayerWeights {
  Vec attn_norm, attn_post_norm, ffn_norm, ffn_post_norm, q_norm, k_norm;
  Vec bq, bk, bv, bo;
  Vec attn_sinks;  // a logit per query head (gpt-oss)
  Weight wq, wk, wv, wqkv, wo, w_gate, w_up, w_gate_up, w_down;
  // mixture of experts: the router, the expert stacks (with biases where the family has
  // them) and an optional shared expert behind its own sigmoid gate (a 1-row matrix)
  Weight router, gate_exps, up_exps, down_exps, gate_shexp, up_shexp, down_shexp, router_shexp;
  // gemma4's MoE layers: experts' gate and up as one stack ([gate | up] per expert), a per-expert
  // scale of the routing weights (a 1-column table read by expert id), the router's input norm
  // (its scale over sqrt(dim)), and the norms around the dense MLP that runs beside the experts.
  Weight gate_up_exps, exp_scale;
  Vec router_in_norm, ffn_pre_norm_2, ffn_post_norm_1, ffn_post_norm_2;
  Vec router_b, gate_exps_b, up_exps_b, down_exps_b;
  // a gated-DeltaNet layer: the qkv and z (output gate) projections, the per-head gate logits
  // (alpha: decay, beta: write strength), the conv, A, dt bias, the gated norm, the output
  Weight ssm_qkv, ssm_z, ssm_alpha, ssm_beta, ssm_ba, ssm_out;  // ssm_ba: beta and alpha interleaved
  Vec ssm_conv, ssm_a, ssm_dt, ssm_norm;
  // per-layer embeddings (gemma4 E-series): gate and projection, the projection's post-norm
  Weight ple_gate, ple_proj;
  Vec ple_post_norm;
  float out_scale = 1.f;  // the layer's output scaled by this (gemma4's layer_output_scale)
};

class Session;
class Model;

// The file's tokenizer with its family's quirks from the registry (an unregistered or absent
// general.architecture has none): what Model::load builds, exposed for the tests.
std::shared_ptr<Tokenizer> load_tokenizer(const gguf::File& f);

// Per-token callback of generate: (id, piece) -> keep going.
using TokenCallback = std::function<bool(int32_t, const std::string&)>;

// Prefills the prompt (token ids, or npos embedding rows when embd is set) in one
// eval, then samples up to max_tokens, stopping on an end-of-generation id (or one of
// stop_ids, which then replaces them), a false from the callback, or a full context.
// special: control tokens stream as their text. Returns the tokens emitted.
int64_t generate(Model& m, Session& s, const std::vector<int32_t>& prompt, const float* embd, int64_t npos,
                 const SamplingParams& p, int64_t max_tokens, const TokenCallback& cb,
                 const std::vector<int32_t>* stop_ids = nullptr, bool special = false);

class Model : public std::enable_shared_from_this<Model> {
 public:
  // Layers a backend ran fused (Backend::decode_layer) since load: tests check the path is taken.
  int64_t fused_layers() const { return fused_layers_; }
  int64_t fused_ops() const { return backend_->fused_ops(); }
  // Ops the backend ran on a named optional path since load (Backend::path_count).
  int64_t path_count(const std::string& name) const { return backend_->path_count(name); }
  // Logits blocks made in parts of the vocabulary (Backend::matmul_logits) since load.
  int64_t parted_logits() const { return parted_logits_; }
  // eval_batch steps issued from their speculated recording (Model::speculate) since load.
  int64_t speculated_steps() const { return spec_hits_; }
  bool speculation_pending() const { return spec_.on; }
  ~Model();
  // device: "cpu", "cuda", "cuda:N" (see make_backend). Throws GGUFError /
  // UnsupportedModelError / DeviceError (before any device memory is taken) / dl::Error.
  static std::shared_ptr<Model> load(const std::string& path, QuantMode mode, const std::string& device,
                                     int n_threads);
  // What a load and one session of n_ctx rows would take of the backend's memory, from the
  // file's header and shapes alone (no weight is converted, packed or allocated).
  struct MemoryEstimate {
    size_t weights = 0;      // resident weights in the backend's format (packed on the CPU)
    size_t embd_table = 0;   // of which: the embedding table read in place (paged in by rows used)
    size_t kv = 0;           // one session's KV cache of n_ctx rows
    size_t scratch = 0;      // activations, logits, attention scratch (about)
    size_t total = 0;
    size_t available = 0;    // host memory available now (0: unknown)
  };
  static MemoryEstimate estimate(const std::string& path, QuantMode mode, const std::string& device, int64_t n_ctx,
                                 KVType kv_type);

  const ModelConfig& config() const { return cfg_; }
  const ArchTraits& traits() const { return *traits_; }
  const gguf::File& file() const { return *file_; }
  std::shared_ptr<gguf::File> file_ptr() const { return file_; }
  QuantMode mode() const { return mode_; }
  Backend& backend() const { return *backend_; }
  const std::shared_ptr<Backend>& backend_ptr() const { return backend_; }
  // Bytes of weights resident on the backend (after conversion).
  size_t weight_bytes() const { return weight_bytes_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  // End-of-generation ids: eos, eot, eom and the control tokens chat templates end turns with.
  const std::vector<int32_t>& eog_ids() const { return eog_; }
  bool is_eog(int32_t id) const;

  // Runs n tokens (or embedding rows when embd != null, n rows of dim floats)
  // at positions n_past.. of the session; writes logits of the last row (or of
  // every row when all_logits) into the session. Serialized per model.
  // Embedding rows enter the history as media_ids (negative) when given, else -1.
  // Rows [span_lo, span_hi) of the call (span_lo < span_hi) are one non-causal span: each of
  // them attends every row of the span (an image's rows, gemma vision); the rest stay causal.
  void forward(Session& s, const int32_t* tokens, const float* embd, int64_t n, bool all_logits,
               const int32_t* media_ids = nullptr, int64_t span_lo = 0, int64_t span_hi = 0,
               const struct MropeGrid* grid = nullptr);
  // forward for a model with M-RoPE: rows [lo, hi) of the call are an image merged to a
  // grid_h x grid_w grid (row-major), roped at (t, h, w) = (p, p + y, p + x) from the rope position
  // p the first of them would take; later rows continue at p + max(grid_h, grid_w), which the
  // session keeps (Session::rope_marks). non_causal: the rows also form one non-causal span.
  // first_row: the span continues an image whose first first_row rows are already in the
  // session (a prefix cache attach that ended inside it); the mark is added when its last row is in.
  void forward_mrope(Session& s, const float* embd, int64_t n, const int32_t* media_ids, int64_t lo, int64_t hi,
                     int grid_h, int grid_w, bool non_causal, int64_t first_row = 0, const float* deep = nullptr);

  // Whether generate may run greedy decode steps ahead of the host (forward_greedy): a backend
  // whose steps run asynchronously (DASLLAMA_PIPELINE=1: any backend, for tests; 0: never) and a
  // session a step can be taken back from exactly (no recurrent layers).
  bool can_pipeline(const Session& s) const;
  // One greedy decode step: evaluates *token, or (token null) the id the step before left on
  // the backend, and leaves its own argmax there for the next; the logits stay on the backend
  // (fetch_logits). Pushes the token (-1 when on the backend) to the history. Returns the ticket
  // of the download of the picked id into *next (Backend::download_wait).
  int64_t forward_greedy(Session& s, const int32_t* token, int32_t* next);
  // The logits the last step left on the backend into s.logits.
  void fetch_logits(Session& s);

  // One decode step for B distinct sessions: row b evaluates tokens[b] at
  // sessions[b]'s position; the weights are read once for all rows.
  void forward_batch(Session* const* sessions, const int32_t* tokens, int64_t B);
  // A ragged step: session b evaluates counts[b] >= 1 tokens (taken in order from
  // tokens) at its position, so one session can prefill a chunk while others
  // decode one token each; each session gets the logits of its last row. KV
  // pages for every session are taken before any compute: on PoolExhaustedError
  // (index = the session asking) no session has moved.
  // greedy_ids (B ids, or null): each session's next id by Backend::argmax of its last row's
  // logits, taken on the backend; only the ids come back to the host and the sessions keep
  // no logits (a greedy stream samples argmax_first of them anyway: 4 bytes a row instead of
  // vocab floats, 32.8 MB over PCIe at B = 64 for a 128K vocabulary).
  void forward_ragged(Session* const* sessions, const int32_t* tokens, const int64_t* counts, int64_t B,
                      int32_t* greedy_ids = nullptr);

  // The KV cache geometry of this model for a codec (checks q8_0's block constraint).
  KVGeometry kv_geometry(KVType t) const;

  // A backend copy (src null: a fill with zeros) of a session's own buffers outside a step (its
  // recurrent state: rewinds, attaches), serialized with compute: a device backend may be
  // recording another thread's step.
  void state_copy(void* dst, const void* src, size_t bytes);

  // Embedding rows for tokens (scaled as the family's input layer does).
  void embed_tokens(const int32_t* tokens, int64_t n, float* out);
  // Pooled hidden state (mean of the final-norm outputs) of a token sequence.
  std::vector<float> embed_mean(const std::vector<int32_t>& tokens);

 private:
  int64_t fused_layers_ = 0;
  int64_t parted_logits_ = 0;
  Model() = default;
  static std::shared_ptr<Model> open(const std::string& path, QuantMode mode, const std::string& device,
                                     int n_threads, bool dry_run);
  void load_weights();
  void make_resident();
  std::vector<Weight*> matrices();  // every matrix the loader made (output first)
  void release_unread_pages();
  // Host-side: the matrix in the backend's chosen format (made resident later, all at once).
  Weight load_matrix(const std::string& name, bool required, int64_t rows = -1, int64_t cols = -1);
  // A stack of n_expert matrices of rows x cols (a 3-D tensor), as one matrix of matmul_id.
  Weight load_experts(const std::string& name, bool required, int64_t n_expert, int64_t rows, int64_t cols);
  void moe_block(int il, int64_t n);
  void parallel_moe_ffn(int il, int64_t n);
  std::vector<float> load_vector(const std::string& name, bool required, int64_t n = -1);
  Vec upload(const std::vector<float>& v) { return upload_vec(*backend_, v, "model weights"); }
  // A chunk of rows: runs of consecutive rows, each belonging to one session.
  struct Run {
    Session* s;
    int64_t first_row, n_rows;
    bool want_logits = true;  // false for a part of a run that continues in the next chunk
  };
  // One chunk of rows through every layer; the logits (or final-norm rows) stay on the
  // backend in logits_ / xn_ for the caller to download. Returns the rows of logits made.
  int64_t forward_chunk(const Run* runs, int n_runs, const int32_t* tokens, const float* embd, int64_t n,
                        bool all_logits);
  // The blocks of a layer, each a seam a backend could take over whole.
  void stage_step(const Run* runs, int n_runs, const int32_t* tokens, int64_t n);
  void attention_block(int il, const Run* runs, int n_runs, int64_t n);
  bool decode_layer(int il, const Run* runs, int n_runs, int64_t n);
  RopeParams rope_params(int il) const;
  AttnArgs attn_args(int il, const Run& run, int ri, const float* q, float* att) const;
  void recurrent_block(int il, const Run* runs, int n_runs, int64_t n);
  void ffn_block(int il, int64_t n);
  void project_residual(const Weight& w, const Vec& bias, const Vec& post_norm, const float* in, int64_t n, float* o);
  int64_t logits_block(const Run* runs, int n_runs, int64_t n, bool all_logits);
  float* scratch(BufferPtr& b, int64_t floats, const char* what);

  std::shared_ptr<gguf::File> file_;
  ModelConfig cfg_;
  const ArchTraits* traits_ = nullptr;
  QuantMode mode_ = QuantMode::q8;
  std::shared_ptr<Backend> backend_;
  size_t weight_bytes_ = 0;
  size_t embd_bytes_ = 0;  // the embedding table's share of weight_bytes_ (0 when tied to a packed output)
  std::set<uint32_t> noticed_;  // formats converted at load and said so
  std::shared_ptr<Tokenizer> tokenizer_;
  std::vector<int32_t> eog_;
  std::mutex mu_;

  Weight tok_embd_, output_;
  // Per-layer embeddings (gemma4 E-series): a token table of n_layers x ple_dim per token, the
  // projection of the input embedding to the same width and its norm.
  Weight ple_embd_, ple_model_proj_;
  Vec ple_proj_norm_;
  void ple_inputs(int64_t n);  // fills ple_ with the rows' per-layer inputs
  Vec output_norm_, rope_freqs_;
  BufferPtr rope_inv_freq_;  // YaRN's per-pair frequencies (double), on the backend
  // M-RoPE: per axis (t, h, w) the pair frequencies of its section, 0 elsewhere (double, on the
  // backend): an image row is three ropes, one per axis, each turning only its own pairs.
  BufferPtr mrope_inv_freq_[3];
  std::vector<LayerWeights> layers_;

  // Backend scratch for one chunk of up to max_chunk_ rows (grown on demand); set by open.
  int64_t max_chunk_ = 256;
  BufferPtr x_, xn_, q_, k_, v_, attn_, gate_, up_, ffn_, logits_, embd_;
  BufferPtr moe_logits_, moe_ids_, moe_w_, moe_y_, moe_sh_, moe_x_;
  BufferPtr qgate_, ssm_x_, ssm_ab_, ssm_o_;
  BufferPtr ple_, ple_tmp_, ple_ids_;
  float* embd_dev_ = nullptr;
  // Per-step host data, uploaded at once: token ids, positions, then each run's block table.
  std::vector<int32_t> meta_host_;
  BufferPtr meta_;
  const int32_t* tokens_dev_ = nullptr;
  // forward_greedy's step: its token on the backend (dev_ids_), where its argmax goes
  // (greedy_out_) and its logits (logits_dst_): the session's own (Session::greedy_), since
  // another thread's step may run between two of a greedy stream's.
  // forward_ragged's greedy steps set greedy_out_ alone (into batch_ids_): the argmax of each
  // row of logits_, made in one product, never in parts (the argmax reads whole rows).
  const int32_t* dev_ids_ = nullptr;
  int32_t* greedy_out_ = nullptr;
  float* logits_dst_ = nullptr;
  BufferPtr batch_ids_;
  std::shared_ptr<float> batch_ids_host_;  // a host block (pinned on CUDA: its copy overlaps the next recording)
  const int32_t* pos_dev_ = nullptr;
  // The positions attention masks by (each row sees keys up to its own); == pos_dev_ but for
  // the rows of a non-causal span, which see up to the span's last position.
  const int32_t* mask_pos_dev_ = nullptr;
  int64_t span_pos_lo_ = 0, span_pos_hi_ = 0;  // the current forward's span, in session positions
  // The current forward's M-RoPE image rows (session positions [lo, hi), a gh x gw grid, row-major,
  // at rope position base for its top-left) and whether this step holds any of them (then the
  // step's h and w positions follow pos_dev_'s t positions).
  int64_t mrope_lo_ = 0, mrope_hi_ = 0, mrope_base_ = 0, mrope_first_ = 0;
  int mrope_gw_ = 1;
  bool mrope_step_ = false;
  const int32_t* pos_hw_dev_ = nullptr;
  const float* deep_chunk_ = nullptr;  // this chunk's deepstack rows (host, n_deepstack x dim each), or null
  std::vector<float> deep_host_;
  BufferPtr deep_;
  // Whether a sliding layer's attention over the span must go row by row (the span ends at or past
  // the window, so keys before the span fall out of its last row's window but not of earlier rows').
  bool span_window_split(bool swa, int n_runs, int64_t span_last) const {
    return swa && cfg_.sliding_window > 0 && n_runs == 1 && span_pos_hi_ > span_pos_lo_ &&
           span_last >= cfg_.sliding_window;
  }
  std::vector<const int32_t*> run_pages_;  // each run's block table on the backend
  std::vector<AttnArgs> attn_args_;
  std::vector<float> hidden_host_;
  std::vector<Run> batch_runs_;          // forward_ragged's chunk being built (reused each step)
  std::vector<int32_t> batch_tokens_;
  std::vector<Session*> batch_want_;  // the sessions of a chunk that take logits, in row order
  // Host blocks for batch steps' logits (Backend::host_block: pinned on CUDA), each with its
  // size in floats; sessions hold references to the one their rows are in. A block no session
  // references is reused; at most kLogitsBlocks, then logits_block_for gives null.
  static constexpr size_t kLogitsBlocks = 4;
  std::vector<std::pair<std::shared_ptr<float>, size_t>> logits_blocks_;
  std::shared_ptr<float> logits_block_for(size_t floats);

  // ---- speculated batch steps (on by default, DASLLAMA_SPECULATE=0 off; backends that defer steps) ----
  // After a decode-only eval_batch step is issued, the step after it (the same sessions, one
  // token each, positions one on) is recorded while the device runs this one, its ids left to
  // fill; the next eval_batch of exactly that shape uploads the ids and issues it, so the host's
  // recording is off the step's critical path. Only where no page is to be taken or copied. Any
  // other step drops it (forward_chunk), as does a session that moved or whose table changed.
  struct Spec {
    bool on = false;
    std::vector<Session*> sessions;
    std::vector<uint64_t> serials;
    std::vector<int64_t> n_past;  // each session's position for the step's row
    std::vector<std::vector<int32_t>> pages;  // (a session's table is its own for life: the serial names it)
    int32_t* ids_dev = nullptr;  // the step's ids on the backend (the start of its metadata)
    bool greedy = false;         // recorded with the argmax of each row (forward_ragged's greedy_ids)
  } spec_;
  bool spec_making_ = false, defer_end_ = false, spec_kept_ = false;
  int64_t spec_hits_ = 0;
  std::vector<Run> spec_runs_;
  std::vector<int32_t> spec_ids_;
  static bool spec_on();
  void speculate(Session* const* sessions, int64_t B);
  bool spec_matches(Session* const* sessions, const int64_t* counts, int64_t B, bool greedy) const;
  void drop_spec();
};

}  // namespace dl
