// The CPU backend: the op interface on the per-ISA kernel table and a thread pool.
// Backend memory is host memory, so uploads are copies and weights are read where
// the file is mapped (plus the packed layouts made at load).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "core/backend.h"
#include "core/errors.h"
#include "core/threadpool.h"
#include "cpu/kernels.h"
#include "quant/blocks.h"
#include "quant/quant.h"
#include "quant/types.h"
#include "sample/sampler.h"

namespace dl {

namespace {

constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kArena = size_t(32) << 20;

// Host memory. Large blocks (the KV pool, big scratch) are one reserved address range:
// the OS commits it as it is first written, and large pages may back it (fewer TLB misses
// when attention streams a long context).
class CpuBuffer final : public Buffer {
 public:
  CpuBuffer(size_t bytes, const char* what) {
    size_ = bytes;
    const size_t n = bytes ? bytes : 1;
#if defined(__linux__)
    if (n >= kHugePage) {
      void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        ptr_ = p;
        mapped_ = true;
#ifdef MADV_HUGEPAGE
        madvise(p, n, MADV_HUGEPAGE);
#endif
        return;
      }
    }
#endif
    ptr_ = std::aligned_alloc(64, (n + 63) / 64 * 64);
    if (!ptr_) throw Error(std::string(what) + ": cannot allocate " + std::to_string(bytes) + " bytes");
  }
  ~CpuBuffer() override {
#if defined(__linux__)
    if (mapped_) {
      munmap(ptr_, size_ ? size_ : 1);
      return;
    }
#endif
    std::free(ptr_);
  }

