// The decode step's dense layers as one persistent kernel that streams the weights (mega.cu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime.h>

#include "core/backend.h"

namespace dl::cuda {

// One layer, as the kernel reads it (device memory, built once per plan).
struct MegaLayer {
  const uint8_t* w[7] = {};  // q, k, v, o, gate, up, down: split q8_0 / q4_0 rows
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* next_norm = nullptr;  // the next layer's attn_norm; null after the chain's last
  RopeParams rope;
  uint64_t attn_off = 0;  // this layer's AttnArgs: bytes into the step's blob
};

// The shapes every layer of a chain shares.
struct MegaShape {
  uint32_t type = 0;  // T_Q8_0S or T_Q4_0S
  int dim = 0, q_dim = 0, kv_dim = 0, ffn = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0;
  KVType kv = KVType::f16;
  float eps = 0.f;
  int act = 0;
};

struct MegaArgs {
  MegaShape s;
  const MegaLayer* layers = nullptr;
  const uint8_t* blob = nullptr;
  const uint32_t* task_off = nullptr;  // [grid + 1]
  const uint32_t* tasks = nullptr;
  int n_layers = 0;
  uint32_t rb_in = 0, rb_o = 0, rb_d = 0;  // row bytes of the dim-, q_dim- and ffn-wide matrices
  int r_dn = 0;                            // down rows a task
  int splits = 0;                          // attention splits of a head
  const int32_t* pos = nullptr;
  float *x = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *h = nullptr, *part = nullptr;
  uint8_t *xa = nullptr, *xb = nullptr, *aq = nullptr, *hq = nullptr;  // q8 rows: quants, d, sums, ss
  unsigned* cnt = nullptr;
  uint32_t slot_bytes = 0;
  int n_slots = 0;
  bool rel = false;               // release / acquire atomics instead of fences
  int prefetch = 0;               // weight tasks the loader asks into L2 ahead of its ring
  int trace = -1;                 // >= 0: block 0 stamps when each op's input was ready, printed at this position
  unsigned long long* stamps = nullptr;
};

// Why a chain cannot run here ("" when it can): types, head sizes, widths.
const char* mega_unfit(const MegaShape& s, int sm_major);
// How many layers of this shape one chain's shared memory takes (its ring of two slots at
// least, and every block's task list); 0: not one.
int mega_max_layers(const MegaShape& s, int sms, int smem_optin);

// The device plan of a chain: tasks per block, the layers, scratch and counters. Built once
// for a chain's pointers and shapes, kept while they hold.
class MegaPlan {
 public:
  ~MegaPlan();
  // (Re)builds when layers or shape differ from the last call; returns the launch's args
  // (blob set by the caller at launch).
  const MegaArgs& prepare(const MegaShape& s, const std::vector<MegaLayer>& layers, const int32_t* pos, float* x,
                          float* q, float* k, float* v, cudaStream_t st);
  void launch(const uint8_t* blob, cudaStream_t st) const;
  // Whether prepare() with these would keep this plan as it is.
  bool matches(const MegaShape& s, const std::vector<MegaLayer>& layers, const int32_t* pos, float* x, float* q,
               float* k, float* v) const;

 private:
  void release();
  MegaShape shape_{};
  std::vector<MegaLayer> layers_;
  MegaArgs a_{};
  int grid_ = 0;
  size_t smem_ = 0;
  int slots_all_ = 0;  // the slots shared memory holds
  void* dev_ = nullptr;   // layers, tasks, scratch
  void* cnt_ = nullptr;   // counters (zeroed once; the kernel leaves them zero)
  size_t cnt_bytes_ = 0;
};

}  // namespace dl::cuda
