// GGUF v2/v3 reader over an mmap: metadata, tensor infos, tensor data in place.
// Every malformed input throws dl::GGUFError naming the field and byte offset;
// nothing is allocated from a size before it is checked against the file.
// Split files (llama.cpp's gguf-split / gguf-py's writer: NAME-00001-of-0000N.gguf
// with keys split.no / split.count / split.tensors.count) open from the first part as
// one File: every part is mapped and validated, tensors point into their own part.
// Knows no architecture.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dl::gguf {

enum class ValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6,
  BOOL = 7, STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};
const char* value_type_name(ValueType t);

// One metadata value. Scalars are widened (ints to i64/u64, floats to double);
// strings view the mapping. Arrays keep numeric/bool elements packed in the
// mapping (zero copy, no per-element allocation a hostile count could inflate),
// string elements as views, nested arrays as Values. An array Value reads like
// a container: size(), v[i], range-for (elements come back as scalar Values).
struct Value {
  ValueType type = ValueType::UINT8;
  ValueType elem_type = ValueType::UINT8;  // ARRAY: element type
  union {
    uint64_t u;
    int64_t i;
    double f;
    bool b;
  } num{};
  std::string_view str;               // STRING: bytes in the mapping (not NUL-terminated)
  uint64_t n = 0;                     // ARRAY: element count
  const uint8_t* data = nullptr;      // ARRAY of numbers/bools: n packed little-endian elements
  std::vector<std::string_view> strs; // ARRAY of STRING: the elements
  std::vector<Value> arr;             // ARRAY of ARRAY: the elements

  bool is_int() const;       // any integer type (not bool)
  bool is_float() const;     // FLOAT32 / FLOAT64
  int64_t as_int() const;    // throws GGUFError if not an integer (u64 beyond i64 max too)
  double as_float() const;   // ints and floats
  bool as_bool() const;      // throws if not BOOL
  std::string as_string() const;  // throws if not STRING

  // ARRAY access (throws GGUFError on a non-array or an index out of range).
  size_t size() const { return static_cast<size_t>(n); }
  bool empty() const { return n == 0; }
  Value at(size_t idx) const;
  Value operator[](size_t idx) const { return at(idx); }
  struct const_iterator {
    const Value* v;
    size_t i;
    Value operator*() const { return v->at(i); }
    const_iterator& operator++() { ++i; return *this; }
    bool operator!=(const const_iterator& o) const { return i != o.i; }
    bool operator==(const const_iterator& o) const { return i == o.i; }
  };
  const_iterator begin() const { return {this, 0}; }
  const_iterator end() const { return {this, size()}; }
};
// Bytes one element of a fixed-size type takes (0 for STRING / ARRAY).
size_t value_type_size(ValueType t);

struct KV {
  std::string key;
  Value value;
  uint64_t offset;  // byte offset of the key in the file
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> ne;  // dimensions, innermost (contiguous) first, as ggml stores them
  uint32_t type = 0;        // ggml type id (dl::GGMLType)
  uint64_t offset = 0;      // relative to the data section of its part
  uint64_t nbytes = 0;
  uint32_t part = 0;        // split part holding the bytes (0: the first / only file)
  int64_t n_elements() const;
};

class File {
 public:
  // Maps and validates the whole header. Throws GGUFError (or dl::Error for I/O).
  // A first split part (split.count > 1) maps and joins the other parts named after it;
  // join_splits=false opens exactly one file (any part) as it is.
  static std::shared_ptr<File> open(const std::string& path, bool join_splits = true);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t file_size() const { return size_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }

  const std::vector<KV>& metadata() const { return kvs_; }
  const Value* find(std::string_view key) const;  // nullptr if absent

  // Typed lookups: nullopt when absent, GGUFError when present with the wrong type.
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;
  std::optional<bool> get_bool(std::string_view key) const;
  std::optional<std::string> get_string(std::string_view key) const;
  // The ARRAY value (use size(), [i], range-for, or data/strs/arr directly).
  const Value* get_array(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  // Pointer to the tensor's bytes inside the mapping (valid while the File lives).
  const uint8_t* tensor_data(const TensorInfo& t) const { return part_data_[t.part] + t.offset; }
  // Split parts: 1 for a plain file; part_path(0) is path().
  size_t n_parts() const { return part_data_.size(); }
  const std::string& part_path(size_t i) const { return i == 0 ? path_ : parts_.at(i - 1)->path_; }
  uint64_t part_data_offset(size_t i) const { return i == 0 ? data_offset_ : parts_.at(i - 1)->data_offset_; }
  // The split prefix and count a file name says (PREFIX-0000K-of-0000N.gguf); false if none.
  static bool split_name(const std::string& path, std::string* prefix, int* no, int* count);
  static std::string split_part_name(const std::string& prefix, int no, int count);  // no is 1-based
  const uint8_t* base() const { return base_; }
  uint64_t header_end() const { return header_end_; }  // end of the tensor infos, before padding
  // Drops the whole pages of [p, p + n) from this process's resident memory, where they
  // lie in this file's (or a joined part's) mapping; anything else is ignored. The
  // mapping is read-only, so a later read only faults the bytes back in from the file.
  void release(const void* p, size_t n) const;

 private:
  File() = default;
  void parse();
  void join_parts();
  std::string path_;
  const uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
  int fd_ = -1;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  uint64_t header_end_ = 0;
  std::vector<KV> kvs_;
  std::unordered_map<std::string_view, size_t> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string_view, size_t> tensor_index_;
  std::vector<const uint8_t*> part_data_;      // per part: start of its data section
  std::vector<std::shared_ptr<File>> parts_;   // parts 2..N of a split (kept mapped)
};

}  // namespace dl::gguf
