// Whisper-class audio towers from llama.cpp-layout mmproj GGUFs (clip.* keys, a.* and
// mm.a.* tensors): the whisper encoder and the projectors qwen2a / qwen2.5o, ultravox,
// voxtral, or none (family "whisper": encoder rows). Shapes come from the tensors;
// metadata supplies only what tensors cannot say (head count, norm epsilon).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "audio/mel.h"
#include "core/backend.h"
#include "encoder/blocks.h"
#include "gguf/gguf.h"

namespace dl::audio {

enum class Projector { none, qwen2a, ultravox, voxtral };
// How mel frames become encoder positions: whisper's two 1-D convs (k3 s1, k3 s2) and learned
// positions, or three 2-D convs (k3 s2 over mel bins and frames, GELU) and a linear over the
// flattened channels and bins, with sinusoid positions restarting in every chunk (Qwen3-ASR).
enum class Stem { conv1d, conv2d };

using EncoderLayer = encoder::Layer;

// One audio family as data: the projector it uses and how its processor cuts a clip. The
// table (tower.cpp's tower_families) is the only place a family name is written; loading,
// probing and row counts read the traits.
struct TowerFamily {
  const char* name;          // clip.audio.projector_type (or clip.projector_type)
  Projector proj = Projector::none;
  bool full_window_default = true;  // false: the processor keeps only the clip's rows
  int window_frames = 0;     // > 0: the clip's frames are encoded in chunks of this many mel frames
  Stem stem = Stem::conv1d;
  int attn_frames = 0;       // conv2d stem: mel frames per attention window (whole chunks); 0: all
  int min_samples = 0;       // conv2d stem: shorter clips are zero-padded to this many samples
};
const std::vector<TowerFamily>& tower_families();
const TowerFamily* find_tower_family(const std::string& name);

struct TowerConfig {
  std::string family;  // the file's projector type: qwen2a, qwen2.5o, ultravox, voxtral, whisper
  Projector proj = Projector::none;
  int n_mel = 0, dim = 0, n_layers = 0, n_heads = 0, ffn_dim = 0, n_pos = 0;
  int proj_dim = 0;     // width of the rows encode() writes
  int stack = 1;        // ultravox / voxtral: encoder rows stacked per projector row
  int proj_hidden = 0;  // ultravox / voxtral: the projector MLP's inner width
  float eps = 1e-5f;
  bool full_window_default = true;  // false: the family's processor keeps only the clip's rows
  int window_frames = 0;  // qwen2.5o: mel frames per independently encoded chunk (2 * n_window)
  Stem stem = Stem::conv1d;
  int conv_channels = 0;  // conv2d stem: channels of its convs
  int attn_frames = 0, min_samples = 0;  // see TowerFamily
};

// Caller-owned host buffers of one encode (the mel front end); holds no clip state.
struct AudioScratch {
  MelScratch mel_s;
  std::vector<float> mel;
};

class AudioEncoder {
 public:
  // The family name of the file's audio projector, or "" when it holds no audio tower we
  // serve. Throws GGUFError only for a malformed file.
  static std::string probe_family(const gguf::File& f);
  // device as for make_backend; the mel front end runs on the CPU, the rest on the device.
  static std::shared_ptr<AudioEncoder> load(const std::string& path, const std::string& device, int n_threads);

  const TowerConfig& config() const { return cfg_; }
  const std::string& path() const { return file_->path(); }
  // Rows encode() writes for a clip of n samples.
  int64_t n_rows(int64_t n_samples, bool full_window) const;
  // 16 kHz mono -> n_rows(n) x proj_dim floats into out (room for out_cap floats).
  int64_t encode(const float* x, int64_t n, bool full_window, AudioScratch& s, float* out, int64_t out_cap);
  // One 30 s window of log-mel features the caller made (n_mel x kChunkFrames, host,
  // row-major) -> kChunkFrames / 2 rows of dim into out: whisper's transcribe feeds windows
  // cut from the whole clip's features (normalized over the clip, zero-padded past its end),
  // which no sample window reproduces. Bare encoders only (no projector: family "whisper").
  int64_t encode_mel_window(const float* mel, float* out, int64_t out_cap);
  Backend& backend() { return *backend_; }
  const std::shared_ptr<Backend>& backend_ptr() const { return backend_; }

 private:
  AudioEncoder() = default;
  void load_weights();
  // Encoder positions [0, L) of one chunk into h (L x dim, backend memory), post-LN not
  // applied. The mel rows (backend memory) have `stride` columns; frames past `avail`
  // read as zero (conv padding); conv1 runs over frames [0, S) and conv2 reads zeros past S.
  void encode_chunk(const float* mel, int64_t stride, int64_t avail, int64_t S, int64_t L);
  // The qwen2a projector: pairs of h's positions averaged, post-LN, linear, into rows of out.
  void pool_project(const float* h, int64_t rows, float* out);
  // The conv2d stem's path (Qwen3-ASR): the clip's own mel frames in chunks, each through the
  // convs and the linear with its own positions, attention within windows of whole chunks,
  // post-LN, the GELU MLP projector.
  void load_conv2d_stem();
  int64_t conv2d_rows(int64_t n) const;
  int64_t encode_conv2d(const float* x, int64_t n, AudioScratch& s, float* out);
  float* buf(int i, int64_t floats);
  int64_t clip_frames(int64_t n, bool full_window) const;
  int64_t chunk_rows(int64_t L, bool full_window) const;

  std::shared_ptr<gguf::File> file_;
  TowerConfig cfg_;
  std::shared_ptr<Backend> backend_;
  std::unique_ptr<MelBank> mel_;
  std::mutex mu_;  // one encode at a time (the device buffers below are shared)
  Weight conv1_, conv2_, conv3_, conv_out_;
  Vec conv1_b_, conv2_b_, conv3_b_, pos_emb_, post_w_, post_b_;
  std::vector<EncoderLayer> layers_;
  // projectors
  Weight fc_, mm1_, mm2_;
  Vec fc_b_, mm1_b_, mm2_b_, norm_pre_, norm_mid_;
  // Backend scratch (grown on demand): mel, all positions, im2col, conv1, h, pooled, projector,
  // projector 2, output; the blocks keep their own.
  enum { B_MEL, B_HALL, B_X1, B_G1, B_H, B_P, B_Y, B_Y2, B_OUT, B_G2, B_COUNT };
  BufferPtr bufs_[B_COUNT];
  encoder::Blocks blocks_;
};

}  // namespace dl::audio
