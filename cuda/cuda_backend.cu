// The CUDA backend: device memory, the stream, the weight policy and the op dispatch
// onto the kernels of matmul.cu, attention.cu and ops.cu.
#include "cuda_backend.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.cuh"
#include "core/errors.h"
#include "dequant.cuh"
#include "kernels.h"
#include "mega.h"
#include "quant/quant.h"
#include "quant/types.h"
#include "rope.cuh"

namespace dl {
namespace {

using cuda::check;

std::string mib(size_t b) {
  char s[64];
  std::snprintf(s, sizeof s, "%zu bytes (%.1f MiB)", b, b / 1048576.0);
  return s;
}

std::string version_str(int v) { return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10); }

// Why cudaGetDeviceCount failed, in words a user can act on.
std::string no_device_reason(cudaError_t e) {
  int drv = 0, rt = 0;
  cudaDriverGetVersion(&drv);
  cudaRuntimeGetVersion(&rt);
  if (e == cudaErrorInsufficientDriver && drv == 0) return "no NVIDIA driver found (libcuda.so is not installed)";
  if (e == cudaErrorInsufficientDriver)
    return "the NVIDIA driver supports CUDA " + version_str(drv) + ", older than the runtime " + version_str(rt) +
           " this build needs: update the driver";
  if (e == cudaErrorNoDevice) return "no CUDA device found";
  return std::string("no usable CUDA device: ") + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

void free_on(void* p, int dev) {
  int cur = -1;
  cudaGetDevice(&cur);
  if (cur != dev) cudaSetDevice(dev);
  cudaFree(p);  // errors here (a driver shut down at exit) cannot be reported from a destructor
  if (cur != dev && cur >= 0) cudaSetDevice(cur);
}

// While any backend records a step, ops already recorded may name a buffer the caller
// drops (scratch growth): its free waits until the step's work has been issued.
std::atomic<int> g_recording{0};
std::mutex g_deferred_mu;
std::vector<std::pair<void*, int>> g_deferred;

void free_deferred() {
  std::vector<std::pair<void*, int>> d;
  {
    std::lock_guard<std::mutex> lk(g_deferred_mu);
    if (g_recording.load() > 0) return;
    d.swap(g_deferred);
  }
  for (auto& [p, dev] : d) free_on(p, dev);  // cudaFree waits for the device
}

// Device memory freed on the owning device when the last owner lets go.
class CudaBuffer final : public Buffer {
 public:
  CudaBuffer(void* p, size_t n, int dev) : dev_(dev) { ptr_ = p, size_ = n; }
  ~CudaBuffer() override {
    if (!ptr_) return;
    if (g_recording.load() > 0) {
      std::lock_guard<std::mutex> lk(g_deferred_mu);
      g_deferred.emplace_back(ptr_, dev_);
      return;
    }
    free_on(ptr_, dev_);
  }

 private:
  int dev_;
};

// Steps go through CUDA graphs unless DASLLAMA_CUDA_GRAPHS=0.
bool graphs_enabled() {
  const char* e = std::getenv("DASLLAMA_CUDA_GRAPHS");
  return !(e && (std::strcmp(e, "0") == 0 || std::strcmp(e, "off") == 0));
}

// A batched step's sessions in one launch each for their attentions (bit 1) and their KV
// stores (bit 2), their arguments in the step's blob: DASLLAMA_CUDA_GROUP, default 3 (0: a
// launch per session, baked arguments, no graph). Grouped attention gave wrong outputs for every
// session after the first until the twelfth session (attention.cu's attn_k now reads the
// group's arguments on a path of their own); H200, Llama-1B Q8_0, B = 4 / 16 / 64: 1,570 /
// 2,257 / 2,503 t/s per-session, 2,231 / 3,902 / 4,898 grouped. A single session's store and
// attention always take the device-args path, which lets decode steps replay a graph.
int group_mask() {
  const char* e = std::getenv("DASLLAMA_CUDA_GROUP");
  return (e ? std::atoi(e) : 3) & 3;
}

// Exec graphs kept (least recently used replaced): decode, a few batch shapes.
constexpr size_t kMaxGraphs = 8;
// Steps whose matmuls take more rows than this are run directly: compute-bound, and
// their shapes rarely repeat, so a graph would not be reused.
constexpr int64_t kGraphMaxRows = 64;

// Memory left free below every allocation: the context's and cuBLAS-free kernels' own
// needs (launch buffers, printf, local memory) come from the same pool.
constexpr size_t kHeadroom = size_t(64) << 20;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int dev) : dev_(dev), graphs_(graphs_enabled()), group_(group_mask()) {
    check(cudaSetDevice(dev_), "cudaSetDevice");
    check(cudaGetDeviceProperties(&prop_, dev_), "cudaGetDeviceProperties");
    prop_.major = cuda::cc_cap(prop_.major);  // (DASLLAMA_CUDA_CC_MAJOR: the paths of an older GPU)
    check(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaBackend() override {
    hp_.report();
    cudaSetDevice(dev_);
    drop_recording();
    if (deferred_.on) deferred_ = Deferred(), --g_recording;
    cudaStreamSynchronize(st_);
    for (Cached& c : cache_) cudaGraphExecDestroy(c.exec);
    if (pinned_) cudaFreeHost(pinned_);
    if (up_ring_) {
      for (auto& ev : up_ev_) cudaEventDestroy(ev);
      for (auto& ev : dl_ev_) cudaEventDestroy(ev);
      cudaFreeHost(up_ring_);
    }
    if (cs_) cudaStreamSynchronize(cs_), cudaStreamDestroy(cs_);
    for (auto& ev : part_ev_)
      if (ev) cudaEventDestroy(ev);
    if (parts_done_) cudaEventDestroy(parts_done_);
    scratch_.reset();
    qact_.reset();
    alt_.reset();
    counters_.reset();
    argmax_.reset();
    bar_.reset();
    dblob_.reset();
    cudaStreamDestroy(st_);
  }

  const char* name() const override { return "cuda"; }

  DeviceInfo info() const override {
    DeviceInfo d;
    d.backend = "cuda";
    d.index = dev_;
    d.name = prop_.name;
    d.cc_major = prop_.major;
    d.cc_minor = prop_.minor;
    cudaSetDevice(dev_);
    size_t fr = 0, tot = 0;
    if (cudaMemGetInfo(&fr, &tot) == cudaSuccess) limited(fr, tot), d.free_bytes = fr, d.total_bytes = tot;
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    d.driver = "driver " + version_str(drv) + ", runtime " + version_str(rt);
    const std::string cb = cuda::cublas_name();
    if (!cb.empty()) d.features = "cublas " + cb;  // the f16 prefill may use it (DASLLAMA_CUDA_CUBLAS)
    return d;
  }

  // ---- memory ----
  BufferPtr alloc(size_t bytes, const char* what) override {
    use();
    if (bytes == 0) return std::make_shared<CudaBuffer>(nullptr, 0, dev_);
    check_fits(bytes, what);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error state of a failed cudaMalloc
      throw DeviceError(where() + ": cannot allocate " + mib(bytes) + " for " + what + ": " + cudaGetErrorString(e));
    }
    return std::make_shared<CudaBuffer>(p, bytes, dev_);
  }
  // DASLLAMA_CUDA_MEM_LIMIT=N: act as if the device had N bytes (read at each check; what is in use
  // counts against it): a GPU shared with other work, and the tests of a full device.
  static void limited(size_t& fr, size_t& tot) {
    const char* e = std::getenv("DASLLAMA_CUDA_MEM_LIMIT");
    const unsigned long long lim = e && *e ? std::strtoull(e, nullptr, 10) : 0;
    if (lim == 0 || lim >= tot) return;
    const size_t used = tot - fr;
    tot = (size_t)lim, fr = tot > used ? tot - used : 0;
  }
  void check_fits(size_t bytes, const char* what) override {
    use();
    size_t fr = 0, tot = 0;
    check(cudaMemGetInfo(&fr, &tot), "cudaMemGetInfo");
    limited(fr, tot);
    if (bytes + kHeadroom > fr)
      throw DeviceError(where() + ": out of device memory for " + what + ": needs " + mib(bytes) + ", " + mib(fr) +
                        " free of " + mib(tot) + " (" + mib(kHeadroom) + " kept back)");
  }
  // Pageable sources are staged by the driver before cudaMemcpyAsync returns, so the
  // caller may reuse them; a pinned (registered) source is copied asynchronously and
  // then waited for, to keep that promise.
  void upload(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use();
    drop_recording();
    if (staged_upload(dst, src, bytes)) return;
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, st_), "upload");
    cudaPointerAttributes at{};
    if (cudaPointerGetAttributes(&at, src) == cudaSuccess && at.type == cudaMemoryTypeHost)
      check(cudaStreamSynchronize(st_), "upload (pinned source)");
    else
      cudaGetLastError();
  }
  // Pinned, so a batched step's logits (B x vocab floats) come back in one DMA instead of
  // through the driver's pageable staging (DASLLAMA_CUDA_PINNED=0: plain memory, for A/B runs).
  float* host_staging(size_t floats) override {
    const char* e = std::getenv("DASLLAMA_CUDA_PINNED");
    if ((e && std::strcmp(e, "0") == 0) || pinned_refused_) return Backend::host_staging(floats);
    if (pinned_floats_ < floats) {
      use();
      if (pinned_) check(cudaStreamSynchronize(st_), "host staging"), cudaFreeHost(pinned_), pinned_ = nullptr;
      pinned_floats_ = 0;
      const size_t n = floats + floats / 2;
      if (cudaHostAlloc(reinterpret_cast<void**>(&pinned_), n * sizeof(float), cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();  // no pinned memory to be had: plain memory works, only slower
        pinned_ = nullptr;
        pinned_refused_ = true;  // and asking again at every step would cost a failed call each time
        return Backend::host_staging(floats);
      }
      pinned_floats_ = n;
    }
    return pinned_;
  }
  // Pinned blocks that outlive a step (a batch step's logits, which the sessions point into);
  // download() copies into them directly. Plain memory where pinned memory is refused.
  std::shared_ptr<float> host_block(size_t floats) override {
    const char* e = std::getenv("DASLLAMA_CUDA_PINNED");
    if (!(e && std::strcmp(e, "0") == 0) && !pinned_refused_) {
      use();
      float* p = nullptr;
      if (cudaHostAlloc(reinterpret_cast<void**>(&p), floats * sizeof(float), cudaHostAllocDefault) == cudaSuccess) {
        std::lock_guard<std::mutex> lk(blocks_mu_);
        blocks_.emplace_back(p, floats * sizeof(float));
        return std::shared_ptr<float>(p, [this](float* q) {
          {
            std::lock_guard<std::mutex> lk(blocks_mu_);
            for (size_t i = 0; i < blocks_.size(); ++i)
              if (blocks_[i].first == q) blocks_.erase(blocks_.begin() + (std::ptrdiff_t)i);
          }
          cudaFreeHost(q);
        });
      }
      cudaGetLastError();
    }
    return Backend::host_block(floats);
  }
  bool in_host_block(const void* p, size_t bytes) {
    std::lock_guard<std::mutex> lk(blocks_mu_);
    for (const auto& b : blocks_) {
      const auto* q = reinterpret_cast<const uint8_t*>(b.first);
      if (p >= q && static_cast<const uint8_t*>(p) + bytes <= q + b.second) return true;
    }
    return false;
  }
  void download(void* dst, const void* src, size_t bytes) override {
    use();
    drop_recording();
    // A large download into other host memory (a decode step's logits: 513 KB for a 128K
    // vocabulary) lands in the pinned staging buffer in one DMA and is copied from there,
    // not through the driver's chunked staging of pageable memory.
    float* stage =
        bytes >= (64 << 10) && dst != pinned_ && !in_host_block(dst, bytes) ? host_staging((bytes + 3) / 4) : nullptr;
    if (stage && stage == pinned_) {
      const auto t0 = HostProf::now();
      if (!copy_parts(stage, src, bytes))
        check(cudaMemcpyAsync(stage, src, bytes, cudaMemcpyDeviceToHost, st_), "download");
      check(cudaStreamSynchronize(st_), "download (a kernel before it failed)");
      const auto t1 = HostProf::now();
      std::memcpy(dst, stage, bytes);
      hp_.downloaded(t0, t1);
      return;
    }
    const auto t0 = HostProf::now();
    if (bytes && !copy_parts(dst, src, bytes))
      check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st_), "download");
    check(cudaStreamSynchronize(st_), "download (a kernel before it failed)");
    if (bytes >= (64 << 10)) hp_.downloaded(t0, HostProf::now());  // a batch step's logits, into a host block
  }
  bool async_steps() const override { return true; }
  // Through a ring of small pinned slots, each with the event of its last copy: the copy is
  // queued behind the running step and the host goes on.
  int64_t download_async(void* dst, const void* src, size_t bytes) override {
    use();
    drop_recording();
    if (bytes > kDlSlot || !rings() || parts_of(src, bytes)) {
      download(dst, src, bytes);
      return 0;
    }
    const int64_t t = ++dl_ticket_;
    const int k = (int)(t % kDlSlots);
    // The slot's last copy, kDlSlots tickets ago, is done before it is reused; its bytes go
    // nowhere (a caller waits for its ticket within a few, or never will).
    for (size_t i = 0; i < dl_pending_.size(); ++i)
      if (dl_pending_[i].slot == k) {
        check(cudaEventSynchronize(dl_ev_[k]), "download (a kernel before it failed)");
        dl_pending_.erase(dl_pending_.begin() + (std::ptrdiff_t)i);
        break;
      }
    char* h = dl_ring_ + (size_t)k * kDlSlot;
    check(cudaMemcpyAsync(h, src, bytes, cudaMemcpyDeviceToHost, st_), "download");
    check(cudaEventRecord(dl_ev_[k], st_), "download");
    dl_pending_.push_back({dst, bytes, k, t});
    return t;
  }
  void download_wait(int64_t ticket) override {
    for (size_t i = 0; i < dl_pending_.size(); ++i) {
      const DlPending p = dl_pending_[i];
      if (p.ticket != ticket) continue;
      dl_pending_.erase(dl_pending_.begin() + (std::ptrdiff_t)i);
      use();
      check(cudaEventSynchronize(dl_ev_[p.slot]), "download (a kernel before it failed)");
      std::memcpy(p.dst, dl_ring_ + (size_t)p.slot * kDlSlot, p.bytes);
      return;
    }
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use();
    op(
        Tag::copy, [=](cudaStream_t s) { check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s), "copy"); },
        dst, src, bytes);
  }
  void zero(void* dst, size_t bytes) override {
    if (bytes == 0) return;
    use();
    op(Tag::zero, [=](cudaStream_t s) { check(cudaMemsetAsync(dst, 0, bytes, s), "zero"); }, dst, bytes);
  }
  void sync() override {
    use();
    drop_recording();
    check(cudaStreamSynchronize(st_), "sync (a kernel before it failed)");
  }

  // ---- weights ----
  // The file's type wherever a kernel reads it (never less precision); others become
  // Q8_0 (F32 when the row is no whole number of 32-blocks).
  uint32_t weight_type(uint32_t type, int64_t cols, QuantMode) const override {
    if (cuda::matmul_type_ok(type)) return type;
    return cols % 32 == 0 ? (uint32_t)GGMLType::Q8_0 : (uint32_t)GGMLType::F32;
  }
  // matmul and get_rows read the same bytes: the file's, or for q8_0 / q4_0 this backend's
  // split layout (dequant.cuh), made on the host a slab of rows at a time.
  void load_weight(Weight& w, WeightUse) override {
    if (!w.host) throw Error("cuda load_weight: the weight has no host bytes");
    if (!cuda::matmul_type_ok(w.type))
      throw UnsupportedModelError("cuda: no kernel for weight type " + type_label(w.type));
    // Expert stacks keep the file's layout: matmul_id's kernels read that one.
    const size_t srb = split_ok() && w.expert_rows == 0 ? cuda::split_row_bytes(w.type, w.cols) : 0;
    const size_t rb = srb ? srb : w.row_bytes;
    BufferPtr b = alloc((size_t)w.rows * rb, "weight");
    use();
    if (!srb) {
      check(cudaMemcpyAsync(b->data(), w.host, (size_t)w.rows * rb, cudaMemcpyHostToDevice, st_), "load_weight");
    } else {
      const int64_t slab = std::max<int64_t>(1, (int64_t)(8u << 20) / (int64_t)rb);
      std::vector<uint8_t> tmp((size_t)(std::min(slab, w.rows) * (int64_t)rb), 0);
      for (int64_t r0 = 0; r0 < w.rows; r0 += slab) {
        const int64_t nr = std::min(slab, w.rows - r0);
        split_rows(w.type, w.host + (size_t)r0 * w.row_bytes, w.row_bytes, w.cols, nr, tmp.data());
        // On st_ and waited for, since tmp is refilled next. (Not cudaMemcpy: that runs on the
        // legacy stream, which st_ does not wait for, and from pageable memory it may return
        // before the bytes land, so kernels on st_ read the buffer before it is filled.)
        check(cudaMemcpyAsync(static_cast<uint8_t*>(b->data()) + (size_t)r0 * rb, tmp.data(), (size_t)nr * rb,
                              cudaMemcpyHostToDevice, st_),
              "load_weight");
        check(cudaStreamSynchronize(st_), "load_weight");
      }
      w.packed_for = kSplitLayout;
    }
    // The host bytes may be a mapping the loader drops next: wait for the copy.
    check(cudaStreamSynchronize(st_), "load_weight");
    w.data = static_cast<const uint8_t*>(b->data());
    w.resident = std::move(b);
  }
  bool supports(Op op, uint32_t type) const override {
    switch (op) {
      case Op::matmul:
      case Op::get_rows: return cuda::matmul_type_ok(type);
      case Op::attention:
      case Op::kv_store:
        return type == (uint32_t)KVType::f32 || type == (uint32_t)KVType::f16 || type == (uint32_t)KVType::q8_0;
    }
    return false;
  }

  // ---- steps ----
  // The ops between begin_step and end_step are recorded (a closure each, plus the
  // bytes of their arguments: the step's signature); end_step issues them as the
  // cached exec graph of an equal signature, or captures them into one, or (graphs
  // off, capture failed, a prefill-sized step) launches them directly. Per-session
  // values that change every decode step (n_kv, the store's first row, block tables)
  // travel in a small host blob copied to the device before the launch, so the graph
  // of step t+1 equals the one of step t.
  void begin_step() override {
    use();
    hp_.begin();
    drop_recording();  // a step abandoned by an exception
    drop_deferred();
    rec_ = true;
    ++g_recording;
  }
  void end_step() override {
    if (!rec_) return;
    HostProf::End timed(hp_);
    use();
    flush_kv();
    prepare_mega();
    std::vector<std::function<void(cudaStream_t)>> ops;
    ops.swap(ops_);
    const bool graphable = max_rows_ <= kGraphMaxRows && !no_graph_;
    stop_recording();
    issue(ops, graphable);
  }
  // ---- deferred steps (Backend::end_step_deferred) ----
  // The recording's ops, signature and blob, kept; g_recording stays counted until the step is
  // issued or dropped, so no buffer its ops name is freed meanwhile. (Any backend's drops wait
  // with it: a model that stops stepping with a step kept holds other models' frees until its
  // next step, its destruction or its next other call drops it.)
  // The logits' parts of a step (matmul_logits, below).
  static constexpr int kMaxParts = 8;
  struct LogitParts {
    const float* y = nullptr;
    int64_t n = 0, V = 0;
    int count = 0;  // 0: none
    int64_t first[kMaxParts + 1] = {};
  };
  struct Deferred {
    bool on = false, graphable = false;
    std::vector<std::function<void(cudaStream_t)>> ops;
    std::vector<uint8_t> sig, blob;
    LogitParts parts;
  } deferred_;
  bool defer_steps() const override { return true; }
  bool deferred_pending() const override { return deferred_.on; }
  bool end_step_deferred() override {
    if (!rec_) return false;
    use();
    drop_deferred();
    flush_kv();
    prepare_mega();
    Deferred& d = deferred_;
    d.ops.swap(ops_), d.sig.swap(sig_), d.blob.swap(blob_);
    d.parts = parts_rec_;
    d.graphable = max_rows_ <= kGraphMaxRows && !no_graph_;
    d.on = true;
    rec_ = false;  // (g_recording: see Deferred)
    ops_.clear(), kvq_.clear();
    clear_step();
    return true;
  }
  void launch_deferred() override {
    if (!deferred_.on) return;
    use();
    drop_recording();
    Deferred d;
    std::swap(d, deferred_);
    sig_.swap(d.sig), blob_.swap(d.blob);
    parts_rec_ = d.parts;
    --g_recording;
    issue(d.ops, d.graphable);
  }
  void drop_deferred() override {
    if (!deferred_.on) return;
    Deferred d;
    std::swap(d, deferred_);
    --g_recording;
    free_deferred();
  }
  // download() in two halves: the copy (into a host block: pinned) behind the stream's work,
  // and an event the second half waits on.
  cudaEvent_t dl_start_ev_ = nullptr;
  bool dl_started_ = false;
  std::chrono::steady_clock::time_point dl_t0_{};  // (HostProf::clock)
  void download_start(void* dst, const void* src, size_t bytes) override {
    use();
    drop_recording();
    if (dl_started_) download_finish();
    if (!bytes || !in_host_block(dst, bytes)) return download(dst, src, bytes);
    if (!dl_start_ev_) check(cudaEventCreateWithFlags(&dl_start_ev_, cudaEventDisableTiming), "cudaEventCreate");
    if (!copy_parts(dst, src, bytes)) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, st_), "download");
    check(cudaEventRecord(dl_start_ev_, st_), "download");
    dl_started_ = true;
    dl_t0_ = HostProf::now();
  }
  void download_finish() override {
    if (!dl_started_) return;
    dl_started_ = false;
    check(cudaEventSynchronize(dl_start_ev_), "download (a kernel before it failed)");
    hp_.downloaded(dl_t0_, HostProf::now());  // "wait": from the copy's issue (the speculated recording inside)
  }
  // ---- logits in parts (Backend::matmul_logits) ----
  // The head's rows in up to kMaxParts slices of the vocabulary, each slice's product an n x
  // (its rows) block of y at offset n * (its first row), each followed by an event; a download
  // of y copies each block into its columns of the host rows on a second stream once the
  // block's event fires, so the copy of one slice overlaps the product of the next.
  LogitParts parts_rec_;   // made by the step being recorded
  LogitParts parts_live_;  // made by the step last issued, not yet downloaded
  cudaEvent_t part_ev_[kMaxParts] = {}, parts_done_ = nullptr;
  cudaStream_t cs_ = nullptr;  // the parts' copies
  // Parts for n rows of a V-row head: DASLLAMA_CUDA_LOGIT_PARTS (read at each call; 0 or 1: one
  // product and one copy; default 4), from 2 rows (one row's 0.5 MB is not worth it). H100,
  // Llama-1B Q8_0 (ab_cuda.py, best of 2), B = 4 / 16 / 64 with 1 / 2 / 4 / 8 parts: 3,279 /
  // 9,696 / 18,337, 3,293 / 9,929 / 18,778, 3,285 / 10,035 / 19,073, 3,220 / 10,020 / 18,990. At 64
  // the head takes 0.22 ms and the copy 0.60 (profile_cuda.py, PDL off): the copy bounds it.
  static int logit_parts(int64_t n, int64_t V) {
    const char* e = std::getenv("DASLLAMA_CUDA_LOGIT_PARTS");
    const int p = e && *e ? std::atoi(e) : 4;
    if (p < 2 || n < 2 || V < 2 * 64) return 0;
    return std::min(p, kMaxParts);
  }
  bool matmul_logits(const Weight& w, const float* x, int64_t n, float* y, float cap) override {
    const int want = logit_parts(n, w.rows);
    if (want < 2) return false;
    use();
    if (!cs_) check(cudaStreamCreateWithFlags(&cs_, cudaStreamNonBlocking), "cudaStreamCreate");
    for (auto& ev : part_ev_)
      if (!ev) check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    if (!parts_done_) check(cudaEventCreateWithFlags(&parts_done_, cudaEventDisableTiming), "cudaEventCreate");
    const cuda::Mat m = mat(w);
    LogitParts lp;
    lp.y = y, lp.n = n, lp.V = w.rows;
    const int64_t per = (w.rows + want - 1) / want, step = (per + 63) / 64 * 64;  // whole 64-row tiles a slice
    for (int64_t r0 = 0; r0 < w.rows && lp.count < want; r0 += step) lp.first[lp.count++] = r0;
    lp.first[lp.count] = w.rows;
    for (int p = 0; p < lp.count; ++p) {
      Weight ws = w;
      ws.data = w.data + (size_t)lp.first[p] * m.row_bytes;
      ws.rows = lp.first[p + 1] - lp.first[p];
      float* yp = y + n * lp.first[p];
      reuse_q_ = p > 0;  // a q8 product's rounded x: the first slice's, the same x and n
      try {
        matmul(ws, x, n, yp);
      } catch (...) {
        reuse_q_ = false;
        throw;
      }
      reuse_q_ = false;
      if (cap > 0) softcap(yp, cap, n * ws.rows);
      const cudaEvent_t ev = part_ev_[p];
      // (in a capture, an external event node: the graph's launch records it where the node runs)
      op(Tag::mark, [ev](cudaStream_t st) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        check(cudaStreamIsCapturing(st, &cs), "logits part");
        check(cs == cudaStreamCaptureStatusActive ? cudaEventRecordWithFlags(ev, st, cudaEventRecordExternal)
                                                  : cudaEventRecord(ev, st),
              "logits part");
      }, ev);
    }
    (rec_ ? parts_rec_ : parts_live_) = lp;
    return true;
  }
  bool parts_of(const void* src, size_t bytes) const {
    const LogitParts& lp = parts_live_;
    return lp.count && src == lp.y && bytes == (size_t)(lp.n * lp.V) * sizeof(float);
  }
  // The live parts' copies into dst (n x V floats in host rows), st_ held behind them; false
  // where src is not the live parts' buffer.
  bool copy_parts(void* dst, const void* src, size_t bytes) {
    if (!parts_of(src, bytes)) {
      const LogitParts& lp = parts_live_;
      const auto* a = static_cast<const uint8_t*>(src);
      const auto* y = reinterpret_cast<const uint8_t*>(lp.y);
      if (lp.count && a < y + lp.n * lp.V * 4 && a + bytes > y)  // its bytes are in the parts' order
        throw Error("cuda: logits made in parts downloaded other than whole");
      return false;
    }
    LogitParts lp = parts_live_;
    parts_live_.count = 0;
    auto* d = static_cast<float*>(dst);
    for (int p = 0; p < lp.count; ++p) {
      const int64_t r0 = lp.first[p], w = lp.first[p + 1] - r0;
      check(cudaStreamWaitEvent(cs_, part_ev_[p], 0), "download");
      check(cudaMemcpy2DAsync(d + r0, (size_t)lp.V * 4, lp.y + lp.n * r0, (size_t)w * 4, (size_t)w * 4, (size_t)lp.n,
                              cudaMemcpyDeviceToHost, cs_),
            "download");
    }
    check(cudaEventRecord(parts_done_, cs_), "download");
    check(cudaStreamWaitEvent(st_, parts_done_, 0), "download");  // nothing after on st_ overwrites y first
    return true;
  }

  // Issues a recorded step's ops (sig_ and blob_ hold its signature and arguments).
  void issue(std::vector<std::function<void(cudaStream_t)>>& ops, bool graphable) {
    const auto tu = hp_.on ? HostProf::now() : HostProf::clock::time_point{};
    if (!blob_.empty()) {
      if (!dblob_ || dblob_->size() < blob_.size()) {
        dblob_.reset();
        dblob_ = alloc(blob_.size() * 2, "step arguments");
      }
      if (!staged_upload(dblob_->data(), blob_.data(), blob_.size()))
        check(cudaMemcpyAsync(dblob_->data(), blob_.data(), blob_.size(), cudaMemcpyHostToDevice, st_),
              "step arguments");
    }
    if (hp_.on) hp_.upload += HostProf::us(HostProf::now() - tu);
    const void* db = dblob_ ? dblob_->data() : nullptr;
    sig1(db);
    bool done = false;
    try {
      if (graphs_ && graphable && !ops.empty()) done = launch_graph(ops);
      if (!done)
        for (auto& f : ops) f(st_);
    } catch (...) {
      parts_live_ = LogitParts();
      clear_step();
      free_deferred();
      throw;
    }
    parts_live_ = parts_rec_;
    clear_step();
    free_deferred();
  }

  // ---- ops ----
  void matmul(const Weight& w, const float* x, int64_t n, float* y) override {
    MatmulStep s;
    s.x = x, s.n = n, s.count = 1, s.w[0] = &w, s.y[0] = y;
    if (n > 0 && staged(s)) return;
    use();
    const cuda::Mat m = mat(w);
    if (!cuda::matmul_type_ok(w.type))
      throw UnsupportedModelError("cuda: no matmul kernel for weight type " + type_label(w.type));
    max_rows_ = std::max(max_rows_, n);
    if (n >= std::min<int64_t>(65, f16_min(w, n)) && cuda::mma_f16h_fits(m, x, n)) {  // f16 prefill: x rounded to f16 (or split) first
      cuda::cublas_prepare();
      void* sc = split_for(cuda::mma_f16h_scratch(n, m.cols));
      const bool split = f16_act_split(w);
      op(Tag::matmul, [=](cudaStream_t s) { cuda::mma_f16h(m, x, n, y, sc, split, s); }, m.type, m.w, m.row_bytes,
         m.rows, m.cols, x, n, y, sc, split);
      return;
    }
    // q8 mode, block formats past 64 tokens (up to 64 the GEMV over 16 tokens at a time reads
    // fewer bytes than the decoding): decoded to f16, then the f16 prefill's tiles. The decoded
    // copy is kept for the next matmul (never shrunk), so matrices past kDqMax (a large vocabulary's
    // head, in a prefill that asks for every row's logits) keep the f32 tiles.
    // Where the device cannot hold the copy (a KV pool sized to fill it), the f32 tiles as before
    // the copy was the default: matrices from the size that failed keep them.
    constexpr size_t kDqMax = size_t(512) << 20;
    const size_t dq_bytes = (size_t)m.rows * m.cols * 2;
    const bool dq_ok = n >= dq_f16_min() && !w.exact && cuda::dequant_f16_type(m.type) && dq_f16_on() &&
                       m.cols % 8 == 0;
    // DASLLAMA_CUDA_DQF16_SLAB_KB=N (default 0, off; read at each call): with cuBLAS, a matrix
    // decoded N KiB of rows at a time into a scratch of that size, each slab's product written into
    // its rows of y, so a matrix of any size takes the path (a large vocabulary's head in a batched
    // step too) and the scratch stays small. H100, Q4_K_M batched step of 64: 12,212 t/s with 64
    // MiB slabs against 12,279 whole, so it stays off.
    const char* sk = std::getenv("DASLLAMA_CUDA_DQF16_SLAB_KB");
    const int64_t slab_kb = sk && *sk ? std::min<int64_t>(std::atoll(sk), int64_t(1) << 40) : 0;  // (no overflow below)
    const bool slabs = dq_ok && slab_kb > 0 && !f16_act_split(w) && cuda::cublas_prepare();
    const int64_t slab_rows = slabs ? std::min(m.rows, std::max<int64_t>(1, slab_kb * 1024 / (m.cols * 2))) : m.rows;
    const size_t need = (size_t)slab_rows * m.cols * 2;  // the decoded copy's bytes (dq_bytes whole)
    if (dq_ok && (slabs || dq_bytes <= kDqMax) && need < dq_failed_) {
      cuda::Mat h = m;
      h.type = cuda::T_F16, h.row_bytes = (size_t)m.cols * 2, h.w = nullptr;  // (the fit checks alignment only)
      if (cuda::mma_f16h_fits(h, x, n)) {
        try {
          h.w = static_cast<const uint8_t*>(grown(dq_, need, "weights decoded to f16"));
        } catch (const DeviceError&) {
          dq_failed_ = need;
        }
      }
      if (h.w) {
        cuda::cublas_prepare();
        void* sc = split_for(cuda::mma_f16h_scratch(n, m.cols));
        const bool split = f16_act_split(w);
        if (slabs)
          op(Tag::matmul, [=](cudaStream_t s) {
            cuda::mma_f16h_slabs(m, const_cast<uint8_t*>(h.w), slab_rows, x, n, y, sc, s);
          }, m.type, m.w, m.row_bytes, m.rows, m.cols, h.w, x, n, y, sc, slab_rows);
        else
          op(Tag::matmul, [=](cudaStream_t s) {
            cuda::dequant_f16(m, const_cast<uint8_t*>(h.w), s);
            cuda::mma_f16h(h, x, n, y, sc, split, s);
          }, m.type, m.w, m.row_bytes, m.rows, m.cols, h.w, x, n, y, sc, split);
        return;
      }
    }
    if (n >= f16_mma_min_ && n <= 64 && cuda::mma_f16_fits(m, x, n)) {  // bf16 (or F16H=0): the TF32 tiles
      op(Tag::matmul, [=](cudaStream_t s) { cuda::mma_f16(m, x, n, y, s); }, m.type, m.w, m.row_bytes, m.rows, m.cols,
         x, n, y);
      return;
    }
    op(Tag::matmul, [=](cudaStream_t s) { cuda::matmul(m, x, n, y, s); }, m.type, m.w, m.row_bytes, m.rows, m.cols, x,
       n, y);
  }
  void matmul_multi(const Weight* const* ws, float* const* ys, int count, const float* x, int64_t n) override {
    MatmulStep s;
    s.x = x, s.n = n, s.count = count;
    for (int i = 0; i < count && i < 3; ++i) s.w[i] = ws[i], s.y[i] = ys[i];
    if (count <= 3 && staged(s)) return;
    // The f16 prefill of two or three matrices over one x (Q / K / V, gate / up) splits or rounds x
    // to f16 once for all of them (mma_f16h_multi), not once a matrix (DASLLAMA_CUDA_F16_MULTI=0:
    // once a matrix; read at each call). H100, Llama-1B F16 pp512 with cuBLAS, ab_cuda.py, best of
    // 3: 84,067 -> 86,768.
    const char* fm = std::getenv("DASLLAMA_CUDA_F16_MULTI");
    if (!(fm && fm[0] == '0') && count >= 2 && count <= 3 && n >= std::min<int64_t>(65, f16_min(*ws[0], n))) {
      cuda::Mat ms[3];
      float* yv[3] = {nullptr, nullptr, nullptr};
      const bool split = f16_act_split(*ws[0]);
      bool all = true;
      for (int i = 0; all && i < count; ++i) {
        ms[i] = mat(*ws[i]), yv[i] = ys[i];
        all = ws[i]->cols == ws[0]->cols && f16_act_split(*ws[i]) == split && cuda::mma_f16h_fits(ms[i], x, n);
      }
      if (all) {
        use();
        max_rows_ = std::max(max_rows_, n);
        cuda::cublas_prepare();
        void* sc = split_for(cuda::mma_f16h_scratch(n, ms[0].cols));
        const cuda::Mat m0 = ms[0], m1 = ms[1], m2 = count > 2 ? ms[2] : cuda::Mat{};
        float *y0 = yv[0], *y1 = yv[1], *y2 = yv[2];
        op(Tag::matmul, [=](cudaStream_t s) {
          const cuda::Mat mm[3] = {m0, m1, m2};
          float* const yy[3] = {y0, y1, y2};
          cuda::mma_f16h_multi(mm, yy, count, x, n, sc, split, s);
        }, count, m0.w, m0.rows, m1.w, m1.rows, m2.w, m2.rows, m0.type, m0.row_bytes, m1.row_bytes, m2.row_bytes,
           m0.cols, x, n, y0, y1, y2, sc, split);
        return;
      }
    }
    for (int i = 0; i < count; ++i) matmul(*ws[i], x, n, ys[i]);
  }
  int64_t fused_ops() const override { return fused_ops_; }
  int64_t path_count(const std::string& name) const override {
    if (name == "attn_gqa") return gqa_attn_;
    if (name == "attn_wide") return wide_attn_;
    if (name == "gemv_rope") return gemv_rope_;
    if (name == "rms_tail") return rms_tails_;
    return 0;
  }
  void matmul_step(const MatmulStep& s) override {
    if (s.count < 1 || s.count > 3 || (s.residual && s.count != 1))
      throw Error("matmul_step: 1 to 3 matmuls, and a residual only with one");
    if (!staged(s)) Backend::matmul_step(s);
  }
  void get_rows(const Weight& w, const int32_t* ids, int64_t n, float* out) override {
    use();
    const cuda::Mat m = mat(w);
    if (!cuda::matmul_type_ok(w.type))
      throw UnsupportedModelError("cuda: no get_rows kernel for weight type " + type_label(w.type));
    op(Tag::get_rows, [=](cudaStream_t s) { cuda::get_rows(m, ids, n, out, s); }, m.type, m.w, m.row_bytes, m.rows,
       m.cols, ids, n, out);
  }
  void rms_norm(const float* x, const float* w, float* y, int64_t n_rows, int64_t dim, float eps) override {
    use();
    op(Tag::rms_norm, [=](cudaStream_t s) { cuda::rms_norm(x, w, y, n_rows, dim, eps, s); }, x, w, y, n_rows, dim,
       eps);
  }
  void rope(float* x, int64_t n_tok, int64_t stride, int n_heads, int head_dim, const int32_t* pos,
            const RopeParams& p) override {
    use();
    if (p.n_rot > head_dim) throw Error("cuda rope: n_rot " + std::to_string(p.n_rot) + " > head_dim");
    // K right after Q at the same positions: one launch for both (the recorded Q op is
    // replaced).
    const RopeRec& r = rope_;
    if (rec_ && kvq_.empty() && r.at + 1 == ops_.size() && r.n_tok == n_tok && r.head_dim == head_dim &&
        r.pos == pos && same_rope(r.p, p) &&
        (x + n_tok * stride <= r.x || r.x + r.n_tok * r.stride <= x)) {  // disjoint: one pass, no races
      float* x1 = r.x;
      const int64_t s1 = r.stride;
      const int h1 = r.n_heads;
      ops_.back() = [=](cudaStream_t s) { cuda::rope2(x1, s1, h1, x, stride, n_heads, n_tok, head_dim, pos, p, s); };
      sig1(Tag::rope), sig1(x), sig1(stride), sig1(n_heads);
      rope_.at = SIZE_MAX;
      rope2_.at = ops_.size() - 1, rope2_.n_tok = n_tok;
      cuda::RopeStore& rs = rope2_.r;
      rs.x = x1, rs.stride = s1, rs.n_heads = h1, rs.x2 = x, rs.stride2 = stride, rs.n_heads2 = n_heads;
      rs.head_dim = head_dim, rs.pos = pos, rs.p = p;
      return;
    }
    op(Tag::rope, [=](cudaStream_t s) { cuda::rope(x, n_tok, stride, n_heads, head_dim, pos, p, s); }, x, n_tok,
       stride, n_heads, head_dim, pos, p.neox, p.n_rot, p.base, p.freq_scale, p.freq_factors, p.inv_freq, p.mscale);
    if (rec_) rope_ = RopeRec{ops_.size() - 1, x, n_tok, stride, n_heads, head_dim, pos, p};
  }
  void kv_store(const KVView& kv, int64_t first, const float* k, const float* v, int64_t n, int64_t src_stride,
                int64_t dim) override {
    use();
    if (!rec_) return cuda::kv_store(kv, first, k, v, n, src_stride, dim, st_);
    if (n <= 0) return;
    if (kv.type == KVType::q8_0 && dim % 32 != 0)
      throw Error("cuda kv_store: q8_0 rows need dim a multiple of 32, not " + std::to_string(dim));
    // Consecutive stores (one per session) go out as one launch, their views in the blob.
    if (!kvq_.empty() && (kvq_stride_ != src_stride || kvq_dim_ != dim)) flush_kv();
    cuda::KVStoreDesc d;
    d.kv = kv, d.first = first, d.k = k, d.v = v, d.n = n;
    kvq_.push_back(d);
    kvq_stride_ = src_stride, kvq_dim_ = dim;
  }
  void attention(const AttnArgs& a) override {
    use();
    cuda::attn_check(a);
    if (a.n_tok <= 0 || a.n_heads <= 0) return;
    if (a.n_tok >= flash_min_ && cuda::flash_fits(a, (int)prop_.sharedMemPerBlockOptin)) {
      if (rec_) no_graph_ = true;  // its args are baked into the launch, as below
      op(Tag::attention, [=](cudaStream_t s) { cuda::flash_attention(a, s); });
      return;
    }
    // The grouped-query kernel where it takes a (DASLLAMA_CUDA_ATTN_GQA=0 off; read at each call).
    const bool gqa = cuda::attn_gqa_on() && cuda::attn_gqa_heads(a) > 0;
    const int splits = gqa ? cuda::attn_gqa_splits(a.n_tok, a, a.n_kv, prop_.multiProcessorCount)
                           : cuda::attn_splits(a, prop_.multiProcessorCount);
    float* scratch = scratch_for(cuda::attn_scratch_floats(a, splits));
    int* cnt = splits > 1 ? counters_for((size_t)a.n_tok * a.n_heads) : nullptr;
    // Its args are baked into the launch, not the signature: a step with one runs directly.
    if (rec_) no_graph_ = true;
    if (gqa) ++gqa_attn_, wide_attn_ += cuda::attn_gqa_on_wide(a.n_tok, splits);
    op(Tag::attention, [=](cudaStream_t s) { cuda::attention(a, splits, scratch, cnt, s, gqa); });
  }
  void attention_multi(const AttnArgs* a, int count) override {
    use();
    // A prefill's rows take the tiled kernel (attention() picks it), not the row-per-block group.
    if (!rec_ || count <= 0 || (count > 1 && !(group_ & 1)) || (count == 1 && a[0].n_tok >= flash_min_)) {
      for (int i = 0; i < count; ++i) attention(a[i]);
      return;
    }
    flush_kv();
    int64_t maxtok = 0, total = 0, max_kv = 0;
    bool same = true;
    for (int i = 0; i < count; ++i) {
      cuda::attn_check(a[i]);
      maxtok = std::max(maxtok, a[i].n_tok), total += std::max<int64_t>(a[i].n_tok, 0);
      max_kv = std::max(max_kv, a[i].n_kv);
      same = same && a[i].n_heads == a[0].n_heads && a[i].head_dim == a[0].head_dim && a[i].kv.type == a[0].kv.type;
    }
    // One launch of count * maxtok row slots; ragged groups that would waste most
    // slots (a long prefill beside decodes) go one by one.
    const int64_t slots = (int64_t)count * maxtok;
    if (!same || maxtok <= 0 || a[0].n_heads <= 0 || slots > 65535 || slots > 4 * total + 8) {
      for (int i = 0; i < count; ++i) attention(a[i]);
      return;
    }
    // The grouped-query kernel where it takes every (DASLLAMA_CUDA_ATTN_GQA=0 off; read at each call)
    // session (its choice is in the signature).
    bool gqa = cuda::attn_gqa_on();
    for (int i = 0; i < count && gqa; ++i)
      gqa = a[i].n_kv_heads == a[0].n_kv_heads && cuda::attn_gqa_heads(a[i]) > 0;
    const int splits = gqa ? cuda::attn_gqa_splits(total, a[0], max_kv, prop_.multiProcessorCount)
                           : cuda::attn_splits(total, a[0].n_heads, max_kv, prop_.multiProcessorCount);
    const size_t floats = splits <= 1 ? 0 : (size_t)slots * a[0].n_heads * splits * (a[0].head_dim + 2);
    float* scratch = scratch_for(floats);
    int* counters = splits > 1 ? counters_for((size_t)slots * a[0].n_heads) : nullptr;
    const size_t off = blob_put(a, sizeof(AttnArgs) * count);
    const AttnArgs shape = a[0];
    const int cnt = count, mt = (int)maxtok;
    if (gqa) ++gqa_attn_, wide_attn_ += cuda::attn_gqa_on_wide(slots, splits);
    op(
        Tag::attention_group,
        [=](cudaStream_t s) {
          const auto* d = reinterpret_cast<const AttnArgs*>(static_cast<uint8_t*>(dblob_->data()) + off);
          cuda::attention_group(shape, d, cnt, mt, splits, scratch, counters, s, cuda::AttnQuant(), gqa);
        },
        cnt, mt, shape.n_heads, shape.head_dim, shape.kv.type, splits, scratch, counters, off, gqa);
    // Where the sessions' outputs are consecutive rows of one matrix, the matmul reading it may
    // have this launch round them (AttnRec).
    const int64_t width = (int64_t)shape.n_heads * shape.head_dim;
    bool rows_ok = shape.head_dim % 32 == 0;
    for (int i = 0; i < count && rows_ok; ++i)
      rows_ok = a[i].out_stride == width && a[i].out == a[0].out + rows_before(a, i) * width;
    attn_ = rows_ok ? AttnRec{ops_.size() - 1, shape, off, cnt, mt, splits, scratch, counters, a[0].out, total, width, gqa}
                    : AttnRec{};
  }
  static int64_t rows_before(const AttnArgs* a, int i) {
    int64_t r = 0;
    for (int k = 0; k < i; ++k) r += std::max<int64_t>(a[k].n_tok, 0);
    return r;
  }
  // Whether a plain dense layer's seven weights are loaded, not kept exact, and share one type
  // (into type): what the fused kernels take.
  static bool layer_type(const DecodeLayer& l, uint32_t& type) {
    const Weight* ws[7] = {l.wq, l.wk, l.wv, l.wo, l.gate, l.up, l.down};
    for (int i = 0; i < 7; ++i) {
      if (!ws[i]->data || ws[i]->exact) return false;
      const uint32_t t = mat(*ws[i]).type;
      if (i > 0 && t != type) return false;
      type = t;
    }
    return true;
  }
  // A plain dense layer's one-token decode step as one persistent kernel (cuda/fused.cu), in
  // q8 mode on the split q8_0 / q4_0 layouts, inside a recorded step. Its output equals the
  // op-by-op path's bit for bit, but on the H200 it decodes slower so far (Llama-1B Q8_0: 570
  // t/s against 683, RESULTS.md): opt-in with DASLLAMA_CUDA_FUSED=1 until it pays.
  bool decode_layer(const DecodeLayer& l) override {
    use();
    if (rec_ && mega_layer(l)) return true;
    const char* e = std::getenv("DASLLAMA_CUDA_FUSED");
    if (!rec_ || !e || std::strcmp(e, "1") != 0 || prop_.major < 8) return false;
    const AttnArgs& a = l.attn;
    const Weight* ws[7] = {l.wq, l.wk, l.wv, l.wo, l.gate, l.up, l.down};
    uint32_t type = 0;
    if (!layer_type(l, type)) return false;
    const int64_t q_dim = (int64_t)a.n_heads * a.head_dim, kv_dim = (int64_t)a.n_kv_heads * a.head_dim;
    if (!cuda::fused_layer_fits(type, a.head_dim, a.kv.type, l.dim, q_dim)) return false;
    const int64_t F = l.gate->rows;
    if (a.n_tok != 1 || a.n_kv < 1 || a.n_kv_heads <= 0 || a.n_heads % a.n_kv_heads != 0 || a.sinks ||
        a.q_stride != q_dim || a.out_stride != q_dim || l.rope.n_rot <= 0 || l.rope.n_rot > a.head_dim ||
        l.rope.n_rot % 2 != 0 || l.dim % 32 != 0 || q_dim % 32 != 0 || F % 32 != 0)
      return false;
    if (l.wq->cols != l.dim || l.wq->rows != q_dim || l.wk->rows != kv_dim || l.wv->rows != kv_dim ||
        l.wk->cols != l.dim || l.wv->cols != l.dim || l.wo->cols != q_dim || l.wo->rows != l.dim ||
        l.gate->cols != l.dim || l.up->cols != l.dim || l.up->rows != F || l.down->cols != F ||
        l.down->rows != l.dim)
      return false;
    cuda::attn_check(a);
    cuda::FusedLayerArgs f;
    std::memset(static_cast<void*>(&f), 0, sizeof f);  // padding too: its bytes are the signature
    f.x = l.x, f.dim = l.dim, f.q_dim = q_dim, f.kv_dim = kv_dim, f.ffn = F;
    f.attn_norm = l.attn_norm, f.ffn_norm = l.ffn_norm, f.eps = l.eps, f.act = cuda::act_code(l.act);
    auto job = [&](cuda::GemvJob& j, int count, const Weight* const* w, float* const* y, bool acc) {
      for (int i = 0; i < count; ++i) {
        const cuda::Mat m = mat(*w[i]);
        j.w[i] = m.w, j.rb[i] = m.row_bytes, j.rows[i] = m.rows, j.y[i] = y[i];
      }
      j.type = type, j.count = count, j.cols = w[0]->cols, j.n = 1, j.accumulate = acc;
      return cuda::gemv_q8_plan(j);
    };
    float* q = const_cast<float*>(a.q);  // the layer's own scratch: rope turns it in place
    float* const qkv_y[3] = {q, l.k, l.v};
    float* const gu_y[2] = {l.gate_out, l.up_out};
    f.ks_qkv = job(f.qkv, 3, ws, qkv_y, false);
    f.ks_o = job(f.o, 1, ws + 3, &f.x, true);
    f.ks_gu = job(f.gu, 2, ws + 4, gu_y, false);
    f.ks_down = job(f.down, 1, ws + 6, &f.x, true);
    f.q = q, f.k = l.k, f.v = l.v, f.att = a.out, f.gate = l.gate_out, f.up = l.up_out;
    f.h = qact_for(cuda::qact_bytes(1, F));
    cuda::point_qact(f.down, f.h, 1, F);
    f.rope = l.rope, f.pos = l.pos;
    f.splits = cuda::attn_splits(a, prop_.multiProcessorCount);
    f.part = scratch_for(cuda::attn_scratch_floats(a, f.splits));
    f.cnt = f.splits > 1 ? counters_for((size_t)a.n_heads) : nullptr;
    if (!bar_) {
      bar_ = alloc(256, "grid barrier");
      check(cudaMemsetAsync(bar_->data(), 0, 256, st_), "grid barrier");
    }
    f.bar = static_cast<unsigned*>(bar_->data());
    // Tuning knobs for A/B runs: blocks per SM (default: as many as fit), L2 prefetch (default on).
    const char* bps = std::getenv("DASLLAMA_CUDA_FUSED_BPS");
    f.blocks_per_sm = bps ? std::atoi(bps) : 0;
    const char* pf = std::getenv("DASLLAMA_CUDA_FUSED_PF");
    f.prefetch = !(pf && std::strcmp(pf, "0") == 0);
    const char* tr = std::getenv("DASLLAMA_CUDA_FUSED_TRACE");
    f.trace = tr ? std::atoi(tr) : -1;
    flush_kv();
    const size_t off = blob_put(&a, sizeof a);  // n_kv and the block table change every step
    sig1(Tag::fused_layer), sig1(off), sig1((int)a.kv.type), sig1(a.head_dim);
    const auto* p = reinterpret_cast<const uint8_t*>(&f);
    sig_.insert(sig_.end(), p, p + sizeof f);
    const int hd = a.head_dim;
    const KVType kt = a.kv.type;
    ops_.emplace_back([=](cudaStream_t st) {
      cuda::FusedLayerArgs g = f;
      g.attn = reinterpret_cast<const AttnArgs*>(static_cast<uint8_t*>(dblob_->data()) + off);
      cuda::fused_layer(g, type, hd, kt, st);
    });
    return true;
  }
  // ---- the persistent decode chain (cuda/mega.cu; DASLLAMA_CUDA_MEGA=1, opt-in: slower than the
  // op-by-op step on the H200, nineteenth and twentieth sessions) ----
  // Consecutive plain dense layers of a one-token step join one chain, recorded as one op;
  // end_step prepares the chain's device plan (outside any capture) before the ops run.
  struct MegaChain {
    cuda::MegaShape s;
    std::vector<cuda::MegaLayer> layers;
    const int32_t* pos = nullptr;
    float *x = nullptr, *q = nullptr, *k = nullptr, *v = nullptr;
    size_t at = 0;  // its op's index in ops_
    cuda::MegaPlan* plan = nullptr;
  };
  std::vector<std::shared_ptr<MegaChain>> chains_;          // this step's
  std::vector<std::unique_ptr<cuda::MegaPlan>> mega_plans_;  // never freed: captured graphs name them
  static bool mega_on() {
    const char* e = std::getenv("DASLLAMA_CUDA_MEGA");  // read at each step: one process A/Bs it
    return e && std::strcmp(e, "1") == 0;
  }
  bool mega_layer(const DecodeLayer& l) {
    if (!mega_on()) return false;
    const AttnArgs& a = l.attn;
    const Weight* ws[7] = {l.wq, l.wk, l.wv, l.wo, l.gate, l.up, l.down};
    uint32_t type = 0;
    if (!layer_type(l, type)) return false;
    cuda::MegaShape sh;
    std::memset(static_cast<void*>(&sh), 0, sizeof sh);  // padding too: compared and signed as bytes
    sh.type = type, sh.dim = (int)l.dim, sh.n_heads = a.n_heads, sh.n_kv_heads = a.n_kv_heads;
    sh.head_dim = a.head_dim, sh.q_dim = a.n_heads * a.head_dim, sh.kv_dim = a.n_kv_heads * a.head_dim;
    sh.ffn = (int)l.gate->rows, sh.kv = a.kv.type, sh.eps = l.eps, sh.act = cuda::act_code(l.act);
    if (*cuda::mega_unfit(sh, prop_.major)) return false;
    const int max_layers = cuda::mega_max_layers(sh, prop_.multiProcessorCount, (int)prop_.sharedMemPerBlockOptin);
    if (max_layers < 1) return false;
    if (a.n_tok != 1 || a.n_kv < 1 || a.sinks || a.q_stride != sh.q_dim || l.rope.n_rot <= 0 ||
        l.rope.n_rot > a.head_dim || l.rope.n_rot % 2 != 0 || l.act == Act::swiglu_oai)
      return false;
    if (l.wq->cols != l.dim || l.wq->rows != sh.q_dim || l.wk->rows != sh.kv_dim || l.wv->rows != sh.kv_dim ||
        l.wk->cols != l.dim || l.wv->cols != l.dim || l.wo->cols != sh.q_dim || l.wo->rows != l.dim ||
        l.gate->cols != l.dim || l.up->cols != l.dim || l.up->rows != sh.ffn || l.down->cols != sh.ffn ||
        l.down->rows != l.dim)
      return false;
    cuda::attn_check(a);
    flush_kv();
    cuda::MegaLayer ml;
    std::memset(static_cast<void*>(&ml), 0, sizeof ml);
    for (int i = 0; i < 7; ++i) ml.w[i] = mat(*ws[i]).w;
    ml.attn_norm = l.attn_norm, ml.ffn_norm = l.ffn_norm;
    ml.rope.neox = l.rope.neox, ml.rope.n_rot = l.rope.n_rot, ml.rope.base = l.rope.base;
    ml.rope.freq_scale = l.rope.freq_scale, ml.rope.freq_factors = l.rope.freq_factors;
    ml.rope.inv_freq = l.rope.inv_freq, ml.rope.mscale = l.rope.mscale;
    ml.attn_off = blob_put(&a, sizeof a);  // n_kv and the block table change every step
    float* q = const_cast<float*>(a.q);
    MegaChain* c = chains_.empty() ? nullptr : chains_.back().get();
    if (!c || c->at + 1 != ops_.size() || std::memcmp(&c->s, &sh, sizeof sh) != 0 || c->pos != l.pos ||
        c->x != l.x || c->q != q || c->k != l.k || c->v != l.v || (int)c->layers.size() >= max_layers) {
      auto nc = std::make_shared<MegaChain>();
      nc->s = sh, nc->pos = l.pos, nc->x = l.x, nc->q = q, nc->k = l.k, nc->v = l.v;
      sig1(Tag::mega), sig1(l.pos), sig1(l.x), sig1(q), sig1(l.k), sig1(l.v);
      const auto* p = reinterpret_cast<const uint8_t*>(&sh);
      sig_.insert(sig_.end(), p, p + sizeof sh);
      ops_.emplace_back([this, nc](cudaStream_t st) { nc->plan->launch(static_cast<uint8_t*>(dblob_->data()), st); });
      nc->at = ops_.size() - 1;
      chains_.push_back(nc);
      c = nc.get();
    } else {
      c->layers.back().next_norm = l.attn_norm;
    }
    c->layers.push_back(ml);
    const auto* p = reinterpret_cast<const uint8_t*>(&ml);
    sig_.insert(sig_.end(), p, p + sizeof ml);
    ++fused_ops_;
    return true;
  }
  // The device plans of this step's chains (before its ops run or are captured).
  void prepare_mega() {
    for (auto& c : chains_) {
      for (auto& p : mega_plans_)
        if (p->matches(c->s, c->layers, c->pos, c->x, c->q, c->k, c->v)) c->plan = p.get();
      if (!c->plan) {
        mega_plans_.push_back(std::make_unique<cuda::MegaPlan>());
        c->plan = mega_plans_.back().get();
      }
      c->plan->prepare(c->s, c->layers, c->pos, c->x, c->q, c->k, c->v, st_);
    }
    chains_.clear();
  }
  void glu(const float* gate, int64_t gs, const float* up, int64_t us, float* out, int64_t n_rows, int64_t dim,
           Act act) override {
    use();
    const GemvRec& r = dgemv_;
    if ((tails_ & 8) && rec_ && n_rows == 1 && r.at + 1 == ops_.size() && r.j.count == 2 && r.j.y[0] == gate &&
        r.j.y[1] == up) {
      // The float-activation gate / up GEMV just recorded makes gate and up: its clusters of a
      // 32-row chunk form the GLU (DASLLAMA_CUDA_TAILS bit 8), no launch of its own.
      cuda::GemvTail t;
      t.kind = cuda::GemvTail::glu_cluster, t.act = cuda::act_code(act), t.out = out, t.cols = dim;
      if (cuda::gemv_direct_glu_fits(r.j, t)) {
        const cuda::GemvJob rj = r.j;
        ops_.back() = [rj, t](cudaStream_t st) { cuda::gemv_direct_tailed(rj, t, st); };
        sig1(Tag::gemv_tail), sig1(t.kind), sig1(t.act), sig1(out), sig1(dim);
        dgemv_.at = SIZE_MAX, ++fused_ops_;
        return;
      }
    }
    op(Tag::glu, [=](cudaStream_t s) { cuda::glu(gate, gs, up, us, out, n_rows, dim, act, s); }, gate, gs, up, us, out,
       n_rows, dim, act);
    if (rec_) glu_ = GluRec{ops_.size() - 1, gate, gs, up, us, out, n_rows, dim, act};
  }
  void add(float* y, const float* x, int64_t n) override {
    use();
    op(Tag::add, [=](cudaStream_t s) { cuda::add(y, x, n, s); }, y, x, n);
  }
  void add_bias(float* y, const float* b, int64_t n_rows, int64_t dim) override {
    use();
    op(Tag::add_bias, [=](cudaStream_t s) { cuda::add_bias(y, b, n_rows, dim, s); }, y, b, n_rows, dim);
  }
  void scale(float* y, float sc, int64_t n) override {
    use();
    op(Tag::scale, [=](cudaStream_t s) { cuda::scale(y, sc, n, s); }, y, sc, n);
  }
  void softcap(float* y, float cap, int64_t n) override {
    use();
    op(Tag::softcap, [=](cudaStream_t s) { cuda::softcap(y, cap, n, s); }, y, cap, n);
  }
  void layer_norm(const float* x, const float* w, const float* b, float* y, int64_t n_rows, int64_t dim,
                  float eps) override {
    use();
    op(Tag::layer_norm, [=](cudaStream_t s) { cuda::layer_norm(x, w, b, y, n_rows, dim, eps, s); }, x, w, b, y, n_rows,
       dim, eps);
  }
  void gelu_erf(float* y, int64_t n) override {
    use();
    op(Tag::gelu_erf, [=](cudaStream_t s) { cuda::gelu_erf(y, n, s); }, y, n);
  }
  void copy_rows(float* dst, int64_t ds, const float* src, int64_t ss, int64_t rows, int64_t width) override {
    use();
    op(Tag::copy_rows, [=](cudaStream_t s) { cuda::copy_rows(dst, ds, src, ss, rows, width, s); }, dst, ds, src, ss,
       rows, width);
  }
  void im2col_1d(const float* x, int64_t x_stride, int64_t C, int64_t T, int k, int stride, int pad, float* out,
                 int64_t T_out) override {
    use();
    op(Tag::im2col_1d, [=](cudaStream_t s) { cuda::im2col_1d(x, x_stride, C, T, k, stride, pad, out, T_out, s); }, x,
       x_stride, C, T, k, stride, pad, out, T_out);
  }
  void im2col_rows(const float* x, int64_t C, int64_t T, int k, int stride, int pad, float* out,
                   int64_t T_out) override {
    use();
    op(Tag::im2col_rows, [=](cudaStream_t s) { cuda::im2col_rows(x, C, T, k, stride, pad, out, T_out, s); }, x, C, T,
       k, stride, pad, out, T_out);
  }
  void im2col_2d(const float* x, int64_t C, int64_t H, int64_t W, int64_t sc, int64_t sh, int64_t sw, int kh, int kw,
                 int stride, int pad, float* out, int64_t H_out, int64_t W_out) override {
    use();
    op(Tag::im2col_2d,
       [=](cudaStream_t s) { cuda::im2col_2d(x, C, H, W, sc, sh, sw, kh, kw, stride, pad, out, H_out, W_out, s); }, x, C,
       H, W, sc, sh, sw, kh, kw, stride, pad, out, H_out, W_out);
  }
  void avg_pool_rows(const float* x, int64_t n_rows, int64_t dim, int k, float* out) override {
    use();
    if (k <= 0) throw Error("cuda avg_pool_rows: k must be positive");
    op(Tag::avg_pool_rows, [=](cudaStream_t s) { cuda::avg_pool_rows(x, n_rows, dim, k, out, s); }, x, n_rows, dim, k,
       out);
  }

  // ---- mixture of experts: ids and weights stay on the device (no host sync per layer) ----
  void moe_route(const float* logits, int64_t n, int n_expert, int k, MoeGate gate, bool norm, int32_t* ids,
                 float* w) override {
    use();
    if (k < 1 || k > n_expert) throw Error("cuda moe_route: k must be in [1, n_expert]");
    const int g = (int)gate;
    op(Tag::moe_route, [=](cudaStream_t s) { cuda::moe_route(logits, n, n_expert, k, g, norm, ids, w, s); }, logits, n,
       n_expert, k, g, norm, ids, w);
  }
  void argmax(const float* x, int64_t n_rows, int64_t dim, int32_t* out) override {
    use();
    if (dim <= 0 || dim > INT32_MAX) throw Error("cuda argmax: row width must be in [1, 2^31)");
    const int splits = cuda::argmax_splits(n_rows, dim, prop_.multiProcessorCount);
    float* pv = nullptr;
    int *pi = nullptr, *cnt = nullptr;
    if (splits > 1) {
      if (!argmax_) {  // fixed size, never regrown: a captured step's pointers stay good
        const size_t bytes = (size_t)cuda::kArgmaxParts * 8 + (size_t)cuda::kArgmaxRows * 4;
        argmax_ = alloc(bytes, "argmax partials");
        check(cudaMemsetAsync(argmax_->data(), 0, bytes, st_), "argmax partials");
      }
      pv = static_cast<float*>(argmax_->data());
      pi = reinterpret_cast<int*>(pv + cuda::kArgmaxParts);
      cnt = pi + cuda::kArgmaxParts;
    }
    op(Tag::argmax, [=](cudaStream_t s) { cuda::argmax(x, n_rows, dim, out, splits, pv, pi, cnt, s); }, x, n_rows,
       dim, out);
  }
  void matmul_id(const Weight& w, const float* x, int64_t x_div, const int32_t* ids, int64_t n_pairs,
                 const float* bias, float* y) override {
    use();
    const cuda::Mat m = mat(w);
    const int64_t R = w.expert_rows;
    if (R <= 0 || m.rows % R != 0) throw Error("cuda matmul_id: the weight is not a stack of experts");
    if (x_div < 1) throw Error("cuda matmul_id: x_div must be >= 1");
    if (!cuda::matmul_type_ok(m.type))
      throw UnsupportedModelError("cuda: no matmul kernel for weight type " + type_label(m.type));
    op(Tag::matmul_id, [=](cudaStream_t s) { cuda::matmul_id(m, R, x, x_div, ids, n_pairs, bias, y, s); }, m.type, m.w,
       m.row_bytes, m.rows, m.cols, R, x, x_div, ids, n_pairs, bias, y);
  }
  void moe_sum(const float* y, const float* w, int64_t n, int k, int64_t dim, float* out) override {
    use();
    op(Tag::moe_sum, [=](cudaStream_t s) { cuda::moe_sum(y, w, n, k, dim, out, s); }, y, w, n, k, dim, out);
  }

  // ---- recurrent layers ----
  void conv1d_causal(float* state, const float* x, int64_t x_stride, int64_t n, int64_t C, const float* w, int k,
                     bool silu, float* y) override {
    use();
    if (k < 1 || k > 65) throw Error("cuda conv1d_causal: k must be in [1, 65]");
    op(Tag::conv1d_causal, [=](cudaStream_t s) { cuda::conv1d_causal(state, x, x_stride, n, C, w, k, silu, y, s); },
       state, x, x_stride, n, C, w, k, silu, y);
  }
  void delta_rule(const DeltaRuleArgs& a) override {
    use();
    if (a.n_k_heads <= 0 || a.n_v_heads % a.n_k_heads != 0 || a.dk <= 0 || a.dv <= 0)
      throw Error("cuda delta_rule: bad head layout");
    DeltaRuleArgs b = a;
    // The chunked form (delta_chunk_k) for prefills: held to the reference by the op harness
    // on the H200 (ninth session), 2.4-2.7x the token-by-token kernel at 512-2048 tokens
    // (bench_hybrid.py --op). DASLLAMA_CUDA_DELTA_CHUNKED=0 keeps the token-by-token rule.
    static const bool chunked_on = [] {
      const char* e = std::getenv("DASLLAMA_CUDA_DELTA_CHUNKED");
      return !(e && std::strcmp(e, "0") == 0);
    }();
    b.chunked = chunked_on && a.chunked && cuda::delta_chunk_fits(a.dk);
    op(Tag::delta_rule, [=](cudaStream_t s) { cuda::delta_rule(b, s); }, b.state, b.q, b.k, b.v, b.qkv_stride, b.alpha,
       b.beta, b.ab_stride, b.A, b.dt_bias, b.n, b.n_k_heads, b.n_v_heads, b.dk, b.dv, b.grouped, b.chunked, b.l2_eps,
       b.out, b.out_stride);
  }

 private:
  enum class Tag : uint8_t {
    copy = 1, zero, matmul, get_rows, rms_norm, rope, kv_group, attention, attention_group, glu, add, add_bias, scale,
    softcap, layer_norm, gelu_erf, copy_rows, im2col_1d, im2col_rows, avg_pool_rows, gemv, quant, moe_route, matmul_id, moe_sum,
    conv1d_causal, delta_rule, im2col_2d, fused_layer, gemv_x, gemv_tail, rope_store, argmax, mega, mark, gemv_rope
  };
  template <class T>
  void sig1(const T& v) {
    static_assert(std::is_scalar_v<T>, "signature fields are scalars (structs have padding)");
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    sig_.insert(sig_.end(), p, p + sizeof v);
  }
  // s as one staged-GEMV launch (norm, every matmul and the residual add fused), or
  // false when its weights or sizes do not fit that kernel.
  bool staged(const MatmulStep& s) {
    use();
    if (s.n < 1) return false;
    cuda::GemvJob j;
    std::memset(static_cast<void*>(&j), 0, sizeof j);  // padding too: the job's bytes are the signature
    const cuda::Mat m0 = mat(*s.w[0]);
    j.type = m0.type, j.count = s.count, j.cols = m0.cols, j.x = s.x, j.n = (int)s.n;
    for (int i = 0; i < s.count; ++i) {
      const cuda::Mat m = mat(*s.w[i]);
      if (m.type != j.type || m.cols != j.cols) return !reuse_q_ && mixed_k(s);
      j.w[i] = m.w, j.rb[i] = m.row_bytes, j.rows[i] = m.rows, j.y[i] = s.y[i];
    }
    j.norm = s.norm, j.norm_w = s.norm ? s.norm_w : nullptr, j.eps = s.eps;
    if (s.residual) j.accumulate = true, j.y[0] = s.residual;
    // q8 mode on the split layouts: activations quantized once (normed on the way), then
    // int8 dot products, as the CPU's quantized matmuls do.
    // K-quants too, up to 16 tokens, on gemv_k_i8_k: q4_K unless DASLLAMA_CUDA_Q4K_I8=0 (the f32
    // staged GEMV; H100 Q4_K_M tg256 620 -> 835, B = 4 / 16 1,320 / 1,593 -> 1,829 / 2,232), q5_K
    // and q6_K unless DASLLAMA_CUDA_Q56K_I8=0 (H100 tg256 / B = 4 / 16: Q4_K_M 828 / 1,829 / 2,483
    // -> 958 / 2,149 / 3,325, Q6_K 657 / 1,386 / 1,737 -> 960 / 2,184 / 3,459, Q5_K 609 / 1,343 /
    // 1,614 -> 1,014 / 2,275 / 3,361).
    const bool kq = cuda::k_i8_on(j.type) && !s.w[0]->exact && j.cols % 256 == 0 &&
                    (s.n <= 16 || cuda::k_mma_on(s.n));
    // Block formats from dq_f16_min() tokens (where the int8 GEMV does not take them): matmul()'s
    // decoding to f16, not the staged GEMV.
    if (!kq && !s.w[0]->exact && cuda::dequant_f16_type(j.type) && dq_f16_on() && s.n >= dq_f16_min()) return false;
    const bool q8 = kq || (!s.w[0]->exact && (j.type == cuda::T_Q8_0S || j.type == cuda::T_Q4_0S) && j.cols % 32 == 0);
    // f16 / bf16 batched steps from f16_min tokens: norm, then matmul()'s tensor-core tiles.
    if ((j.type == cuda::T_F16 || j.type == cuda::T_BF16) && s.n >= f16_min(*s.w[0], s.n)) return false;
    // From mma_min_ tokens on, q8 matmuls run on tensor cores (the GEMV turns compute-bound).
    // (K-quants: gemv_k_i8_k, or mma_k_i8_k where cuda::k_mma_on says: 5-32 tokens by default.)
    const bool mma = q8 && (kq ? cuda::k_mma_on(s.n) : s.n >= mma_min_) && prop_.major >= 8;
    if (!mma && s.n > 32) return false;  // the staged GEMV's range (kStagedMax in matmul.cu)
    void* qb = nullptr;
    if (q8) {
      j.x = nullptr, j.norm = false, j.norm_w = nullptr;
      qb = qact_for(cuda::qact_bytes(s.n, j.cols));
      cuda::point_qact(j, qb, s.n, j.cols);
    }
    if (mma ? !cuda::mma_q8_fits(j) : !cuda::gemv_staged_fits(j)) return false;
    max_rows_ = std::max(max_rows_, s.n);
    const GluRec& g = glu_;
    if (q8 && reuse_q_) {
      // (mixed_k, the logits' later slices: the run before rounded x, maybe not into qb)
      j.xq = last_q_.xq, j.xd = last_q_.xd, j.xs = last_q_.xs, j.xn = last_q_.xn, j.eps = last_q_.eps;
    } else if (q8 && rec_ && !s.norm && kvq_.empty() && g.at + 1 == ops_.size() && g.out == s.x && g.n_rows == s.n &&
        g.dim == j.cols) {
      // The GLU just recorded makes this input: it quantizes in the same pass, and where the
      // gate / up GEMV right before it allows, in that GEMV's tail (no launch of its own).
      const float *gate = g.gate, *up = g.up;
      const int64_t gs = g.gs, us = g.us, n = s.n, cols = j.cols;
      float* out = g.out;
      const int act = cuda::act_code(g.act);
      cuda::GemvTail t;
      t.kind = cuda::GemvTail::glu, t.act = act, t.out = out, t.cols = cols;
      const GemvRec& r = gemv_;
      bool fits = (tails_ & 10) && n == 1 && r.at + 2 == ops_.size() && r.j.count == 2 && r.j.y[0] == gate &&
                  r.j.y[1] == up && (t.q = tail_qact(r.j.xq, cuda::qact_bytes(1, cols)));
      if (fits && (tails_ & 8)) {  // bit 8: each chunk of gate and up a cluster, no counter
        t.kind = cuda::GemvTail::glu_cluster;
        if (!cuda::gemv_tail_fits(r.j, t)) t.kind = cuda::GemvTail::glu;
      }
      if (fits && t.kind == cuda::GemvTail::glu)  // bit 2: the chunks' blocks counted
        fits = (tails_ & 2) && (t.cnt = tail_counters()) && cuda::gemv_tail_fits(r.j, t);
      if (fits) {
        cuda::point_qact(j, t.q, 1, cols);  // (ffn down reads the tail's scratch)
        ops_.pop_back();
        const cuda::GemvJob rj = r.j;
        ops_.back() = [rj, t](cudaStream_t st) { cuda::gemv_tailed(rj, t, st); };
        sig1(Tag::gemv_tail), sig1(t.cnt), sig1(t.kind);
        gemv_.at = SIZE_MAX, ++fused_ops_;
      } else {
        ops_.back() = [=](cudaStream_t st) { cuda::glu_quantize(gate, gs, up, us, act, out, n, cols, qb, st); };
      }
      sig1(Tag::quant), sig1(j.xq);
      glu_.at = SIZE_MAX;
    } else if (q8 && !mma && qx_ && cuda::gemv_q8_x_fits(j)) {
      // One decode token: each GEMV block rounds its input itself (one launch, not two; opt-in).
      const float* x = s.x;
      const bool norm = s.norm;
      const float* nw = s.norm ? s.norm_w : nullptr;
      const float eps = s.eps;
      if (!rec_) {
        cuda::gemv_q8_x(j, x, norm, nw, eps, st_);
        return true;
      }
      flush_kv();
      sig1(Tag::gemv_x), sig1(x), sig1(norm), sig1(nw), sig1(eps);
      const auto* p = reinterpret_cast<const uint8_t*>(&j);
      sig_.insert(sig_.end(), p, p + sizeof j);
      ops_.emplace_back([j, x, norm, nw, eps](cudaStream_t st) { cuda::gemv_q8_x(j, x, norm, nw, eps, st); });
      return true;
    } else if (q8) {
      const float* x = s.x;
      const int64_t n = s.n, cols = j.cols;
      const bool norm = s.norm;
      const float* nw = s.norm ? s.norm_w : nullptr;
      const float eps = s.eps;
      cuda::GemvTail t;
      t.kind = cuda::GemvTail::round, t.x = x, t.norm = norm, t.nw = nw, t.eps = eps, t.cols = cols, t.q = qb;
      const GemvRec& r = gemv_;
      const AttnRec& ar = attn_;
      if (attnq_ && rec_ && !norm && kvq_.empty() && ar.at + 1 == ops_.size() && ar.out == x && ar.rows == n &&
          ar.width == cols) {
        // The attention just recorded wrote x: it rounds its outputs as it writes them.
        cuda::AttnQuant qo;
        qo.xq = const_cast<int8_t*>(j.xq), qo.xd = const_cast<float*>(j.xd), qo.xs = const_cast<int32_t*>(j.xs);
        qo.base = x;
        const AttnRec a = ar;
        ops_.back() = [this, a, qo](cudaStream_t st) {
          const auto* d = reinterpret_cast<const AttnArgs*>(static_cast<uint8_t*>(dblob_->data()) + a.off);
          cuda::attention_group(a.shape, d, a.cnt, a.mt, a.splits, a.scratch, a.counters, st, qo, a.gqa);
        };
        sig1(Tag::quant), sig1(qb);
        attn_.at = SIZE_MAX, ++fused_ops_;
      } else if (cuda::GemvTail rt = rms_tail(r, j, x, norm, nw); rt.kind == cuda::GemvTail::rms && !mma && !kq) {
        // The residual GEMV just recorded wrote x: the blocks of each 32-row chunk, a cluster,
        // round x * nw and sum its squares; this GEMV scales its sums by the norm (no launch
        // between them).
        cuda::point_qact(j, rt.q, 1, cols);
        j.xn = rt.xn, j.eps = eps;
        const cuda::GemvJob rj = r.j;
        ops_.back() = [rj, rt](cudaStream_t st) { cuda::gemv_tailed(rj, rt, st); };
        sig1(Tag::gemv_tail), sig1(rt.kind), sig1(x), sig1(cols), sig1(nw), sig1(rt.q);
        gemv_.at = SIZE_MAX, ++fused_ops_, ++rms_tails_;
      } else if ((tails_ & 1) && rec_ && n == 1 && kvq_.empty() && r.at + 1 == ops_.size() && r.j.count == 1 && r.j.y[0] == x &&
          (t.cnt = tail_counters()) && cuda::gemv_tail_fits(r.j, t)) {
        // The GEMV just recorded wrote x (a residual row): its last block rounds it.
        const cuda::GemvJob rj = r.j;
        ops_.back() = [rj, t](cudaStream_t st) { cuda::gemv_tailed(rj, t, st); };
        sig1(Tag::gemv_tail), sig1(t.cnt), sig1(x), sig1(cols), sig1(norm), sig1(nw), sig1(eps), sig1(qb);
        gemv_.at = SIZE_MAX, ++fused_ops_;
      } else {
        op(Tag::quant, [=](cudaStream_t st) { cuda::quantize_act(x, n, cols, norm, nw, eps, qb, st); }, x, n, cols,
           norm, nw, eps, qb);
      }
    }
    if (q8) last_q_ = j;
    if (!rec_) {
      mma ? cuda::mma_q8(j, st_) : cuda::gemv_staged(j, st_);
      return true;
    }
    flush_kv();
    sig1(Tag::gemv), sig1(mma);
    const auto* p = reinterpret_cast<const uint8_t*>(&j);
    sig_.insert(sig_.end(), p, p + sizeof j);
    if (mma) ops_.emplace_back([j](cudaStream_t st) { cuda::mma_q8(j, st); });
    else ops_.emplace_back([j](cudaStream_t st) { cuda::gemv_staged(j, st); });
    if (q8 && !mma) gemv_ = GemvRec{ops_.size() - 1, j};
    if (!q8 && !mma && s.n == 1 && s.count == 2 && !s.residual) dgemv_ = GemvRec{ops_.size() - 1, j};
    if (!mma && !kq && s.count == 3 && !s.residual && s.n <= 4) qkv_ = GemvRec{ops_.size() - 1, j};
    return true;
  }
  // A step over K-quants of more than one type (a Q4_K_M file's Q / K beside a q6_K V, in half its
  // layers): x rounded (normed on the way) once by the first run of one type, then each later run's
  // GEMV over the same rounded rows (unless DASLLAMA_CUDA_KMIX=0: the composition, a norm launch,
  // then a rounding launch a matrix; H100 Q4_K_M tg256 / B = 4 / 16 952 / 2,252 / 2,974 -> 1,013 /
  // 2,328 / 3,013). False where a run would not fit gemv_k_i8_k (checked before anything is
  // recorded).
  bool reuse_q_ = false;
  cuda::GemvJob last_q_;  // the last q8 matmul's job: where its rounded x lies (for reuse_q_)
  bool mixed_k(const MatmulStep& s) {
    const char* e = std::getenv("DASLLAMA_CUDA_KMIX");
    if ((e && e[0] == '0') || s.residual || s.count < 2 || (s.n > 16 && !cuda::k_mma_on(s.n))) return false;
    for (int i = 0; i < s.count; ++i) {
      const cuda::Mat m = mat(*s.w[i]);
      if (!cuda::k_i8_on(m.type) || s.w[i]->exact || m.cols != s.w[0]->cols ||
          !cuda::k_i8_rows_fit(m.type, m.cols, m.rows, m.row_bytes, m.w))
        return false;
    }
    for (int i = 0; i < s.count;) {
      const uint32_t t = mat(*s.w[i]).type;
      int k = i + 1;
      while (k < s.count && mat(*s.w[k]).type == t) ++k;
      MatmulStep run = s;
      run.count = k - i;
      for (int c = 0; c < 3; ++c) run.w[c] = c < run.count ? s.w[i + c] : nullptr, run.y[c] = c < run.count ? s.y[i + c] : nullptr;
      if (i > 0) run.norm = false, run.norm_w = nullptr;
      reuse_q_ = i > 0;
      const bool ok = staged(run);
      reuse_q_ = false;
      if (!ok && i == 0) return false;
      if (!ok) throw Error("cuda: a mixed K-quant step's later run did not fit gemv_k_i8_k");
      i = k;
    }
    return true;
  }
  // Runs f now, or (inside a step) records it with its arguments' bytes.
  template <class F, class... A>
  void op(Tag tag, F&& f, const A&... args) {
    if (!rec_) {
      f(st_);
      return;
    }
    flush_kv();
    sig1(tag);
    (sig1(args), ...);
    ops_.emplace_back(std::forward<F>(f));
  }
  // Appends bytes to the step's blob (16-aligned); returns their offset.
  size_t blob_put(const void* p, size_t n) {
    const size_t off = (blob_.size() + 15) & ~size_t(15);
    blob_.resize(off + n);
    std::memcpy(blob_.data() + off, p, n);
    return off;
  }
  void flush_kv() {
    if (kvq_.empty()) return;
    const int cnt = (int)kvq_.size();
    const int64_t ss = kvq_stride_, dim = kvq_dim_;
    if (cnt > 1 && !(group_ & 2)) {  // one launch per session, its first row baked in
      no_graph_ = true;
      for (const cuda::KVStoreDesc& e : kvq_)
        ops_.emplace_back([=](cudaStream_t s) { cuda::kv_store(e.kv, e.first, e.k, e.v, e.n, ss, dim, s); });
      kvq_.clear();
      return;
    }
    int64_t max_n = 0;
    for (const auto& d : kvq_) max_n = std::max(max_n, d.n);
    const bool with_rope = rope_stores();
    cuda::GemvRope g;
    const bool in_gemv = with_rope && rope_in_gemv(g);
    const size_t off = blob_put(kvq_.data(), sizeof(cuda::KVStoreDesc) * kvq_.size());
    kvq_.clear();
    if (in_gemv) {
      // The Q / K / V GEMV before that rope does both in its epilogue (one launch, not two).
      ops_.pop_back();
      const cuda::GemvJob j = qkv_.j;
      sig1(Tag::gemv_rope), sig1(cnt), sig1(off);
      ops_.back() = [=](cudaStream_t s) {
        cuda::GemvRope r = g;
        r.d = reinterpret_cast<const cuda::KVStoreDesc*>(static_cast<uint8_t*>(dblob_->data()) + off);
        cuda::gemv_roped(j, r, s);
      };
      if (gemv_.at == qkv_.at) gemv_.at = SIZE_MAX;
      rope2_.at = SIZE_MAX, qkv_.at = SIZE_MAX, ++fused_ops_, ++gemv_rope_;
      return;
    }
    if (with_rope) {
      // The Q / K rope just recorded and these stores as one launch.
      const cuda::RopeStore r = rope2_.r;
      sig1(Tag::rope_store), sig1(cnt), sig1(max_n), sig1(ss), sig1(dim), sig1(off);
      ops_.back() = [=](cudaStream_t s) {
        const auto* d = reinterpret_cast<const cuda::KVStoreDesc*>(static_cast<uint8_t*>(dblob_->data()) + off);
        cuda::rope_store_group(r, d, cnt, max_n, ss, dim, s);
      };
      rope2_.at = SIZE_MAX, ++fused_ops_;
      return;
    }
    sig1(Tag::kv_group), sig1(cnt), sig1(max_n), sig1(ss), sig1(dim), sig1(off);
    ops_.emplace_back([=](cudaStream_t s) {
      const auto* d = reinterpret_cast<const cuda::KVStoreDesc*>(static_cast<uint8_t*>(dblob_->data()) + off);
      cuda::kv_store_group(d, cnt, max_n, ss, dim, s);
    });
  }
  // Whether the Q / K / V GEMV recorded right before the Q / K rope (rope_stores() holds) can do
  // the rope and the queued stores itself (cuda::gemv_roped; DASLLAMA_CUDA_GEMV_ROPE=0: never;
  // read at each step): its outputs are the rope's rows and the stores' K and V, token for token,
  // into f16 / f32 caches. Fills g (its descriptors' address is the blob's, at launch).
  bool rope_in_gemv(cuda::GemvRope& g) const {
    const char* e = std::getenv("DASLLAMA_CUDA_GEMV_ROPE");
    if ((e && std::strcmp(e, "0") == 0) || qkv_.at + 2 != ops_.size()) return false;
    const cuda::GemvJob& j = qkv_.j;
    const cuda::RopeStore& r = rope2_.r;
    const int hd = r.head_dim;
    if (rope2_.n_tok != j.n || r.x != j.y[0] || r.stride != j.rows[0] || (int64_t)r.n_heads * hd != j.rows[0] ||
        r.x2 != j.y[1] || (int64_t)r.n_heads2 * hd != j.rows[1] || kvq_dim_ != j.rows[1])
      return false;
    for (const cuda::KVStoreDesc& d : kvq_) {
      const int64_t t0 = (d.k - r.x2) / r.stride2;  // (rope_stores: a whole row of x2)
      if ((d.kv.type != KVType::f16 && d.kv.type != KVType::f32) || d.v != j.y[2] + t0 * j.rows[2]) return false;
    }
    g.pos = r.pos, g.p = r.p, g.head_dim = hd, g.count = (int)kvq_.size(), g.x2 = r.x2, g.stride2 = r.stride2;
    g.d = reinterpret_cast<const cuda::KVStoreDesc*>(kvq_.data());  // (non-null for the check; the blob's at launch)
    return cuda::gemv_rope_fits(j, g);
  }
  // Whether the queued stores take exactly the rows of the Q / K rope recorded last (each
  // token's K row stored once, from where rope wrote it), so one launch can do both.
  bool rope_stores() const {
    const Rope2Rec& r = rope2_;
    if (!ropest_ || r.at + 1 != ops_.size() || kvq_stride_ != r.r.stride2 || r.r.p.n_rot / 2 > cuda::kRopeMaxHalf)
      return false;
    std::vector<std::pair<int64_t, int64_t>> spans;
    for (const cuda::KVStoreDesc& d : kvq_) {
      const int64_t off = d.k - r.r.x2;
      if (d.n <= 0 || off < 0 || off % r.r.stride2 != 0) return false;
      spans.emplace_back(off / r.r.stride2, d.n);
    }
    std::sort(spans.begin(), spans.end());
    int64_t next = 0;
    for (const auto& [t0, n] : spans) {
      if (t0 != next) return false;
      next = t0 + n;
    }
    return next == r.n_tok;
  }
  void stop_recording() {
    if (!rec_) return;
    rec_ = false;
    --g_recording;
  }
  // Forgets a recording no end_step will issue (a step that threw).
  void drop_recording() {
    if (!rec_) return;
    stop_recording();
    ops_.clear(), kvq_.clear();
    clear_step();
    free_deferred();
  }
  // The last rope recorded in this step, which a second one may join.
  struct RopeRec {
    size_t at = SIZE_MAX;  // its index in ops_
    float* x = nullptr;
    int64_t n_tok = 0, stride = 0;
    int n_heads = 0, head_dim = 0;
    const int32_t* pos = nullptr;
    RopeParams p{};
  } rope_;
  static bool same_rope(const RopeParams& a, const RopeParams& b) {
    return a.neox == b.neox && a.n_rot == b.n_rot && a.base == b.base && a.freq_scale == b.freq_scale &&
           a.freq_factors == b.freq_factors && a.inv_freq == b.inv_freq && a.mscale == b.mscale;
  }
  // The last Q / K rope pair recorded in this step (rope2), which the KV stores after it may join.
  struct Rope2Rec {
    size_t at = SIZE_MAX;
    int64_t n_tok = 0;
    cuda::RopeStore r;
  } rope2_;
  // The last GLU recorded in this step, whose output the next matmul may quantize.
  struct GluRec {
    size_t at = SIZE_MAX;
    const float* gate = nullptr;
    int64_t gs = 0;
    const float* up = nullptr;
    int64_t us = 0;
    float* out = nullptr;
    int64_t n_rows = 0, dim = 0;
    Act act = Act::silu;
  } glu_;
  // The last grouped attention recorded in this step, whose output rows (out, rows x width,
  // consecutive) the next matmul's rounding may join.
  struct AttnRec {
    size_t at = SIZE_MAX;
    AttnArgs shape{};
    size_t off = 0;
    int cnt = 0, mt = 0, splits = 0;
    float* scratch = nullptr;
    int* counters = nullptr;
    const float* out = nullptr;
    int64_t rows = 0, width = 0;
    bool gqa = false;  // the grouped-query kernel (DASLLAMA_CUDA_ATTN_GQA)
  } attn_;
  // The last q8 GEMV recorded in this step, which the rounding (or GLU) after it may join.
  struct GemvRec {
    size_t at = SIZE_MAX;
    cuda::GemvJob j;
  } gemv_;
  GemvRec qkv_;  // the last GEMV of three matrices and 1-4 tokens (a Q / K / V one), for rope_in_gemv
  GemvRec dgemv_;  // the last float-activation GEMV of two matrices and one token (gate / up), for glu()
  void clear_step() {
    chains_.clear();
    rope_.at = SIZE_MAX, glu_.at = SIZE_MAX, gemv_.at = SIZE_MAX, attn_.at = SIZE_MAX, rope2_.at = SIZE_MAX;
    qkv_.at = SIZE_MAX, dgemv_.at = SIZE_MAX;
    sig_.clear(), blob_.clear();
    max_rows_ = 0, no_graph_ = false;
    parts_rec_ = LogitParts();
  }
  // Issues the recorded ops as a graph; false when they must be launched directly.
  bool launch_graph(std::vector<std::function<void(cudaStream_t)>>& ops) {
    std::vector<uint8_t> sig;
    sig.swap(sig_);
    const auto t0 = hp_.on ? HostProf::now() : HostProf::clock::time_point{};
    for (Cached& c : cache_)
      if (c.sig == sig) {
        c.used = ++clock_;
        check(cudaGraphLaunch(c.exec, st_), "graph launch");
        if (hp_.on) hp_.launch += HostProf::us(HostProf::now() - t0), ++hp_.hits;
        return true;
      }
    struct Timed {
      HostProf& h;
      HostProf::clock::time_point t0;
      ~Timed() {
        if (h.on) h.capture += HostProf::us(HostProf::now() - t0), ++h.captures;
      }
    } timed{hp_, t0};
    cudaGraph_t g = nullptr;
    if (cudaStreamBeginCapture(st_, cudaStreamCaptureModeRelaxed) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    bool ok = true;
    try {
      for (auto& f : ops) f(st_);
    } catch (...) {
      ok = false;  // a launch refused under capture: end it, then launch directly (which reports a real error)
    }
    const cudaError_t e = cudaStreamEndCapture(st_, &g);
    if (!ok || e != cudaSuccess || !g) {
      cudaGetLastError();
      if (g) cudaGraphDestroy(g);
      graphs_ = false;  // this device or driver will not capture: stop trying
      std::fprintf(stderr, "dasllama cuda: graph capture failed (%s); launching directly\n", cudaGetErrorName(e));
      return false;
    }
    // Reuse the least recently used exec graph when the cache is full and the topology
    // matches (an update is cheaper than an instantiation); else instantiate.
    Cached* slot = nullptr;
    if (cache_.size() >= kMaxGraphs) {
      slot = &cache_[0];
      for (Cached& c : cache_)
        if (c.used < slot->used) slot = &c;
      cudaGraphExecUpdateResultInfo info{};
      if (cudaGraphExecUpdate(slot->exec, g, &info) != cudaSuccess) {
        cudaGetLastError();
        cudaGraphExecDestroy(slot->exec);
        slot->exec = nullptr;
      }
    }
    if (!slot || !slot->exec) {
      cudaGraphExec_t ex = nullptr;
      if (cudaGraphInstantiate(&ex, g, 0) != cudaSuccess || !ex) {
        cudaGetLastError();
        cudaGraphDestroy(g);
        if (slot) cache_.erase(cache_.begin() + (slot - cache_.data()));
        return false;
      }
      if (!slot) {
        cache_.emplace_back();
        slot = &cache_.back();
      }
      slot->exec = ex;
    }
    cudaGraphDestroy(g);
    slot->sig = std::move(sig);
    slot->used = ++clock_;
    check(cudaGraphLaunch(slot->exec, st_), "graph launch");
    return true;
  }

  void use() const { check(cudaSetDevice(dev_), "cudaSetDevice"); }
  std::string where() const { return "cuda:" + std::to_string(dev_) + " (" + prop_.name + ")"; }
  static std::string type_label(uint32_t t) {
    const TypeTraits* tt = type_traits(t);
    return tt ? tt->name : "id " + std::to_string(t);
  }
  static cuda::Mat mat(const Weight& w) {
    if (!w.data) throw Error("cuda: a weight used before load_weight");
    cuda::Mat m;
    m.type = w.type, m.w = w.data, m.row_bytes = w.row_bytes, m.rows = w.rows, m.cols = w.cols;
    if (w.packed_for == kSplitLayout) {
      m.type = w.type == (uint32_t)GGMLType::Q8_0 ? cuda::T_Q8_0S : cuda::T_Q4_0S;
      m.row_bytes = cuda::split_row_bytes(w.type, w.cols);
    }
    return m;
  }
  // Weight::packed_for of a matrix kept in the split layout.
  static constexpr int kSplitLayout = 0x5C0;
  // DASLLAMA_CUDA_SPLIT=0 keeps q8_0 / q4_0 in the file's layout (for A/B runs).
  static bool split_ok() {
    static const bool on = [] {
      const char* e = std::getenv("DASLLAMA_CUDA_SPLIT");
      return !(e && std::strcmp(e, "0") == 0);
    }();
    return on;
  }
  // q8 mode's prefill (past 64 tokens) of q4_1, q5_0, q5_1, q4_K, q5_K and q6_K weights decodes
  // each matrix to f16 and runs the f16 tiles (mma_f16h, x rounded to f16 once), as llama.cpp's
  // dequantize-then-GEMM prefill (H200 Q4_K_M pp512 9,164 -> 40,872); DASLLAMA_CUDA_DQF16=0: the
  // f32 FMA tiles (gemm_k). Read at each matmul.
  static bool dq_f16_on() {
    const char* e = std::getenv("DASLLAMA_CUDA_DQF16");
    return !(e && e[0] == '0');
  }
  // DASLLAMA_CUDA_DQF16_MIN (default 17, read at each call): the tokens from which q8 mode's block
  // formats are decoded to f16 for the tensor cores (below: the GEMVs). H100, Q4_K_M batched step
  // of 64: 1,615 t/s from 65, 12,279 from 33; of 24 / 32: 1,592 / 1,625 from 33, 6,297 / 8,116
  // from 17.
  static int64_t dq_f16_min() {
    const char* dm = std::getenv("DASLLAMA_CUDA_DQF16_MIN");
    const long long v = dm && *dm ? std::atoll(dm) : 17;
    return v >= 1 ? v : 17;  // (0, a negative or an unreadable value: the default, not every decode)
  }
  // Quantized activations of a matmul (grown).
  void* qact_for(size_t bytes) { return grown(qact_, bytes, "quantized activations"); }
  // The f16 prefill's split activations (grown).
  void* split_for(size_t bytes) { return grown(split_, bytes, "activation split"); }
  // b with at least `bytes`: grown (never shrunk) by half again, the old buffer freed once the
  // stream has drained, since kernels in flight may still read it.
  void* grown(BufferPtr& b, size_t bytes, const char* what) {
    if (!b || b->size() < bytes) {
      if (b) check(cudaStreamSynchronize(st_), what);
      b.reset();
      b = alloc(bytes + bytes / 2, what);
    }
    return b->data();
  }
  // Attention's split partials (grown).
  float* scratch_for(size_t floats) {
    return floats == 0 ? nullptr : static_cast<float*>(grown(scratch_, floats * 4, "attention scratch"));
  }

  // Attention's per-(row, head) split counters: zeroed when (re)allocated, and each
  // attention leaves them zero. Grown like scratch_for.
  int* counters_for(size_t n) {
    if (!counters_ || counters_->size() < n * sizeof(int)) {
      if (counters_) check(cudaStreamSynchronize(st_), "attention counters");
      counters_.reset();
      const size_t bytes = (n + n / 2) * sizeof(int);
      counters_ = alloc(bytes, "attention counters");
      check(cudaMemsetAsync(counters_->data(), 0, bytes, st_), "attention counters");
    }
    return static_cast<int*>(counters_->data());
  }

  // The GEMV tails' counters: zeroed once, left zeroed by every tail; never reallocated, so a
  // captured graph's pointer stays good.
  unsigned* tail_counters() {
    if (!tailc_) {
      tailc_ = alloc(cuda::kTailCounters * sizeof(unsigned), "GEMV tail counters");
      check(cudaMemsetAsync(tailc_->data(), 0, cuda::kTailCounters * sizeof(unsigned), st_), "GEMV tail counters");
    }
    return static_cast<unsigned*>(tailc_->data());
  }

  // The rms tail (DASLLAMA_CUDA_TAILS bit 4) for j, a one-token normed matmul over x, where the
  // GEMV recorded just before (r) wrote x alone (a residual row); kind none where either does not
  // fit. Its q holds the quants, then the chunks' sums of squares (doubles; qact_bytes is a
  // multiple of 8 for cols % 32 == 0).
  cuda::GemvTail rms_tail(const GemvRec& r, const cuda::GemvJob& j, const float* x, bool norm, const float* nw) {
    cuda::GemvTail t;
    const int64_t cols = j.cols;
    if (!(tails_ & 4) || !rec_ || j.n != 1 || !norm || !kvq_.empty() || r.at + 1 != ops_.size() || r.j.count != 1 ||
        r.j.y[0] != x || !cuda::gemv_xn_fits(j))
      return t;
    const size_t qb = cuda::qact_bytes(1, cols);
    t.kind = cuda::GemvTail::rms, t.x = x, t.nw = nw, t.cols = cols, t.q = tail_qact(r.j.xq, qb + cols / 4);
    t.xn = t.q ? reinterpret_cast<double*>(static_cast<uint8_t*>(t.q) + qb) : nullptr;
    if (!t.q || !cuda::gemv_tail_fits(r.j, t)) t.kind = cuda::GemvTail::none;
    return t;
  }

  // Where a GLU or rms tail writes the next matmul's quantized input: not the scratch its own
  // GEMV reads (`busy`), since a 32-row chunk's tail runs while other blocks still read their
  // input (a grid of several waves: Llama-1B's 1,024 blocks; the same scratch gave other logits
  // than the glu_quantize launch). So qact_ or alt_, whichever holds no part of it; alt_ is fixed
  // (never reallocated: a captured graph or an op recorded earlier in the step names it). Null
  // where `bytes` does not fit.
  void* tail_qact(const void* busy, size_t bytes) {
    constexpr size_t kAlt = size_t(1) << 18;
    if (!alt_) alt_ = alloc(kAlt, "GEMV tail activations");
    const auto* b = static_cast<const uint8_t*>(busy);
    const auto* a = static_cast<const uint8_t*>(alt_->data());
    if (b < a || b >= a + kAlt) return bytes <= kAlt ? alt_->data() : nullptr;
    return qact_ && qact_->size() >= bytes ? qact_->data() : nullptr;
  }

  // Where a step's host time goes (DASLLAMA_CUDA_HOSTPROF=1: printed when the backend goes):
  // recording (from begin_step to end_step: the model's code and the ops' closures), end_step
  // (graph lookup and launch), a large download's wait for the device and its copy out of the
  // pinned buffer, and the time from that copy to the next begin_step (sampling, the next
  // step's uploads). While the host records, copies or samples, the device has nothing to run.
  struct HostProf {
    using clock = std::chrono::steady_clock;
    static clock::time_point now() { return clock::now(); }
    bool on = [] {
      const char* e = std::getenv("DASLLAMA_CUDA_HOSTPROF");
      return e && std::strcmp(e, "1") == 0;
    }();
    double rec = 0, end = 0, wait = 0, copy = 0, between = 0;
    double upload = 0, launch = 0, capture = 0;  // parts of end_step: the blob's copy, replays, captures
    int64_t steps = 0, dls = 0, hits = 0, captures = 0;
    clock::time_point tb{}, tdl{};
    bool after_dl = false;
    static double us(clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }
    void begin() {
      if (!on) return;
      tb = now();
      if (after_dl) between += us(tb - tdl), after_dl = false;
    }
    struct End {
      HostProf& h;
      clock::time_point t0;
      explicit End(HostProf& hp) : h(hp), t0(hp.on ? now() : clock::time_point{}) {
        if (h.on) h.rec += us(t0 - h.tb);
      }
      ~End() {
        if (h.on) h.end += us(now() - t0), ++h.steps;
      }
    };
    void downloaded(clock::time_point t0, clock::time_point t1) {
      if (!on) return;
      tdl = now();
      wait += us(t1 - t0), copy += us(tdl - t1), ++dls, after_dl = true;
    }
    void report() const {
      if (!on || steps == 0) return;
      std::fprintf(stderr,
                   "dasllama cuda host: %lld steps, %lld large downloads; us a step: recording %.1f, end_step %.1f; "
                   "us a download: wait %.1f, copy %.1f, then to the next step %.1f\n",
                   (long long)steps, (long long)dls, rec / steps, end / steps, dls ? wait / dls : 0.0,
                   dls ? copy / dls : 0.0, dls ? between / dls : 0.0);
      std::fprintf(stderr,
                   "dasllama cuda host: end_step's blob upload %.1f us a step; %lld graph replays, %.1f us a launch; "
                   "%lld captures, %.1f us each (capture, update or instantiation, launch)\n",
                   upload / steps, (long long)hits, hits ? launch / hits : 0.0, (long long)captures,
                   captures ? capture / captures : 0.0);
    }
  } hp_;
  // Pinned rings for the small copies between steps (staged_upload, download_async), made on
  // first use; none where pinned memory is refused (then those copies are plain ones).
  static constexpr size_t kUpSlot = size_t(64) << 10, kDlSlot = 256;
  static constexpr int kUpSlots = 16, kDlSlots = 64;
  char* up_ring_ = nullptr;
  char* dl_ring_ = nullptr;
  cudaEvent_t up_ev_[kUpSlots] = {}, dl_ev_[kDlSlots] = {};
  bool up_used_[kUpSlots] = {};
  int up_next_ = 0;
  bool rings_refused_ = false;
  struct DlPending {
    void* dst;
    size_t bytes;
    int slot;
    int64_t ticket;
  };
  std::vector<DlPending> dl_pending_;
  int64_t dl_ticket_ = 0;
  bool rings() {
    if (up_ring_) return true;
    if (rings_refused_) return false;
    const char* e = std::getenv("DASLLAMA_CUDA_PINNED");
    void* p = nullptr;
    if ((e && std::strcmp(e, "0") == 0) ||
        cudaHostAlloc(&p, kUpSlot * kUpSlots + kDlSlot * kDlSlots, cudaHostAllocDefault) != cudaSuccess) {
      cudaGetLastError();
      rings_refused_ = true;
      return false;
    }
    for (auto& ev : up_ev_) check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    for (auto& ev : dl_ev_) check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
    up_ring_ = static_cast<char*>(p);
    dl_ring_ = up_ring_ + kUpSlot * kUpSlots;
    return true;
  }
  // A small upload from pageable memory would have CUDA wait for the stream before copying, so
  // the host could not prepare a step while the one before runs: it goes through the next
  // pinned slot instead (waiting only if that slot's copy from kUpSlots uploads ago is pending).
  bool staged_upload(void* dst, const void* src, size_t bytes) {
    if (bytes > kUpSlot || !rings()) return false;
    const int k = up_next_;
    up_next_ = (k + 1) % kUpSlots;
    if (up_used_[k]) check(cudaEventSynchronize(up_ev_[k]), "upload (a kernel before it failed)");
    char* h = up_ring_ + (size_t)k * kUpSlot;
    std::memcpy(h, src, bytes);
    check(cudaMemcpyAsync(dst, h, bytes, cudaMemcpyHostToDevice, st_), "upload");
    check(cudaEventRecord(up_ev_[k], st_), "upload");
    up_used_[k] = true;
    return true;
  }
  int dev_;
  cudaDeviceProp prop_{};
  // A one-token q8 GEMV does the rounding (bit 1) or the GLU + rounding (bit 2) that follows it
  // in its own last blocks instead of a launch (cuda::GemvTail; DASLLAMA_CUDA_TAILS, default 0).
  // The roundings stay off: on the H200 one block rounding a whole row after the others cost
  // more than the launch (Llama-1B Q8_0 decode 785 -> 718 t/s, RESULTS.md). So does the GLU since
  // the forty-fourth session: with its scratch apart from the GEMV's input, H100 tg256 Q8_0
  // 1,199 -> 1,235 and Q4_0 1,562 -> 1,616 without it. Bit 4 (opt-in): the residual GEMVs'
  // 32-row chunks, each a thread-block cluster, round x * norm_w and the next GEMV applies the
  // norm (rms_tail; it takes the place of bit 1 where both fit). Bit 8: the GLU tail with each
  // chunk of gate and up a cluster, no counter (bit 2's place), and the same for f16 / bf16
  // weights' gate / up (no glu launch). With both (12), H100 tg256 SmolLM2-135M / Gemma-3-270M
  // +9-20%, Llama-1B level at clusters of at most 4 (RESULTS.md, forty-eighth session); still
  // opt-in until the whole CUDA suite has run with them on.
  int tails_ = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_TAILS");
    return e ? std::atoi(e) & 15 : 0;
  }();
  // The Q / K rope and the KV stores after it go out as one launch (Rope2Rec; DASLLAMA_CUDA_ROPEST=0:
  // two launches).
  bool ropest_ = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_ROPEST");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  // Attention rounds its output for the matmul after it (AttnRec; DASLLAMA_CUDA_ATTNQ=0: a
  // quantize launch instead).
  bool attnq_ = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_ATTNQ");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  // One token's q8 GEMVs round their own input (DASLLAMA_CUDA_QX=1). Off: on the H200 every
  // block's own rounding cost more than the launch it saves (Llama-1B Q8_0 decode 708 -> 510
  // t/s, RESULTS.md), so a quantize launch comes first.
  bool qx_ = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_QX");
    return e && std::strcmp(e, "1") == 0;
  }();
  // Tokens from which q8 matmuls take the int8 mma kernel (DASLLAMA_CUDA_MMA_MIN; 0: never).
  int64_t mma_min_ = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_MMA_MIN");
    const long v = e ? std::atol(e) : 8;
    return v > 0 ? (int64_t)v : INT64_MAX;
  }();
  // Tokens from which f16 / bf16 matmuls take prefill's tensor-core tiles (mma_f16h / mma_f16;
  // x rounded to f16 in q8 mode, split f32-accurately in fp32 mode and for bf16; when this rule
  // was set, split everywhere) instead of the GEMVs, which read the weights once per 16 tokens
  // with f32 FMAs. H200, Llama-1B F16 (nineteenth session): from 9 tokens B=64 1,439 -> 7,236
  // t/s but B=16 2,676 -> 1,545, and the harness's bf16 21 x 8192 at 9 tokens missed the f32
  // bar (NMSE 1.5e-9); from 33 every case held. DASLLAMA_CUDA_F16_MMA_MIN; default 33.
  int64_t f16_mma_min_ = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_F16_MMA_MIN");
    const long v = e ? std::atol(e) : 33;
    return v > 0 ? (int64_t)v : INT64_MAX;
  }();
  // Tokens from which a matmul of w leaves the GEMVs for tensor cores: f16 weights in q8 mode on
  // cuBLAS from DASLLAMA_CUDA_F16_CUBLAS_MIN (default 5; H100, Llama-1B F16 batched steps of 8 / 12
  // / 16: 2,778 / 2,390 / 2,709 -> 3,356 / 4,969 / 6,441 t/s, 4 unchanged), the rest from
  // f16_mma_min_ (our own tiles lose to the GEMVs below 33, and bf16's TF32 split misses the f32
  // bar at 9 tokens). Read at each call; cuBLAS is opened only for a matmul of that many tokens
  // (a decode alone never loads it).
  int64_t f16_min(const Weight& w, int64_t n) {
    if (w.type != (uint32_t)GGMLType::F16 || w.exact || f16_act_split(w)) return f16_mma_min_;
    const char* e = std::getenv("DASLLAMA_CUDA_F16_CUBLAS_MIN");
    const long v = e && *e ? std::atol(e) : 5;
    if (v <= 0 || n < v) return f16_mma_min_;
    return cuda::cublas_prepare() ? std::min<int64_t>(v, f16_mma_min_) : f16_mma_min_;
  }
  // Query rows from which attention takes the tiled kernel (flash.cu; DASLLAMA_CUDA_FLASH_MIN,
  // 0: never): below, the row-per-block kernel with key splits keeps more blocks busy.
  int64_t flash_min_ = [] {
    const char* e = std::getenv("DASLLAMA_CUDA_FLASH_MIN");
    const long v = e ? std::atol(e) : 16;
    return v > 0 ? (int64_t)v : INT64_MAX;
  }();
  cudaStream_t st_ = nullptr;
  BufferPtr scratch_, qact_, alt_, split_, counters_, tailc_, argmax_;
  BufferPtr dq_;  // q8 mode's block-format weights decoded to f16 (the largest matrix so far, whole)
  size_t dq_failed_ = SIZE_MAX;  // the smallest copy the device could not hold
  int64_t fused_ops_ = 0;
  int64_t gemv_rope_ = 0;  // Q / K / V GEMVs recorded with the rope and KV stores (path_count)
  int64_t rms_tails_ = 0;  // residual GEMVs recorded rounding the next input by chunks (path_count)
  int64_t gqa_attn_ = 0;  // attentions issued or recorded on the grouped-query kernel (path_count)
  int64_t wide_attn_ = 0;  // those of them on its wide block, one row unsplit (path_count)
  float* pinned_ = nullptr;  // host_staging's buffer
  std::mutex blocks_mu_;  // host_block's live blocks (address, bytes), for download()
  std::vector<std::pair<float*, size_t>> blocks_;
  size_t pinned_floats_ = 0;
  bool pinned_refused_ = false;
  BufferPtr bar_;  // the fused layer's grid-barrier counters
  // The step being recorded.
  bool graphs_;
  int group_;
  bool rec_ = false;
  std::vector<std::function<void(cudaStream_t)>> ops_;
  std::vector<uint8_t> sig_, blob_;
  int64_t max_rows_ = 0;
  bool no_graph_ = false;  // a step op whose arguments the signature does not hold
  std::vector<cuda::KVStoreDesc> kvq_;
  int64_t kvq_stride_ = 0, kvq_dim_ = 0;
  BufferPtr dblob_;  // the blob on the device (kernels of the step read it)
  struct Cached {
    std::vector<uint8_t> sig;
    cudaGraphExec_t exec = nullptr;
    uint64_t used = 0;
  };
  std::vector<Cached> cache_;
  uint64_t clock_ = 0;
};

}  // namespace