 private:
  bool mapped_ = false;
};

std::string cpu_model_name() {
  std::FILE* f = std::fopen("/proc/cpuinfo", "r");
  if (!f) return "";
  char line[512];
  std::string name;
  while (std::fgets(line, sizeof line, f)) {
    std::string l(line);
    if (l.rfind("model name", 0) == 0 && l.find(':') != std::string::npos) {
      name = l.substr(l.find(':') + 2);
      while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
      break;
    }
  }
  std::fclose(f);
  return name;
}

uint64_t read_u64_file(const char* path, bool* ok) {
  *ok = false;
  std::FILE* f = std::fopen(path, "r");
  if (!f) return 0;
  char buf[64] = {0};
  const bool got = std::fgets(buf, sizeof buf, f) != nullptr;
  std::fclose(f);
  if (!got || buf[0] < '0' || buf[0] > '9') return 0;  // "max": no limit
  *ok = true;
  return std::strtoull(buf, nullptr, 10);
}

std::string mib(size_t b) { return std::to_string((b + (size_t(1) << 19)) >> 20) + " MiB"; }

// One token's routing (Backend::moe_route): the k largest logits by selection (k is small),
// ties to the lower id; then the family's weights, in f32 as the references compute them.
void moe_route_row(const float* l, int n_expert, int k, MoeGate gate, bool norm, int32_t* ids, float* w) {
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < n_expert; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= ids[i] == e;
      if (!taken && (best < 0 || l[e] > l[best])) best = e;
    }
    ids[j] = best;
  }
  if (gate == MoeGate::sigmoid) {
    for (int j = 0; j < k; ++j) w[j] = 1.f / (1.f + std::exp(-l[ids[j]]));
  } else {
    const bool all = gate == MoeGate::softmax;
    float mx = l[ids[0]];
    if (all)
      for (int e = 0; e < n_expert; ++e) mx = std::max(mx, l[e]);
    float sum = 0.f;
    if (all)
      for (int e = 0; e < n_expert; ++e) sum += std::exp(l[e] - mx);
    else
      for (int j = 0; j < k; ++j) sum += std::exp(l[ids[j]] - mx);
    for (int j = 0; j < k; ++j) w[j] = std::exp(l[ids[j]] - mx) / sum;
  }
  if (norm) {
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += w[j];
    for (int j = 0; j < k; ++j) w[j] /= sum;
  }
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int n) : pool_(n > 0 ? n : default_threads()) { cpu::kernels(); }
  ThreadPool* host_threads() override { return &pool_; }
  const char* name() const override { return "cpu"; }
  DeviceInfo info() const override {
    DeviceInfo d;
    d.backend = "cpu";
    d.name = cpu_model_name();
    d.threads = pool_.size();
    return d;
  }

  BufferPtr alloc(size_t bytes, const char* what) override { return std::make_shared<CpuBuffer>(bytes, what); }
  // Refused here with a message rather than by the OOM killer later: the KV pool and
  // big scratch are reserved lazily, so an oversized one would only die once written.
  // DASLLAMA_NO_MEMCHECK=1 skips the check (overcommitted hosts, swap).
  void check_fits(size_t bytes, const char* what) override {
    static const bool off = [] {
      const char* e = std::getenv("DASLLAMA_NO_MEMCHECK");
      return e != nullptr && *e != '\0' && *e != '0';
    }();
    if (off) return;
    const size_t avail = host_memory_available();
    if (avail != 0 && bytes > avail)
      throw DeviceError(std::string(what) + " needs " + mib(bytes) + " but only " + mib(avail) +
                        " of host memory is available (MemAvailable, or the cgroup's limit); use a smaller "
                        "n_ctx / pool, a smaller QuantMode, or a smaller model");
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void download(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memmove(dst, src, bytes);
  }
  void zero(void* dst, size_t bytes) override {
    if (bytes) std::memset(dst, 0, bytes);
  }

  bool supports(Op op, uint32_t type) const override {
    switch (op) {
      case Op::matmul: return cpu::kernels().act_type(type) != UINT32_MAX;
      case Op::get_rows: {
        const TypeTraits* tt = type_traits(type);
        return tt && tt->dequantizable;
      }
      case Op::attention:
      case Op::kv_store: return type == (uint32_t)KVType::f32 || type == (uint32_t)KVType::f16 ||
                                type == (uint32_t)KVType::q8_0;
    }
    return false;
  }

  void matmul(const Weight& w, const float* x, int64_t n, float* y) override {
    const Weight* ws[1] = {&w};
    float* ys[1] = {y};
    matmul_multi(ws, ys, 1, x, n);
  }

  // Several weights over the same activations: one quantization of x and one
  // parallel pass over all their rows (QKV, gate|up), so decode pays one dispatch.
  void matmul_multi(const Weight* const* ws, float* const* ys, int count, const float* x, int64_t n) override {
    matmul_multi_ex(ws, ys, count, x, n, nullptr);
  }

  // The epilogue runs inside each row chunk's task: in the packed f32 / f16 kernel's registers,
  // or (other kernels) over the chunk's outputs right after they are written, while they are
  // still in cache. Either way the values are add_bias's and then gelu_erf's.
  void matmul_multi_ex(const Weight* const* ws, float* const* ys, int count, const float* x, int64_t n,
                       const MatmulEpilogue* eps) override {
    const cpu::KernelTable& kt = cpu::kernels();
    const int64_t k = ws[0]->cols;
    const uint32_t at = kt.act_type(ws[0]->type);
    for (int i = 0; i < count; ++i) {
      const TypeTraits* tt = type_traits(ws[i]->type);
      if (kt.act_type(ws[i]->type) == UINT32_MAX)
        throw UnsupportedModelError(std::string("no matmul kernel for weight type ") + (tt ? tt->name : "?"));
      if (ws[i]->cols != k || ws[i]->cols % tt->block_size != 0)
        throw UnsupportedModelError("matmul: bad row length " + std::to_string(ws[i]->cols));
    }
    // Weights wanting another activation format go alone (rare: mixed-type layers).
    int same = 0;
    const Weight* grp[8];
    float* gy[8];
    MatmulEpilogue ge[8];
    for (int i = 0; i < count; ++i) {
      if (kt.act_type(ws[i]->type) == at && same < 8) {
        grp[same] = ws[i];
        ge[same] = eps ? eps[i] : MatmulEpilogue{};
        gy[same++] = ys[i];
      } else {
        matmul_multi_ex(&ws[i], &ys[i], 1, x, n, eps ? &eps[i] : nullptr);
      }
    }
    const int64_t arb = (int64_t)cpu::act_row_bytes(at, k);
    // f32 activations are read where they lie unless an output overlaps them (a copy would
    // be a pass over x for nothing: 9 MB per whisper FFN down projection).
    bool in_place = at == (uint32_t)GGMLType::F32 && arb == k * 4;
    const uintptr_t x0 = (uintptr_t)x, x1 = (uintptr_t)(x + n * k);
    for (int i = 0; i < same && in_place; ++i) {
      const uintptr_t y0 = (uintptr_t)gy[i], y1 = (uintptr_t)(gy[i] + n * grp[i]->rows);
      in_place = y1 <= x0 || y0 >= x1;
    }
    const uint8_t* act = reinterpret_cast<const uint8_t*>(x);
    if (!in_place) {
      act_.resize((size_t)(arb * n));
      uint8_t* dst = act_.data();
      act = dst;
      auto quant = [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; ++t) kt.quantize_act(at, x + t * k, dst + t * arb, k);
      };
      if (n * k <= 16384)
        quant(0, n);  // a few rows: cheaper here than a dispatch
      else
        pool_.parallel_for(n, 1, quant);
    }
    // Rows in chunks (a multiple of the kernels' 4-row tiles) over all weights: about
    // 16 per thread, so a big matrix is not cut into thousands of counter grabs.
    int64_t total_rows = 0;
    for (int i = 0; i < same; ++i) total_rows += grp[i]->rows;
    // Multiples of 16: the kernels' 4-row tiles and the packed layouts' 16-row groups.
    // Decode takes multiples of 64 rows (four packed groups: independent chains for the kernel).
    // Prefill takes at least two groups, four for packed f32 / f16 weights: their kernel then
    // tiles 64 rows x 6 tokens (fewer loads per FMA than 32 x 12 or 16 x 16); every output's
    // arithmetic is the same either way.
    bool fp_packed = true;
    for (int i = 0; i < same; ++i)
      fp_packed &= grp[i]->packed != nullptr &&
                   (grp[i]->type == (uint32_t)GGMLType::F32 || grp[i]->type == (uint32_t)GGMLType::F16);
    const int64_t min_chunk = n <= 8 || fp_packed ? 4 * cpu::kPackRowAlign : 2 * cpu::kPackRowAlign;
    int64_t chunk = std::max<int64_t>(min_chunk, total_rows / (16 * pool_.size()) / min_chunk * min_chunk);
    // A decode step's output matrix: chunks short enough that the thread finishing last
    // leaves the other a few microseconds of waiting, not a 1536-row chunk's worth.
    if (n <= 8) chunk = std::min<int64_t>(chunk, 4 * min_chunk);
    int64_t first[9];
    cpu::MatmulArgs args[8];
    bool in_kernel[8] = {};
    first[0] = 0;
    for (int i = 0; i < same; ++i) {
      const Weight& w = *grp[i];
      cpu::MatmulArgs& a = args[i];
      a.wtype = w.type;
      a.k = k;
      a.w = w.data;
      a.w_row_bytes = w.row_bytes;
      a.act = act;
      a.act_row_bytes = (size_t)arb;
      a.n_tok = n;
      a.y = gy[i];
      a.y_stride = w.rows;
      a.rows = w.rows;
      a.wpack = (w.packed != nullptr && w.packed_for == (int)kt.isa) ? w.packed : nullptr;
      in_kernel[i] = a.wpack != nullptr && (w.type == (uint32_t)GGMLType::F32 || w.type == (uint32_t)GGMLType::F16);
      if (in_kernel[i]) {
        a.bias = ge[i].bias;
        a.gelu = ge[i].gelu_erf;
      }
      first[i + 1] = first[i] + (w.rows + chunk - 1) / chunk;
    }
    // Packed f32 / f16 weights over many tokens: tasks are blocks of kTokBlk tokens through every
    // row, so a block's activations stay in L2 while the weights stream past them (a row chunk
    // over all tokens re-reads every activation row from L3, chunk after chunk). Each output is
    // the same FMA chain either way.
    // The blocks (about kTokBlk tokens, a count that is a multiple of the threads) split the
    // kernel's 6-token tiles evenly, so the threads' first shares end together.
    constexpr int64_t kTokBlk = 96, kTile = 6;
    bool tok_blocks = fp_packed && n >= 4 * kTokBlk;
    for (int i = 0; i < same; ++i) tok_blocks &= in_kernel[i];
    if (tok_blocks) {
      const int64_t nth = pool_.size(), tiles = (n + kTile - 1) / kTile;
      const int64_t nb = std::max<int64_t>(1, ((n + kTokBlk / 2) / kTokBlk + nth - 1) / nth * nth);
      pool_.parallel_for(nb, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t b = lo; b < hi; ++b) {
          const int64_t t0 = b * tiles / nb * kTile, t1 = std::min(n, (b + 1) * tiles / nb * kTile);
          for (int i = 0; i < same && t1 > t0; ++i) {
            cpu::MatmulArgs a = args[i];
            a.act = act + t0 * arb;
            a.n_tok = t1 - t0;
            a.y = gy[i] + t0 * grp[i]->rows;
            kt.matmul_rows(a, 0, grp[i]->rows);
          }
        }
      });
      return;
    }
    pool_.parallel_for(first[same], 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        int i = 0;
        while (c >= first[i + 1]) ++i;
        const int64_t r0 = (c - first[i]) * chunk, r1 = std::min(grp[i]->rows, r0 + chunk);
        kt.matmul_rows(args[i], r0, r1);
        if (!in_kernel[i] && (ge[i].bias || ge[i].gelu_erf))
          for (int64_t t = 0; t < n; ++t) {
            float* yr = gy[i] + t * grp[i]->rows + r0;
            if (ge[i].bias)
              for (int64_t r = 0; r < r1 - r0; ++r) yr[r] += ge[i].bias[r0 + r];
            if (ge[i].gelu_erf) kt.gelu_erf_f32(yr, r1 - r0);
          }
      }
    });
  }

  // The file's bytes are read in place; matmul weights also get the ISA's packed layout.
  void load_weight(Weight& w, WeightUse use) override {
    w.data = w.host;
    if (use == WeightUse::matmul) pack(w);
  }

  void pack(Weight& w) {
    // DASLLAMA_NO_PACK=1 keeps file layouts (A/B benchmarks of the packed kernels).
    static const bool off = [] {
      const char* e = std::getenv("DASLLAMA_NO_PACK");
      return e != nullptr && *e != '\0' && *e != '0';
    }();
    const cpu::KernelTable& kt = cpu::kernels();
    // A stack of experts packs only when every expert starts on a packed row group.
    const bool split = w.expert_rows > 0 && w.expert_rows % cpu::kPackRowAlign != 0;
    // f32 / f16 pack only where their bytes stay readable (the file's mapping, a tower's own
    // copy, an owner's kept table): a converted copy (fp32 mode's) is freed once packed, and only the packing ISA has
    // an f32 / f16 packed kernel, so a later set_isa would find nothing to read.
    const bool fp = w.type == (uint32_t)GGMLType::F32 || w.type == (uint32_t)GGMLType::F16;
    const size_t n = off || split || (fp && w.owned && !w.host_kept) ? 0 : kt.pack_bytes(w.type, w.rows, w.cols);
    if (n == 0) return;
    std::shared_ptr<void> owner = pack_alloc(n);
    void* p = owner.get();
    const int64_t groups = (w.rows + cpu::kPackRowAlign - 1) / cpu::kPackRowAlign;
    // Slices of ~2 MiB of the source; a mapped source gives its pages back after each, so
    // packing a large table (a tied output) never holds it twice, and the load's peak is the
    // packed weights plus one slice of file pages.
    const size_t group_src = (size_t)cpu::kPackRowAlign * w.row_bytes;
    const int64_t slice = w.host_mapped ? std::max<int64_t>(16, (int64_t)((size_t(2) << 20) / group_src)) : groups;
    for (int64_t g0 = 0; g0 < groups; g0 += slice) {
      const int64_t g1 = std::min(groups, g0 + slice);
      pool_.parallel_for(g1 - g0, 64, [&](int64_t lo, int64_t hi) {
        if (w.expert_rows == 0) {
          kt.pack_rows(w.type, w.data, w.row_bytes, w.rows, w.cols, g0 + lo, g0 + hi, p);
          return;
        }
        // An expert is packed as a matrix of its own (the packed layouts group rows across a
        // matrix from its start; matmul_id reads each expert's from its own offset).
        const int64_t ge = w.expert_rows / cpu::kPackRowAlign;
        for (int64_t g = g0 + lo; g < g0 + hi;) {
          const int64_t e = g / ge, ghi = std::min(g0 + hi, (e + 1) * ge);
          kt.pack_rows(w.type, w.data + (size_t)(e * w.expert_rows) * w.row_bytes, w.row_bytes, w.expert_rows, w.cols,
                       g - e * ge, ghi - e * ge,
                       static_cast<uint8_t*>(p) + kt.pack_bytes(w.type, e * w.expert_rows, w.cols));
          g = ghi;
        }
      });
#if defined(__linux__)
      if (w.host_mapped) {
        // Whole pages below the slice's end (the page it ends in is the next slice's).
        static const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
        const uintptr_t lo = ((uintptr_t)w.data + (uintptr_t)g0 * group_src) & ~(pg - 1);
        const uintptr_t hi = ((uintptr_t)w.data + std::min((size_t)g1 * group_src, (size_t)w.rows * w.row_bytes)) &
                             ~(pg - 1);
        if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
      }
#endif
    }
    w.packed_owner = std::move(owner);
    w.packed = static_cast<const uint8_t*>(p);
    w.packed_for = (int)kt.isa;
    w.host_done = true;  // every packable type has a packed kernel: w.data is never read again
  }

  void get_rows(const Weight& w, const int32_t* ids, int64_t n, float* out) override {
    for (int64_t i = 0; i < n; ++i) {
      if (ids[i] < 0 || ids[i] >= w.rows) throw Error("token id " + std::to_string(ids[i]) + " out of range");
      dequantize_row(w.type, w.data + (size_t)ids[i] * w.row_bytes, out + i * w.cols, w.cols);
    }
  }

  void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps) override {
    for (int64_t r = 0; r < n_rows; ++r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      // Eight double lanes (vectorizable without reassociating one long chain), then their sum.
      double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t i = 0;
      for (; i + 8 <= dim; i += 8)
        for (int l = 0; l < 8; ++l) lane[l] += (double)xr[i + l] * xr[i + l];
      for (; i < dim; ++i) lane[i % 8] += (double)xr[i] * xr[i];
      const double ss = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
      const float s = (float)(1.0 / std::sqrt(ss / dim + eps));
      if (w)
        for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * s * w[i];
      else
        for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * s;
    }
  }

  void rope(float* x, int64_t n_tok, int64_t stride, int n_heads, int head_dim, const int32_t* pos,
            const RopeParams& p) override {
    const int half = p.n_rot / 2;
    const RopeTable& tab = rope_table(n_tok, pos, p);
    for (int64_t t = 0; t < n_tok; ++t) {
      const float* cs = tab.cs.data() + t * half;
      const float* sn = tab.sn.data() + t * half;
      for (int h = 0; h < n_heads; ++h) {
        float* v = x + t * stride + (int64_t)h * head_dim;
        for (int i = 0; i < half; ++i) {
          const int i0 = p.neox ? i : 2 * i;
          const int i1 = p.neox ? i + half : 2 * i + 1;
          const float a = v[i0], b = v[i1];
          v[i0] = a * cs[i] - b * sn[i];
          v[i1] = a * sn[i] + b * cs[i];
        }
      }
    }
  }

  void kv_store(const KVView& kv, int64_t first, const float* k, const float* v, int64_t n, int64_t src_stride,
                int64_t dim) override {
    const int64_t mask = kv.page_shift >= 62 ? INT64_MAX : (int64_t(1) << kv.page_shift) - 1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = first + i;
      uint8_t* page = kv.base + (size_t)kv.pages[j >> kv.page_shift] * kv.page_bytes + (size_t)(j & mask) * kv.row_bytes;
      store_row(kv.type, page + kv.k_off, k + i * src_stride, dim);
      store_row(kv.type, page + kv.v_off, v + i * src_stride, dim);
    }
  }
  static void store_row(KVType t, uint8_t* row, const float* s, int64_t dim) {
    switch (t) {
      case KVType::f32: std::memcpy(row, s, (size_t)dim * 4); break;
      case KVType::f16: cpu::kernels().f32_to_f16(s, (uint16_t*)row, dim); break;
      case KVType::q8_0: quantize_row((uint32_t)GGMLType::Q8_0, s, row, dim); break;
    }
  }

  void attention(const AttnArgs& a) override { attention_multi(&a, 1); }

  // An encoder's rows (any_order) in one f32 page, every row seeing every key: the blocked
  // dense kernel, where the ISA has one.
  bool dense_ok(const AttnArgs& a) const {
    const cpu::KernelTable& kt = cpu::kernels();
    if (!a.any_order || !kt.dense_attn_rows || a.kv.type != KVType::f32 || a.kv.n_pages != 1 ||
        ((a.n_kv - 1) >> std::min(a.kv.page_shift, 62)) != 0 || a.window != 0 || a.softcap != 0.f || a.sinks ||
        a.head_dim % 16 != 0 || a.n_tok < 16 || a.n_kv < 1)
      return false;
    for (int64_t t = 0; t < a.n_tok; ++t)
      if (a.q_pos[t] < a.n_kv - 1) return false;
    return true;
  }

  // Every KV head's K packed once into transposed 64-key blocks (all threads), then tasks of
  // (query head, 48 rows) in head order, so a thread's heads keep their K tiles and V rows
  // in its cache.
  void attention_dense(const AttnArgs& a) {
    const cpu::KernelTable& kt = cpu::kernels();
    const int hd = a.head_dim, group = a.n_heads / a.n_kv_heads;
    const uint8_t* page = a.kv.base + (size_t)a.kv.pages[0] * a.kv.page_bytes;
    const float* K = reinterpret_cast<const float*>(page + a.kv.k_off);
    const float* V = reinterpret_cast<const float*>(page + a.kv.v_off);
    const int64_t kv_stride = (int64_t)(a.kv.row_bytes / 4);
    const int64_t nblocks = (a.n_kv + 63) / 64;  // the kernel's 64-key blocks
    const size_t head_floats = (size_t)nblocks * hd * 64;
    dense_kt_.resize(head_floats * (size_t)a.n_kv_heads);
    float* ktp = dense_kt_.data();
    pool_.parallel_for(a.n_kv_heads * nblocks, 2, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi;) {
        const int64_t h = i / nblocks, t0 = i % nblocks, t1 = std::min(nblocks, t0 + (hi - i));
        kt.dense_attn_pack_k(K + h * hd, kv_stride, a.n_kv, hd, t0, t1, ktp + (size_t)h * head_floats);
        i += t1 - t0;
      }
    });
    constexpr int64_t rb = 48;
    const int64_t nblk = (a.n_tok + rb - 1) / rb;
    pool_.parallel_for((int64_t)a.n_heads * nblk, 1, [&](int64_t lo, int64_t hi) {
      thread_local std::vector<float> scratch;
      for (int64_t task = lo; task < hi; ++task) {
        const int h = (int)(task / nblk);
        const int64_t t0 = task % nblk * rb;
        const int kvh = h / group;
        cpu::DenseAttn d;
        d.n_rows = std::min(rb, a.n_tok - t0);
        d.q = a.q + t0 * a.q_stride + (int64_t)h * hd;
        d.q_stride = a.q_stride;
        d.kt = ktp + (size_t)kvh * head_floats;
        d.v = V + (int64_t)kvh * hd;
        d.v_stride = kv_stride;
        d.n_kv = a.n_kv;
        d.head_dim = hd;
        d.scale = a.scale;
        d.out = a.out + t0 * a.out_stride + (int64_t)h * hd;
        d.out_stride = a.out_stride;
        scratch.resize(kt.dense_attn_scratch(d.n_rows, a.n_kv, hd));
        d.scratch = scratch.data();
        kt.dense_attn_rows(d);
      }
    });
  }

  // Tasks are (session, block of 32 query rows, KV head), all in one dispatch (32 rows: a
  // block transposes each K tile and converts each V row once for twice the rows of 16); with
  // fewer such tasks than 4 per thread (one session's decode step over a few KV heads)
  // a group's query heads are split over tasks, so the threads share the work evenly.
  // Every row's arithmetic is the same either way. f32 and f16 caches are read where
  // they lie; a q8_0 cache is decoded to f32 first: inside each task for a single
  // block of queries in a batch (each KV head's rows are read by one task), else once
  // per call for the whole layer by all threads.
  void attention_multi(const AttnArgs* args, int count) override {
    const cpu::KernelTable& kt = cpu::kernels();
    if (count == 1 && dense_ok(args[0])) return attention_dense(args[0]);
    constexpr int64_t rb = 32;
    int64_t blocks = 0, decode_tasks = 0;
    for (int i = 0; i < count; ++i) {
      blocks += ((args[i].n_tok + rb - 1) / rb) * args[i].n_kv_heads;
      if (args[i].n_tok <= rb) decode_tasks += args[i].n_kv_heads;
    }
    const bool split_heads = blocks < 4 * (int64_t)pool_.size();
    // Decoding inside the tasks saves a dispatch per session, but with fewer tasks
    // than twice the threads the threads would idle, so then the rows are decoded
    // by all threads first. Both give the same bits.
    const bool in_task = decode_tasks >= 2 * (int64_t)pool_.size();
    // Reused buffers (no allocation per layer); a nested call (q8_0 in a batch) keeps its own.
    std::vector<AttnCall> local_calls;
    std::vector<int64_t> local_first;
    const bool nested = attn_depth_++ > 0;
    struct Depth {
      int& d;
      ~Depth() { --d; }
    } depth{attn_depth_};
    std::vector<AttnCall>& calls = nested ? local_calls : attn_calls_;
    std::vector<int64_t>& first = nested ? local_first : attn_first_;
    std::vector<const uint8_t*> local_ptrs;
    std::vector<const uint8_t*>& ptrs = nested ? local_ptrs : attn_ptrs_;
    // A step of a few rows over keys spanning several chunks splits over the keys: each KV
    // head's rows are read once (by all its query heads together) and the threads share the
    // chunks evenly; the chunk partials combine as attn_block combines them itself.
    std::vector<float> local_part;
    std::vector<float>& part = nested ? local_part : attn_part_;
    size_t n_part = 0;
    calls.assign((size_t)count, AttnCall{});
    first.assign((size_t)count + 1, 0);
    // Page addresses from the block tables: base + id * page_bytes, for every call first
    // (the table may grow), then each call points into it.
    size_t n_ptrs = 0;
    for (int i = 0; i < count; ++i) n_ptrs += (size_t)args[i].kv.n_pages;
    ptrs.resize(n_ptrs);
    n_ptrs = 0;
    for (int i = 0; i < count; ++i) {
      const KVView& kv = args[i].kv;
      for (int64_t p = 0; p < kv.n_pages; ++p) ptrs[n_ptrs + (size_t)p] = kv.base + (size_t)kv.pages[p] * kv.page_bytes;
      n_ptrs += (size_t)kv.n_pages;
    }
    n_ptrs = 0;
    for (int i = 0; i < count; ++i) {
      const AttnArgs& a = args[i];
      AttnCall& c = calls[(size_t)i];
      const int64_t kv_dim = (int64_t)a.n_kv_heads * a.head_dim;
      c.kp = c.vp = ptrs.data() + n_ptrs;
      n_ptrs += (size_t)a.kv.n_pages;
      c.k_off = a.kv.k_off;
      c.v_off = a.kv.v_off;
      c.shift = a.kv.page_shift;
      c.f16 = a.kv.type == KVType::f16;
      c.kv_stride = (int64_t)(a.kv.row_bytes / (c.f16 ? 2 : 4));
      c.n_blocks = (a.n_tok + rb - 1) / rb;
      // Split by heads, a task takes hpt query heads of one KV head: the most that still gives
      // every thread a task with the shares within 1.25x of even (one thread: the whole group),
      // since a task reads and converts its K and V rows once for all its heads.
      c.hpt = 1;
      const int group = a.n_heads / a.n_kv_heads;
      const int64_t nth = pool_.size();
      for (int d = group; split_heads && d > 1; --d) {
        const int64_t tasks = c.n_blocks * a.n_kv_heads * (group / d);
        if (group % d == 0 && tasks >= nth && (tasks + nth - 1) / nth * nth * 4 <= tasks * 5) {
          c.hpt = d;
          break;
        }
      }
      c.per_block = split_heads ? a.n_heads / c.hpt : a.n_kv_heads;
      c.task_decode = a.kv.type == KVType::q8_0 && c.n_blocks == 1 && in_task;
      c.split_keys = false;
      if (a.n_tok <= 4 && a.kv.type != KVType::q8_0) {
        int32_t pmin = a.q_pos[0], pmax = a.q_pos[0];
        for (int64_t t = 1; t < a.n_tok; ++t) {
          pmin = std::min(pmin, a.q_pos[t]);
          pmax = std::max(pmax, a.q_pos[t]);
        }
        const int64_t j_hi = std::min<int64_t>(a.n_kv, (int64_t)pmax + 1);
        const int64_t j_lo = a.window > 0 ? std::max<int64_t>(0, (int64_t)pmin - a.window + 1) : 0;
        c.c_lo = j_lo / cpu::kAttnChunk;
        c.n_chunks = (j_hi + cpu::kAttnChunk - 1) / cpu::kAttnChunk - c.c_lo;
        if (c.n_chunks >= 2) {
          c.split_keys = true;
          c.per_block = (int64_t)a.n_kv_heads * c.n_chunks;
          c.part_off = n_part;
          n_part += (size_t)(a.n_tok * a.n_heads * c.n_chunks * (a.head_dim + 2));
        }
      }
      if (a.kv.type == KVType::q8_0 && !c.task_decode) {
        // Decode the layer's cache rows once into f32 (not once per query block). The
        // buffer serves one call at a time, so in a batch such a call runs alone first.
        if (count > 1) {
          attention_multi(&a, 1);
          c.n_blocks = 0;
          first[(size_t)i + 1] = first[(size_t)i];
          continue;
        }
        kv_f32_.resize((size_t)(2 * a.n_kv * kv_dim));
        float* kd = kv_f32_.data();
        float* vd = kd + a.n_kv * kv_dim;
        const int64_t mask = (int64_t(1) << c.shift) - 1;
        pool_.parallel_for(a.n_kv, 64, [&](int64_t lo, int64_t hi) {
          for (int64_t j = lo; j < hi; ++j) {
            const size_t r = (size_t)(j & mask) * a.kv.row_bytes;
            kt.dequant_row((uint32_t)GGMLType::Q8_0, c.kp[j >> c.shift] + c.k_off + r, kd + j * kv_dim, kv_dim);
            kt.dequant_row((uint32_t)GGMLType::Q8_0, c.vp[j >> c.shift] + c.v_off + r, vd + j * kv_dim, kv_dim);
          }
        });
        c.dec = (const uint8_t*)kd;
        c.kp = c.vp = &c.dec;
        c.k_off = 0;
        c.v_off = (size_t)(a.n_kv * kv_dim) * 4;
        c.shift = 62;
        c.kv_stride = kv_dim;
        c.f16 = false;
      }
      first[(size_t)i + 1] = first[(size_t)i] + c.n_blocks * c.per_block;
    }
    part.resize(n_part);
    // One prefill of several blocks over an f16 cache: each KV head's rows converted once (K to
    // transposed tiles, V to f32 rows) for all its blocks, not by every block for every chunk
    // (the same values, so the same bits; ~7% of a SmolLM2 pp4096 went to those conversions).
    int64_t kv32_lo = 0, kv32_hi = 0, kv32_kt = 0, kv32_head = 0;
    if (count == 1 && !nested && kt.attn_kv_f32 && calls[0].f16 && !calls[0].split_keys && !calls[0].task_decode &&
        calls[0].n_blocks >= 2 && args[0].head_dim % 16 == 0) {
      const AttnArgs& a = args[0];
      const AttnCall& c = calls[0];
      int32_t pmin = a.q_pos[0], pmax = a.q_pos[0];
      for (int64_t t = 1; t < a.n_tok; ++t) {
        pmin = std::min(pmin, a.q_pos[t]);
        pmax = std::max(pmax, a.q_pos[t]);
      }
      kv32_hi = std::min<int64_t>(a.n_kv, (int64_t)pmax + 1);
      kv32_lo = (a.window > 0 ? std::max<int64_t>(0, (int64_t)pmin - a.window + 1) : 0) / 16 * 16;
      const int64_t n_tiles = (kv32_hi - kv32_lo + 15) / 16, hd = a.head_dim;
      // Up to 64 MB (SmolLM2: 43k keys); past that the blocks convert their own rows.
      if (n_tiles > 0 && n_tiles * 16 * hd * 2 * a.n_kv_heads <= (int64_t(16) << 20)) {
        kv32_kt = n_tiles * 16 * hd;
        kv32_head = kv32_kt + (kv32_hi - kv32_lo) * hd;
        kv32_.resize((size_t)(kv32_head * a.n_kv_heads));
        constexpr int64_t tiles_per_item = 4;
        const int64_t items = (n_tiles + tiles_per_item - 1) / tiles_per_item;
        pool_.parallel_for(items * a.n_kv_heads, 1, [&](int64_t lo, int64_t hi) {
          for (int64_t it = lo; it < hi; ++it) {
            const int64_t h = it / items, t0 = it % items * tiles_per_item;
            cpu::AttnBlock b;
            b.k_pages = c.kp;
            b.v_pages = c.vp;
            b.k_off = c.k_off + (size_t)(h * hd) * 2;
            b.v_off = c.v_off + (size_t)(h * hd) * 2;
            b.page_shift = c.shift;
            b.kv_stride = c.kv_stride;
            b.n_kv = a.n_kv;
            b.head_dim = a.head_dim;
            b.kv32_lo = kv32_lo;
            float* kt32 = kv32_.data() + h * kv32_head;
            kt.attn_kv_f32(b, kv32_lo + t0 * 16, std::min(kv32_hi, kv32_lo + (t0 + tiles_per_item) * 16), kt32,
                           kt32 + kv32_kt);
          }
        });
      }
    }
    pool_.parallel_for(first[(size_t)count], 1, [&](int64_t lo, int64_t hi) {
      thread_local std::vector<float> scratch, dec;
      int i = 0;
      for (int64_t task = lo; task < hi; ++task) {
        while (task >= first[(size_t)i + 1]) ++i;
        const AttnArgs& a = args[i];
        const AttnCall& c = calls[(size_t)i];
        const int hd = a.head_dim;
        const int group = a.n_heads / a.n_kv_heads;
        const int64_t local = task - first[(size_t)i];
        const int64_t blk = local / c.per_block;
        // This task's query heads: the KV head's group, or one head of it.
        // Split over keys, tasks go chunk by chunk, every KV head of a chunk in turn: the heads'
        // slices interleave in each cache row, so one thread then streams whole rows (what the
        // hardware prefetcher fetches past a head's slice is the next head's, read next from
        // cache), not a head's slice of every row with the rest fetched and thrown away.
        const int h0 = c.split_keys ? (int)(local % c.per_block % a.n_kv_heads) * group
                       : split_heads ? (int)(local % c.per_block) * c.hpt : (int)(local % c.per_block) * group;
        const int kvh = h0 / group;
        cpu::AttnBlock b;
        const int64_t t0 = blk * rb;
        b.n_rows = std::min(rb, a.n_tok - t0);
        b.q = a.q + t0 * a.q_stride + (int64_t)h0 * hd;
        b.q_stride = a.q_stride;
        b.group = split_heads && !c.split_keys ? c.hpt : group;
        const uint8_t* dec_page[1];
        if (c.task_decode) {
          // This KV head's slice of every row, decoded to f32 rows of hd.
          dec.resize((size_t)(2 * a.n_kv * hd + 16));
          const size_t head_off = kv_row_bytes(a.kv.type, (int64_t)kvh * hd);
          const int64_t mask = (int64_t(1) << c.shift) - 1;
          float* kd = (float*)(((uintptr_t)dec.data() + 63) & ~(uintptr_t)63);  // whole cache lines
          float* vd = kd + a.n_kv * hd;
          for (int64_t j = 0; j < a.n_kv; ++j) {
            const size_t r = (size_t)(j & mask) * a.kv.row_bytes + head_off;
            kt.dequant_row((uint32_t)GGMLType::Q8_0, c.kp[j >> c.shift] + c.k_off + r, kd + j * hd, hd);
            kt.dequant_row((uint32_t)GGMLType::Q8_0, c.vp[j >> c.shift] + c.v_off + r, vd + j * hd, hd);
          }
          dec_page[0] = (const uint8_t*)kd;
          b.k_pages = b.v_pages = dec_page;
          b.k_off = 0;
          b.v_off = (size_t)(a.n_kv * hd) * 4;
          b.page_shift = 62;
          b.kv_stride = hd;
          b.kv_f16 = false;
        } else {
          const size_t esz = c.f16 ? 2 : 4;
          b.k_pages = c.kp;
          b.v_pages = c.vp;
          b.k_off = c.k_off + (size_t)kvh * hd * esz;
          b.v_off = c.v_off + (size_t)kvh * hd * esz;
          b.page_shift = c.shift;
          b.kv_stride = c.kv_stride;
          b.kv_f16 = c.f16;
        }
        b.pos = a.q_pos + t0;
        b.n_kv = a.n_kv;
        b.head_dim = hd;
        b.window = a.window;
        b.scale = a.scale;
        b.softcap = a.softcap;
        b.sinks = a.sinks ? a.sinks + h0 : nullptr;
        b.out = a.out + t0 * a.out_stride + (int64_t)h0 * hd;
        b.out_stride = a.out_stride;
        if (c.split_keys) {  // this KV head's rows, one chunk: [kv head][row][chunk] partials
          const int64_t ch = local % c.per_block / a.n_kv_heads;
          b.part = part.data() + c.part_off + (size_t)(((int64_t)(h0 / group) * a.n_tok * group * c.n_chunks + ch) *
                                                       (hd + 2));
          b.part_stride = c.n_chunks * (hd + 2);
          b.c_lo = c.c_lo + ch;
          b.c_hi = b.c_lo + 1;
        }
        if (kv32_head > 0) {
          b.kt32 = kv32_.data() + kvh * kv32_head;
          b.v32 = b.kt32 + kv32_kt;
          b.kv32_lo = kv32_lo;
          b.kv32_hi = kv32_hi;
        }
        scratch.resize(kt.attn_block_scratch(b.n_rows, b.group, hd, c.split_keys ? 0 : a.n_kv));
        b.scratch = scratch.data();
        kt.attn_block(b);
      }
    });
    if (n_part == 0) return;
    // Each row of a call split over keys: its chunks combined, in order.
    for (int i = 0; i < count; ++i) {
      const AttnArgs& a = args[i];
      const AttnCall& c = calls[(size_t)i];
      if (!c.split_keys) continue;
      const int group = a.n_heads / a.n_kv_heads, hd = a.head_dim;
      const int64_t rows = a.n_tok * a.n_heads;
      pool_.parallel_for(rows, 4, [&](int64_t lo, int64_t hi) {
        for (int64_t q = lo; q < hi; ++q) {  // q = (kv head, token, head of the group)
          const int64_t kvh = q / (a.n_tok * group), t = (q / group) % a.n_tok;
          const int h = (int)(kvh * group + q % group);
          kt.attn_combine(part.data() + c.part_off + (size_t)(q * c.n_chunks * (hd + 2)), c.n_chunks, hd,
                          a.sinks ? a.sinks + h : nullptr, a.out + t * a.out_stride + (int64_t)h * hd);
        }
      });
    }
  }

  void glu(const float* gate, int64_t gs, const float* up, int64_t us, float* out, int64_t n_rows, int64_t dim,
           Act act) override {
    const cpu::KernelTable& kt = cpu::kernels();
    const int a = act == Act::silu ? 0 : act == Act::gelu_tanh ? 1 : act == Act::swiglu_oai ? 2 : act == Act::sigmoid ? 3 : 4;
    auto rows = [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) kt.glu_f32(gate + r * gs, up + r * us, out + r * dim, dim, a);
    };
    if (n_rows * dim <= 16384)
      rows(0, n_rows);  // a decode step's few rows: cheaper here than a dispatch
    else
      pool_.parallel_for(n_rows, 4, rows);
  }

  // Elementwise: large calls (an encoder's 1500 rows) are shared by the threads, small ones
  // (a decode step's) stay on the caller, cheaper than a dispatch.
  void add(float* y, const float* x, int64_t n) override {
    auto part = [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) y[i] += x[i];
    };
    if (n <= 65536)
      part(0, n);
    else
      pool_.parallel_for(n, 16384, part);
  }
  void add_bias(float* y, const float* b, int64_t n_rows, int64_t dim) override {
    auto rows = [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r)
        for (int64_t i = 0; i < dim; ++i) y[r * dim + i] += b[i];
    };
    if (n_rows * dim <= 65536)
      rows(0, n_rows);
    else
      pool_.parallel_for(n_rows, std::max<int64_t>(1, 16384 / dim), rows);
  }
  void scale(float* y, float s, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] *= s;
  }
  void softcap(float* y, float cap, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) y[i] = cap * std::tanh(y[i] / cap);
  }
  void layer_norm(const float* x, const float* w, const float* b, float* y, int64_t n_rows, int64_t dim,
                  float eps) override {
    const cpu::KernelTable& kt = cpu::kernels();
    pool_.parallel_for(n_rows, 8, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) kt.layer_norm_row(x + r * dim, w, b, y + r * dim, dim, eps);
    });
  }
  void gelu_erf(float* y, int64_t n) override {
    pool_.parallel_for(n, 4096, [&](int64_t lo, int64_t hi) {
      cpu::kernels().gelu_erf_f32(y + lo, hi - lo);
    });
  }

  void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                 int64_t width) override {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * dst_stride, src + r * src_stride, (size_t)width * 4);
  }
  void im2col_1d(const float* x, int64_t x_stride, int64_t C, int64_t T, int k, int stride, int pad, float* out,
                 int64_t T_out) override {
    pool_.parallel_for(C, 8, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const float* xc = x + c * x_stride;
        for (int64_t t = 0; t < T_out; ++t)
          for (int j = 0; j < k; ++j) {
            const int64_t src = t * stride + j - pad;
            out[t * C * k + c * k + j] = src >= 0 && src < T ? xc[src] : 0.f;
          }
      }
    });
  }
  void im2col_rows(const float* x, int64_t C, int64_t T, int k, int stride, int pad, float* out,
                   int64_t T_out) override {
    pool_.parallel_for(T_out, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        for (int j = 0; j < k; ++j) {
          const int64_t src = t * stride + j - pad;
          float* o = out + t * C * k + j;
          if (src < 0 || src >= T) {
            for (int64_t c = 0; c < C; ++c) o[c * k] = 0.f;
          } else {
            const float* xr = x + src * C;
            for (int64_t c = 0; c < C; ++c) o[c * k] = xr[c];
          }
        }
    });
  }
  void im2col_2d(const float* x, int64_t C, int64_t H, int64_t W, int64_t sc, int64_t sh, int64_t sw, int kh, int kw,
                 int stride, int pad, float* out, int64_t H_out, int64_t W_out) override {
    const int64_t width = C * kh * kw;
    pool_.parallel_for(H_out * W_out, 4, [&](int64_t lo, int64_t hi) {
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t h0 = p / W_out * stride - pad, w0 = p % W_out * stride - pad;
        float* o = out + p * width;
        for (int64_t c = 0; c < C; ++c)
          for (int i = 0; i < kh; ++i)
            for (int j = 0; j < kw; ++j) {
              const int64_t h = h0 + i, w = w0 + j;
              *o++ = h >= 0 && h < H && w >= 0 && w < W ? x[c * sc + h * sh + w * sw] : 0.f;
            }
      }
    });
  }
  void avg_pool_rows(const float* x, int64_t n_rows, int64_t dim, int k, float* out) override {
    const int64_t n_out = (n_rows + k - 1) / k;
    for (int64_t r = 0; r < n_out; ++r) {
      const int64_t r0 = r * k, cnt = std::min<int64_t>(k, n_rows - r0);
      float* o = out + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        float acc = 0.f;
        for (int64_t j = 0; j < cnt; ++j) acc += x[(r0 + j) * dim + i];
        o[i] = acc / (float)cnt;
      }
    }
  }

  void conv1d_causal(float* state, const float* x, int64_t x_stride, int64_t n, int64_t C, const float* w, int k,
                     bool silu, float* y) override {
    if (n <= 0 || C <= 0) return;
    if (k < 1 || k > 65) throw Error("conv1d_causal: k must be in [1, 65]");
    const int64_t S = k - 1;
    // Channels are independent: each worker runs its channels over the whole sequence.
    pool_.parallel_for(C, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        const float* wc = w + c * k;
        auto u = [&](int64_t i) { return i < S ? state[i * C + c] : x[(i - S) * x_stride + c]; };
        for (int64_t t = 0; t < n; ++t) {
          float acc = 0.f;
          for (int j = 0; j < k; ++j) acc += wc[j] * u(t + j);
          y[t * C + c] = silu ? acc / (1.f + std::exp(-acc)) : acc;
        }
        // The last k-1 rows of u, read before any is overwritten (oldest first).
        float keep[64];
        for (int64_t i = 0; i < S; ++i) keep[i] = u(n + i);
        for (int64_t i = 0; i < S; ++i) state[i * C + c] = keep[i];
      }
    });
  }

  void delta_rule(const DeltaRuleArgs& a) override {
    if (a.n <= 0) return;
    if (a.n_k_heads <= 0 || a.n_v_heads % a.n_k_heads != 0 || a.dk <= 0 || a.dv <= 0)
      throw Error("delta_rule: bad head layout");
    if (a.chunked) {  // heads are independent: a head's chunks run in order on one thread
      pool_.parallel_for(a.n_v_heads, 1, [&](int64_t lo, int64_t hi) {
        thread_local cpu::DeltaScratch sc;  // the pool's threads live as long as the backend's
        for (int64_t h = lo; h < hi; ++h) cpu::kernels().delta_chunked_head(a, h, sc);
      });
      return;
    }
    const int64_t dk = a.dk, dv = a.dv;
    pool_.parallel_for(a.n_v_heads, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> q((size_t)dk), k((size_t)dk), kv((size_t)dv);
      for (int64_t h = lo; h < hi; ++h) {
        const int64_t kh = a.grouped ? h / (a.n_v_heads / a.n_k_heads) : h % a.n_k_heads;
        float* S = a.state + h * dk * dv;
        for (int64_t t = 0; t < a.n; ++t) {
          const float* qt = a.q + t * a.qkv_stride + kh * dk;
          const float* kt = a.k + t * a.qkv_stride + kh * dk;
          const float* vt = a.v + t * a.qkv_stride + h * dv;
          double sq = 0, sk = 0;
          for (int64_t i = 0; i < dk; ++i) sq += (double)qt[i] * qt[i], sk += (double)kt[i] * kt[i];
          const float iq = (float)(1.0 / std::sqrt(sq + a.l2_eps) / std::sqrt((double)dk));
          const float ik = (float)(1.0 / std::sqrt(sk + a.l2_eps));
          for (int64_t i = 0; i < dk; ++i) q[i] = qt[i] * iq, k[i] = kt[i] * ik;
          const float x = a.alpha[t * a.ab_stride + h] + a.dt_bias[h];
          const float sp = x > 20.f ? x : std::log1p(std::exp(x));  // softplus (torch's threshold)
          const float decay = std::exp(a.A[h] * sp);
          const float b = 1.f / (1.f + std::exp(-a.beta[t * a.ab_stride + h]));
          std::fill(kv.begin(), kv.end(), 0.f);
          for (int64_t i = 0; i < dk; ++i) {
            float* Si = S + i * dv;
            for (int64_t j = 0; j < dv; ++j) {
              Si[j] *= decay;
              kv[j] += Si[j] * k[i];
            }
          }
          for (int64_t j = 0; j < dv; ++j) kv[j] = (vt[j] - kv[j]) * b;  // the delta
          float* o = a.out + t * a.out_stride + h * dv;
          for (int64_t j = 0; j < dv; ++j) o[j] = 0.f;
          for (int64_t i = 0; i < dk; ++i) {
            float* Si = S + i * dv;
            for (int64_t j = 0; j < dv; ++j) {
              Si[j] += k[i] * kv[j];
              o[j] += Si[j] * q[i];
            }
          }
        }
      }
    });
  }

  void argmax(const float* x, int64_t n_rows, int64_t dim, int32_t* out) override {
    if (dim <= 0 || dim > INT32_MAX) throw Error("argmax: row width must be in [1, 2^31)");
    for (int64_t r = 0; r < n_rows; ++r) out[r] = argmax_first(x + r * dim, (int32_t)dim);
  }

  void moe_route(const float* logits, int64_t n, int n_expert, int k, MoeGate gate, bool norm, int32_t* ids,
                 float* w) override {
    if (k < 1 || k > n_expert) throw Error("moe_route: k must be in [1, n_expert]");
    for (int64_t t = 0; t < n; ++t) moe_route_row(logits + t * n_expert, n_expert, k, gate, norm, ids + t * k, w + t * k);
  }

  // Tokens grouped by expert: each expert's gathered rows go through the dense kernel over
  // that expert's slice of the stack (its packed slice when packed), so an expert's weights
  // are read once per call; every (expert, row chunk) is a task of one dispatch.
  void matmul_id(const Weight& w, const float* x, int64_t x_div, const int32_t* ids, int64_t n_pairs,
                 const float* bias, float* y) override {
    const cpu::KernelTable& kt = cpu::kernels();
    const int64_t R = w.expert_rows, K = w.cols;
    if (R <= 0 || w.rows % R != 0) throw Error("matmul_id: the weight is not a stack of experts");
    if (x_div < 1) throw Error("matmul_id: x_div must be >= 1");
    const int64_t E = w.rows / R;
    const uint32_t at = kt.act_type(w.type);
    const TypeTraits* tt = type_traits(w.type);
    if (at == UINT32_MAX) throw UnsupportedModelError(std::string("no matmul kernel for weight type ") + (tt ? tt->name : "?"));
    if (n_pairs <= 0) return;
    // Counting sort of the pairs by expert.
    std::vector<int64_t>& start = moe_start_;
    std::vector<int64_t>& order = moe_order_;
    start.assign((size_t)E + 1, 0);
    for (int64_t p = 0; p < n_pairs; ++p) {
      if (ids[p] < 0 || ids[p] >= E) throw Error("matmul_id: expert id " + std::to_string(ids[p]) + " out of range");
      ++start[(size_t)ids[p] + 1];
    }
    for (int64_t e = 0; e < E; ++e) start[(size_t)e + 1] += start[(size_t)e];
    order.resize((size_t)n_pairs);
    {
      std::vector<int64_t> fill(start.begin(), start.end() - 1);
      for (int64_t p = 0; p < n_pairs; ++p) order[(size_t)fill[(size_t)ids[p]]++] = p;
    }
    const int64_t arb = (int64_t)cpu::act_row_bytes(at, K);
    act_.resize((size_t)(arb * n_pairs));
    uint8_t* act = act_.data();
    auto quant = [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) kt.quantize_act(at, x + (order[(size_t)i] / x_div) * K, act + i * arb, K);
    };
    if (n_pairs * K <= 16384)
      quant(0, n_pairs);
    else
      pool_.parallel_for(n_pairs, 1, quant);
    moe_y_.resize((size_t)(n_pairs * R));
    float* yb = moe_y_.data();
    const int64_t min_chunk = n_pairs <= 8 ? 4 * cpu::kPackRowAlign : cpu::kPackRowAlign;
    const bool packed = w.packed != nullptr && w.packed_for == (int)kt.isa;
    std::vector<cpu::MatmulArgs>& args = moe_args_;
    std::vector<int64_t>& first = moe_first_;  // task index of each used expert's first chunk
    args.clear();
    first.assign(1, 0);
    int64_t active_rows = 0;
    for (int64_t e = 0; e < E; ++e) active_rows += start[(size_t)e + 1] > start[(size_t)e] ? R : 0;
    const int64_t chunk =
        std::min<int64_t>(4 * min_chunk, std::max<int64_t>(min_chunk, active_rows / (16 * pool_.size()) / min_chunk * min_chunk));
    for (int64_t e = 0; e < E; ++e) {
      const int64_t cnt = start[(size_t)e + 1] - start[(size_t)e];
      if (cnt == 0) continue;
      cpu::MatmulArgs a;
      a.wtype = w.type;
      a.k = K;
      a.w = w.data + (size_t)(e * R) * w.row_bytes;
      a.w_row_bytes = w.row_bytes;
      a.act = act + start[(size_t)e] * arb;
      a.act_row_bytes = (size_t)arb;
      a.n_tok = cnt;
      a.y = yb + start[(size_t)e] * R;
      a.y_stride = R;
      a.rows = R;
      a.wpack = packed ? w.packed + kt.pack_bytes(w.type, e * R, K) : nullptr;
      args.push_back(a);
      first.push_back(first.back() + (R + chunk - 1) / chunk);
    }
    const int n_args = (int)args.size();
    pool_.parallel_for(first.back(), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t c = lo; c < hi; ++c) {
        int i = 0;
        while (c >= first[(size_t)i + 1]) ++i;
        const int64_t r0 = (c - first[(size_t)i]) * chunk;
        kt.matmul_rows(args[(size_t)i], r0, std::min(R, r0 + chunk));
      }
    });
    (void)n_args;
    for (int64_t i = 0; i < n_pairs; ++i) {
      const int64_t p = order[(size_t)i];
      const float* src = yb + i * R;
      float* dst = y + p * R;
      if (bias) {
        const float* b = bias + (int64_t)ids[p] * R;
        for (int64_t r = 0; r < R; ++r) dst[r] = src[r] + b[r];
      } else {
        std::memcpy(dst, src, (size_t)R * 4);
      }
    }
  }

  void moe_sum(const float* y, const float* w, int64_t n, int k, int64_t dim, float* out) override {
    for (int64_t t = 0; t < n; ++t) {
      float* o = out + t * dim;
      for (int64_t d = 0; d < dim; ++d) {
        float acc = 0.f;
        for (int j = 0; j < k; ++j) acc += w[t * k + j] * y[(t * k + j) * dim + d];
        o[d] = acc;
      }
    }
  }

 private:
  // cos/sin per (token, pair) for one set of positions and parameters. Q and K of a
  // layer, and every layer with the same base, reuse it (two slots: Gemma alternates
  // local and global bases), so a step computes its sines once, not once per call.
  struct RopeTable {
    std::vector<int32_t> pos;
    float base = 0, freq_scale = 0, mscale = 0;
    int n_rot = 0;
    const float* freq_factors = nullptr;
    const double* inv_freq = nullptr;
    std::vector<float> cs, sn;
    bool valid = false;
  };
  const RopeTable& rope_table(int64_t n_tok, const int32_t* pos, const RopeParams& p) {
    auto same = [&](const RopeTable& t) {
      return t.valid && t.base == p.base && t.freq_scale == p.freq_scale && t.mscale == p.mscale &&
             t.n_rot == p.n_rot && t.freq_factors == p.freq_factors && t.inv_freq == p.inv_freq &&
             (int64_t)t.pos.size() == n_tok && std::equal(t.pos.begin(), t.pos.end(), pos);
    };
    for (RopeTable& t : rope_) if (same(t)) return t;
    std::swap(rope_[0], rope_[1]);  // the older slot is refilled
    RopeTable& t = rope_[0];
    const int half = p.n_rot / 2;
    t.pos.assign(pos, pos + n_tok);
    t.base = p.base;
    t.freq_scale = p.freq_scale;
    t.mscale = p.mscale;
    t.n_rot = p.n_rot;
    t.freq_factors = p.freq_factors;
    t.inv_freq = p.inv_freq;
    t.cs.resize((size_t)(n_tok * half));
    t.sn.resize((size_t)(n_tok * half));
    inv_freq_.resize((size_t)half);
    for (int i = 0; i < half; ++i) {
      inv_freq_[i] = p.inv_freq ? p.inv_freq[i] : std::pow((double)p.base, -2.0 * i / p.n_rot);
      if (p.freq_factors) inv_freq_[i] /= p.freq_factors[i];
    }
    for (int64_t k = 0; k < n_tok; ++k) {
      const double ppos = (double)pos[k] * p.freq_scale;
      for (int i = 0; i < half; ++i) {
        const double theta = ppos * inv_freq_[i];
        t.cs[k * half + i] = (float)std::cos(theta) * p.mscale;
        t.sn[k * half + i] = (float)std::sin(theta) * p.mscale;
      }
    }
    t.valid = true;
    return t;
  }

  // Packed weights are carved from arenas of 2 MiB pages where the kernel allows it:
  // decode streams every weight once per token, and on 4 KiB pages a model's small
  // matrices cost a TLB miss every 4 KiB. A weight's owner shares its arena. A matrix of a
  // quarter arena or more gets a block of its own size (the open arena stays open for the
  // small ones), and an arena left for a new one gives back the pages past its last weight:
  // otherwise the huge page it ends in, or a tail, stays resident unused.
  std::shared_ptr<void> pack_alloc(size_t n) {
    n = (n + 63) / 64 * 64;
    if (n >= kArena / 4 && !(arena_ && arena_used_ + n <= arena_size_)) return huge_block(n);
    if (!arena_ || arena_used_ + n > arena_size_) {
      release_arena_tail();
      arena_size_ = kArena;
      arena_ = huge_block(arena_size_);
      arena_used_ = 0;
    }
    void* p = static_cast<uint8_t*>(arena_.get()) + arena_used_;
    arena_used_ += n;
    return std::shared_ptr<void>(arena_, p);
  }

  // n bytes (rounded up to whole pages) aligned to a huge page, with huge pages advised.
  static std::shared_ptr<void> huge_block(size_t n) {
#if defined(__linux__)
    static const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    const size_t len = (n + pg - 1) / pg * pg;
    // Over-map by a huge page, then unmap the unaligned head and the tail: the block ends
    // where its data does, so no huge page reaches past it.
    void* raw = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const uintptr_t b = (uintptr_t)raw, a = (b + kHugePage - 1) & ~(uintptr_t)(kHugePage - 1);
    if (a > b) munmap(raw, a - b);
    if (b + len + kHugePage > a + len) munmap((void*)(a + len), b + len + kHugePage - (a + len));
#if defined(MADV_HUGEPAGE)
    madvise((void*)a, len, MADV_HUGEPAGE);  // advice only: failure leaves small pages
#endif
    return std::shared_ptr<void>((void*)a, [len](void* p) { munmap(p, len); });
#else
    const size_t len = (n + kHugePage - 1) / kHugePage * kHugePage;
    void* a = std::aligned_alloc(kHugePage, len);
    if (!a) throw std::bad_alloc();
    return std::shared_ptr<void>(a, std::free);
#endif
  }

  void release_arena_tail() {
#if defined(__linux__)
    if (!arena_) return;
    static const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t)arena_.get() + arena_used_ + pg - 1) & ~(pg - 1);
    const uintptr_t hi = (uintptr_t)arena_.get() + arena_size_;
    if (hi > lo) madvise((void*)lo, hi - lo, MADV_DONTNEED);