std::shared_ptr<Backend> make_cuda_backend(int device_index) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw DeviceError("cuda: " + no_device_reason(e));
  }
  if (n == 0) throw DeviceError("cuda: no CUDA device found");
  if (device_index < 0 || device_index >= n)
    throw DeviceError("cuda:" + std::to_string(device_index) + ": no such device (" + std::to_string(n) +
                      " found: cuda:0" + (n > 1 ? "..cuda:" + std::to_string(n - 1) : std::string()) + ")");
  // The build carries sm_90 code and compute_75 PTX (cuda/CMakeLists.txt): an older GPU would
  // load no kernel at all, so it is refused here, by name, rather than at the first launch.
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_index) == cudaSuccess && prop.major * 10 + prop.minor < 75)
    throw DeviceError("cuda:" + std::to_string(device_index) + " (" + prop.name + "): compute capability " +
                      std::to_string(prop.major) + "." + std::to_string(prop.minor) +
                      ", this build needs 7.5 or newer (the CPU and device=\"vulkan\" still run)");
  cudaGetLastError();
  return std::make_shared<CudaBackend>(device_index);
}

BackendProbe probe_cuda() {
  BackendProbe p;
  p.backend = "cuda";
  p.built = true;
  try {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();
      p.error = no_device_reason(e);
      return p;
    }
    if (n == 0) {
      p.error = "no CUDA device found";
      return p;
    }
    int drv = 0, rt = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    int cur = -1;
    cudaGetDevice(&cur);
    for (int i = 0; i < n; ++i) {
      cudaDeviceProp prop{};
      if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      DeviceInfo d;
      d.backend = "cuda";
      d.index = i;
      d.name = prop.name;
      d.cc_major = prop.major;
      d.cc_minor = prop.minor;
      d.total_bytes = prop.totalGlobalMem;
      d.driver = "driver " + version_str(drv) + ", runtime " + version_str(rt);
      // Free memory needs a context on the device (made here once; the runtime keeps it).
      size_t fr = 0, tot = 0;
      if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&fr, &tot) == cudaSuccess)
        d.free_bytes = fr, d.total_bytes = tot;
      else
        cudaGetLastError();
      const std::string cb = cuda::cublas_name();
      if (!cb.empty()) d.features = "cublas " + cb;
      p.devices.push_back(d);
    }
    if (cur >= 0) cudaSetDevice(cur);
    if (p.devices.empty()) p.error = "CUDA devices found but none could be queried";
  } catch (const std::exception& ex) {
    p.error = ex.what();
  } catch (...) {
    p.error = "unknown error while probing CUDA";
  }
  return p;
}

}  // namespace dl