#endif
  }

  struct AttnCall {
    const uint8_t* const* kp;
    const uint8_t* const* vp;
    const uint8_t* dec;
    size_t k_off, v_off;
    int shift;
    int64_t kv_stride, n_blocks, per_block;
    int hpt;  // query heads per task when split by heads
    bool f16, task_decode;  // task_decode: decode this task's KV head rows inside the task
    // Split over keys (a decode step over many keys): tasks are (KV head, key chunk), their
    // partials at part_off in attn_part_, n_chunks from chunk c_lo.
    bool split_keys;
    int64_t c_lo, n_chunks;
    size_t part_off;
  };
  std::vector<float> attn_part_;
  std::vector<AttnCall> attn_calls_;
  std::vector<const uint8_t*> attn_ptrs_;
  std::vector<int64_t> attn_first_;
  int attn_depth_ = 0;

  ThreadPool pool_;
  std::shared_ptr<void> arena_;
  size_t arena_size_ = 0, arena_used_ = 0;
  RopeTable rope_[2];
  std::vector<double> inv_freq_;
  std::vector<uint8_t> act_;
  std::vector<int64_t> moe_start_, moe_order_, moe_first_;
  std::vector<cpu::MatmulArgs> moe_args_;
  std::vector<float> moe_y_;
  std::vector<float> kv_f32_;
  std::vector<float> kv32_;  // a prefill's f16 K and V rows converted once (attention_multi)
  std::vector<float> dense_kt_;  // attention_dense's packed K tiles, every KV head
};

}  // namespace

size_t host_memory_available() {
  size_t avail = 0;
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kb = 0;
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
        avail = (size_t)kb * 1024;
        break;
      }
    std::fclose(f);
  }
  // A container's limit (cgroup v2, then v1) binds before the machine's memory does.
  bool ok_max = false, ok_cur = false;
  uint64_t lim = read_u64_file("/sys/fs/cgroup/memory.max", &ok_max);
  uint64_t cur = read_u64_file("/sys/fs/cgroup/memory.current", &ok_cur);
  if (!ok_max) {
    lim = read_u64_file("/sys/fs/cgroup/memory/memory.limit_in_bytes", &ok_max);
    cur = read_u64_file("/sys/fs/cgroup/memory/memory.usage_in_bytes", &ok_cur);
    if (lim >= (uint64_t(1) << 60)) ok_max = false;  // v1's "unlimited"
  }
  if (ok_max && ok_cur) {
    // Usage counts the page cache; its inactive part is reclaimed before anyone is killed.
    if (std::FILE* f = std::fopen("/sys/fs/cgroup/memory.stat", "r")) {
      char line[256];
      unsigned long long v = 0;
      while (std::fgets(line, sizeof line, f))
        if (std::sscanf(line, "inactive_file %llu", &v) == 1) {
          cur = cur > v ? cur - v : 0;
          break;
        }
      std::fclose(f);
    }
    const size_t room = lim > cur ? (size_t)(lim - cur) : 0;
    avail = avail == 0 ? room : std::min(avail, room);
  }
  return avail;
}

std::shared_ptr<Backend> make_cpu_backend(int n_threads) { return std::make_shared<CpuBackend>(n_threads); }

}  // namespace dl
