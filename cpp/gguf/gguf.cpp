// GGUF v2/v3 reader: mmap the file, parse and validate header, metadata and tensor infos.
// Every read goes through a bounds-checked cursor; counts are checked against the
// bytes left before anything is reserved, so hostile files cost no more memory than
// a small multiple of their size.
#include "gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "core/errors.h"
#include "quant/types.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the GGUF reader assumes a little-endian host (values are read with memcpy)"
#endif

namespace dl::gguf {

namespace {

constexpr int kMaxArrayDepth = 8;   // nesting of arrays in arrays; real files use 1
constexpr uint32_t kMaxDims = 4;    // GGML_MAX_DIMS
constexpr size_t kMaxNameInMessage = 96;

// A name from the file, printable in an error message: non-printable bytes escaped, long names cut.
std::string printable(std::string_view s) {
  std::string out;
  static const char* hex = "0123456789abcdef";
  for (size_t i = 0; i < s.size() && i < kMaxNameInMessage; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (s.size() > kMaxNameInMessage) out += "...";
  return out;
}

// Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool valid_utf8(std::string_view s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) { ++i; continue; }
    int len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
    if (len == 0 || c > 0xf4 || i + len > n) return false;
    unsigned char c1 = static_cast<unsigned char>(s[i + 1]);
    if ((c1 & 0xc0) != 0x80) return false;
    if (c == 0xe0 && c1 < 0xa0) return false;   // overlong
    if (c == 0xed && c1 > 0x9f) return false;   // surrogate
    if (c == 0xf0 && c1 < 0x90) return false;   // overlong
    if (c == 0xf4 && c1 > 0x8f) return false;   // past U+10FFFF
    for (int k = 2; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xc0) != 0x80) return false;
    i += len;
  }
  return true;
}

[[noreturn]] void fail(const std::string& what, uint64_t at) {
  throw GGUFError("GGUF: " + what + " at byte " + std::to_string(at));
}

// Bounds-checked little-endian reader over the mapping.
struct Cursor {
  const uint8_t* base;
  uint64_t size;
  uint64_t pos = 0;

  uint64_t left() const { return size - pos; }

  void need(uint64_t n, const std::string& field) const {
    if (n > left())
      fail(field + ": truncated (need " + std::to_string(n) + " bytes, " + std::to_string(left()) +
               " left in file of size " + std::to_string(size) + ")",
           pos);
  }
  template <class T>
  T read(const std::string& field) {
    need(sizeof(T), field);
    T v;
    std::memcpy(&v, base + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string_view read_string(const std::string& field) {
    uint64_t at = pos;
    uint64_t len = read<uint64_t>(field + " (string length)");
    if (len > left())
      fail(field + ": string length " + std::to_string(len) + " past end of file (size " + std::to_string(size) +
               ")",
           at);
    std::string_view s(reinterpret_cast<const char*>(base + pos), static_cast<size_t>(len));
    pos += len;
    return s;
  }
};

bool known_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::FLOAT64); }

// Smallest encoding of one element of type t inside an array (used to bound counts).
uint64_t min_elem_size(ValueType t) {
  switch (t) {
    case ValueType::STRING: return 8;          // length only
    case ValueType::ARRAY: return 4 + 8;       // element type + count
    default: return value_type_size(t);
  }
}

Value read_scalar(ValueType t, const uint8_t* p) {
  Value v;
  v.type = t;
  switch (t) {
    case ValueType::UINT8: v.num.u = p[0]; break;
    case ValueType::INT8: v.num.i = static_cast<int8_t>(p[0]); break;
    case ValueType::UINT16: { uint16_t x; std::memcpy(&x, p, 2); v.num.u = x; break; }
    case ValueType::INT16: { int16_t x; std::memcpy(&x, p, 2); v.num.i = x; break; }
    case ValueType::UINT32: { uint32_t x; std::memcpy(&x, p, 4); v.num.u = x; break; }
    case ValueType::INT32: { int32_t x; std::memcpy(&x, p, 4); v.num.i = x; break; }
    case ValueType::UINT64: { uint64_t x; std::memcpy(&x, p, 8); v.num.u = x; break; }
    case ValueType::INT64: { int64_t x; std::memcpy(&x, p, 8); v.num.i = x; break; }
    case ValueType::FLOAT32: { float x; std::memcpy(&x, p, 4); v.num.f = x; break; }
    case ValueType::FLOAT64: { double x; std::memcpy(&x, p, 8); v.num.f = x; break; }
    case ValueType::BOOL: v.num.b = p[0] != 0; break;
    default: break;
  }
  return v;
}

bool is_unsigned(ValueType t) {
  return t == ValueType::UINT8 || t == ValueType::UINT16 || t == ValueType::UINT32 || t == ValueType::UINT64;
}

// Parses one value of type t at the cursor; `field` names it for messages.
Value read_value(Cursor& c, ValueType t, const std::string& field, int depth) {
  if (t == ValueType::STRING) {
    Value v;
    v.type = t;
    v.str = c.read_string(field);
    return v;
  }
  if (t != ValueType::ARRAY) {
    size_t sz = value_type_size(t);
    c.need(sz, field);
    Value v = read_scalar(t, c.base + c.pos);
    if (t == ValueType::BOOL && c.base[c.pos] > 1)
      fail(field + ": bool value " + std::to_string(c.base[c.pos]) + " is not 0 or 1", c.pos);
    c.pos += sz;
    return v;
  }
  if (depth >= kMaxArrayDepth)
    fail(field + ": arrays nested deeper than " + std::to_string(kMaxArrayDepth), c.pos);
  Value v;
  v.type = ValueType::ARRAY;
  uint64_t at = c.pos;
  uint32_t et = c.read<uint32_t>(field + " (array element type)");
  if (!known_value_type(et)) fail(field + ": unknown array element type " + std::to_string(et), at);
  v.elem_type = static_cast<ValueType>(et);
  at = c.pos;
  uint64_t n = c.read<uint64_t>(field + " (array count)");
  uint64_t min = min_elem_size(v.elem_type);
  if (n > c.left() / min)
    fail(field + ": array count " + std::to_string(n) + " of " + value_type_name(v.elem_type) +
             " past end of file (size " + std::to_string(c.size) + ")",
         at);
  v.n = n;
  if (v.elem_type == ValueType::STRING) {
    v.strs.reserve(static_cast<size_t>(n));
    for (uint64_t i = 0; i < n; ++i) v.strs.push_back(c.read_string(field + "[" + std::to_string(i) + "]"));
  } else if (v.elem_type == ValueType::ARRAY) {
    v.arr.reserve(static_cast<size_t>(n));
    for (uint64_t i = 0; i < n; ++i)
      v.arr.push_back(read_value(c, ValueType::ARRAY, field + "[" + std::to_string(i) + "]", depth + 1));
  } else {
    v.data = c.base + c.pos;
    if (v.elem_type == ValueType::BOOL)
      for (uint64_t i = 0; i < n; ++i)
        if (v.data[i] > 1)
          fail(field + "[" + std::to_string(i) + "]: bool value " + std::to_string(v.data[i]) + " is not 0 or 1",
               c.pos + i);
    c.pos += n * min;  // n * min <= left, checked above
  }
  return v;
}

}  // namespace

// ---- Value -------------------------------------------------------------------

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::UINT8: return "uint8";
    case ValueType::INT8: return "int8";
    case ValueType::UINT16: return "uint16";
    case ValueType::INT16: return "int16";
    case ValueType::UINT32: return "uint32";
    case ValueType::INT32: return "int32";
    case ValueType::FLOAT32: return "float32";
    case ValueType::BOOL: return "bool";
    case ValueType::STRING: return "string";
    case ValueType::ARRAY: return "array";
    case ValueType::UINT64: return "uint64";
    case ValueType::INT64: return "int64";
    case ValueType::FLOAT64: return "float64";
  }
  return "unknown";
}

size_t value_type_size(ValueType t) {
  switch (t) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::BOOL: return 1;
    case ValueType::UINT16: case ValueType::INT16: return 2;
    case ValueType::UINT32: case ValueType::INT32: case ValueType::FLOAT32: return 4;
    case ValueType::UINT64: case ValueType::INT64: case ValueType::FLOAT64: return 8;
    default: return 0;
  }
}

bool Value::is_int() const {
  switch (type) {
    case ValueType::UINT8: case ValueType::INT8: case ValueType::UINT16: case ValueType::INT16:
    case ValueType::UINT32: case ValueType::INT32: case ValueType::UINT64: case ValueType::INT64: return true;
    default: return false;
  }
}
bool Value::is_float() const { return type == ValueType::FLOAT32 || type == ValueType::FLOAT64; }

int64_t Value::as_int() const {
  if (!is_int()) throw GGUFError(std::string("GGUF: expected an integer, got ") + value_type_name(type));
  if (is_unsigned(type)) {
    if (num.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      throw GGUFError("GGUF: integer " + std::to_string(num.u) + " does not fit in int64");
    return static_cast<int64_t>(num.u);
  }
  return num.i;
}

double Value::as_float() const {
  if (is_float()) return num.f;
  if (is_int()) return is_unsigned(type) ? static_cast<double>(num.u) : static_cast<double>(num.i);
  throw GGUFError(std::string("GGUF: expected a number, got ") + value_type_name(type));
}

bool Value::as_bool() const {
  if (type != ValueType::BOOL) throw GGUFError(std::string("GGUF: expected a bool, got ") + value_type_name(type));
  return num.b;
}

std::string Value::as_string() const {
  if (type != ValueType::STRING) throw GGUFError(std::string("GGUF: expected a string, got ") + value_type_name(type));
  return std::string(str);
}

Value Value::at(size_t idx) const {
  if (type != ValueType::ARRAY) throw GGUFError(std::string("GGUF: expected an array, got ") + value_type_name(type));
  if (idx >= n) throw GGUFError("GGUF: array index " + std::to_string(idx) + " out of range (" + std::to_string(n) + ")");
  if (elem_type == ValueType::STRING) {
    Value v;
    v.type = ValueType::STRING;
    v.str = strs[idx];
    return v;
  }
  if (elem_type == ValueType::ARRAY) return arr[idx];
  return read_scalar(elem_type, data + idx * value_type_size(elem_type));
}

int64_t TensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // validated at parse time not to overflow
  return n;
}

// ---- File --------------------------------------------------------------------

std::shared_ptr<File> File::open(const std::string& path, bool join_splits) {
  std::shared_ptr<File> f(new File());
  f->path_ = path;
  f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (f->fd_ < 0) throw Error("cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (fstat(f->fd_, &st) != 0) throw Error("cannot stat " + path + ": " + std::strerror(errno));
  if (S_ISDIR(st.st_mode)) throw Error("cannot open " + path + ": " + std::strerror(EISDIR));
  if (!S_ISREG(st.st_mode)) throw Error("cannot open " + path + ": not a regular file");
  f->size_ = static_cast<uint64_t>(st.st_size);
  if (f->size_ == 0) throw GGUFError("GGUF: empty file " + path + " (0 bytes) at byte 0");
  void* p = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, f->fd_, 0);
  if (p == MAP_FAILED) throw Error("cannot mmap " + path + ": " + std::strerror(errno));
  f->base_ = static_cast<const uint8_t*>(p);
  // The mapping keeps the file alive; the descriptor is no longer needed.
  ::close(f->fd_);
  f->fd_ = -1;
  f->parse();
  f->part_data_.assign(1, f->base_ + f->data_offset_);
  if (join_splits) f->join_parts();
  return f;
}

// ---- split files ----------------------------------------------------------------

namespace {
constexpr const char* kSplitNo = "split.no";
constexpr const char* kSplitCount = "split.count";
constexpr const char* kSplitTensors = "split.tensors.count";
constexpr int kMaxSplits = 65535;  // split.count is a uint16 in both writers

std::string base_name(const std::string& path) {
  size_t slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}
}  // namespace

bool File::split_name(const std::string& path, std::string* prefix, int* no, int* count) {
  // PREFIX-KKKKK-of-NNNNN.gguf: five or more digits each (printf's %05d).
  static const std::string tail = ".gguf";
  if (path.size() < tail.size() || path.compare(path.size() - tail.size(), tail.size(), tail) != 0) return false;
  size_t end = path.size() - tail.size();
  size_t i = end;
  while (i > 0 && path[i - 1] >= '0' && path[i - 1] <= '9') --i;
  size_t n_digits = end - i;
  if (n_digits < 5 || n_digits > 9 || i < 4 || path.compare(i - 4, 4, "-of-") != 0) return false;
  int n = std::stoi(path.substr(i, n_digits));
  size_t j = i - 4;
  size_t k = j;
  while (k > 0 && path[k - 1] >= '0' && path[k - 1] <= '9') --k;
  size_t k_digits = j - k;
  if (k_digits < 5 || k_digits > 9 || k < 1 || path[k - 1] != '-') return false;
  if (prefix) *prefix = path.substr(0, k - 1);
  if (no) *no = std::stoi(path.substr(k, k_digits));
  if (count) *count = n;
  return true;
}

std::string File::split_part_name(const std::string& prefix, int no, int count) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "-%05d-of-%05d.gguf", no, count);
  return prefix + buf;
}

void File::join_parts() {
  const std::optional<int64_t> count = get_int(kSplitCount);
  const std::optional<int64_t> no = get_int(kSplitNo);
  const std::string me = base_name(path_);
  if (!count) {
    if (no && *no != 0)
      throw GGUFError("GGUF: " + me + " has split.no = " + std::to_string(*no) + " but no split.count");
    return;
  }
  if (*count < 1 || *count > kMaxSplits)
    throw GGUFError("GGUF: " + me + ": split.count " + std::to_string(*count) + " not in 1.." +
                    std::to_string(kMaxSplits));
  if (!no) throw GGUFError("GGUF: " + me + ": split.count is set but split.no is missing");
  if (*no < 0 || *no >= *count)
    throw GGUFError("GGUF: " + me + ": split.no " + std::to_string(*no) + " not in 0.." + std::to_string(*count - 1));
  std::string prefix;
  if (*no != 0) {
    std::string first = split_name(path_, &prefix, nullptr, nullptr)
                            ? base_name(split_part_name(prefix, 1, static_cast<int>(*count)))
                            : "the part with split.no = 0";
    throw GGUFError("GGUF: " + me + " is part " + std::to_string(*no + 1) + " of " + std::to_string(*count) +
                    " of a split model; open its first part (" + first + ")");
  }
  if (*count == 1) return;
  const std::optional<int64_t> total = get_int(kSplitTensors);
  if (!total) throw GGUFError("GGUF: " + me + ": split.count is set but split.tensors.count is missing");
  if (*total < 0 || static_cast<uint64_t>(*total) < tensors_.size())
    throw GGUFError("GGUF: " + me + ": split.tensors.count " + std::to_string(*total) + " is less than the " +
                    std::to_string(tensors_.size()) + " tensors of the first part");
  int name_no = 0, name_count = 0;
  if (!split_name(path_, &prefix, &name_no, &name_count) || name_no != 1 || name_count != *count)
    throw GGUFError("GGUF: " + me + " is part 1 of " + std::to_string(*count) +
                    " of a split model, but its name does not end in " +
                    base_name(split_part_name("", 1, static_cast<int>(*count))) +
                    ", so the other parts cannot be found");

  const int n = static_cast<int>(*count);
  parts_.reserve(static_cast<size_t>(n - 1));
  uint64_t n_all = tensors_.size();
  for (int k = 1; k < n; ++k) {
    const std::string pp = split_part_name(prefix, k + 1, n);
    const std::string what = "GGUF: split part " + std::to_string(k + 1) + " of " + std::to_string(n) + " (" +
                             base_name(pp) + ")";
    struct stat st;
    if (::stat(pp.c_str(), &st) != 0)
      throw GGUFError(what + " is missing: " + std::strerror(errno) + " (" + pp + ")");
    std::shared_ptr<File> p;
    try {
      p = File::open(pp, false);
    } catch (const GGUFError& e) {
      throw GGUFError(what + ": " + e.what());
    } catch (const Error& e) {
      throw GGUFError(what + ": " + e.what());
    }
    try {
      const std::optional<int64_t> pc = p->get_int(kSplitCount);
      const std::optional<int64_t> pn = p->get_int(kSplitNo);
      const std::optional<int64_t> pt = p->get_int(kSplitTensors);
      if (!pc || !pn || !pt) throw GGUFError("not a split part (split.no, split.count or split.tensors.count missing)");
      if (*pn != k)
        throw GGUFError("has split.no = " + std::to_string(*pn) + ", expected " + std::to_string(k));
      if (*pc != *count || *pt != *total)
        throw GGUFError("belongs to another split: split.count " + std::to_string(*pc) + ", split.tensors.count " +
                        std::to_string(*pt) + " (the first part says " + std::to_string(*count) + " and " +
                        std::to_string(*total) + ")");
      if (p->version() != version_)
        throw GGUFError("has GGUF version " + std::to_string(p->version()) + ", the first part " +
                        std::to_string(version_));
    } catch (const GGUFError& e) {
      throw GGUFError(what + ": " + e.what());
    }
    n_all += p->tensors().size();
    if (n_all > static_cast<uint64_t>(*total))
      throw GGUFError(what + ": the parts so far hold " + std::to_string(n_all) +
                      " tensors, more than split.tensors.count " + std::to_string(*total));
    parts_.push_back(std::move(p));
  }
  if (n_all != static_cast<uint64_t>(*total))
    throw GGUFError("GGUF: the " + std::to_string(n) + " parts of " + me + " hold " + std::to_string(n_all) +
                    " tensors, split.tensors.count says " + std::to_string(*total));

  // One tensor list over all parts; names are unique across the whole split.
  tensors_.reserve(static_cast<size_t>(n_all));
  for (size_t k = 0; k < parts_.size(); ++k) {
    part_data_.push_back(parts_[k]->base_ + parts_[k]->data_offset_);
    for (const TensorInfo& t : parts_[k]->tensors()) {
      tensors_.push_back(t);
      tensors_.back().part = static_cast<uint32_t>(k + 1);
    }
  }
  // tensors_ may have moved: rebuild the index over the final strings.
  tensor_index_.clear();
  tensor_index_.reserve(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!tensor_index_.emplace(std::string_view(tensors_[i].name), i).second)
      throw GGUFError("GGUF: tensor '" + printable(tensors_[i].name) + "' appears in more than one part (" +
                      base_name(part_path(tensors_[i].part)) + ")");
  }
}

File::~File() {
  if (base_) munmap(const_cast<uint8_t*>(base_), size_);
  if (fd_ >= 0) ::close(fd_);
}

void File::release(const void* p, size_t n) const {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  if (b >= base_ && b < base_ + size_) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t lo = ((uintptr_t)b + pg - 1) & ~(pg - 1);  // whole pages only: neighbours stay
    const uintptr_t hi = std::min((uintptr_t)b + n, (uintptr_t)(base_ + size_)) & ~(pg - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
    return;
  }
  for (const auto& part : parts_) part->release(p, n);
}

void File::parse() {
  Cursor c{base_, size_};
  c.need(4, "magic");
  if (std::memcmp(base_, "GGUF", 4) != 0) {
    fail("bad magic '" + printable(std::string_view(reinterpret_cast<const char*>(base_), 4)) +
             "' (expected 'GGUF'; not a GGUF file)",
         0);
  }
  c.pos = 4;
  uint64_t at = c.pos;
  version_ = c.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3) {
    if (version_ == 1) fail("version 1 is not supported (only versions 2 and 3)", at);
    if ((version_ & 0xffff) == 0 && (version_ >> 16) != 0)
      fail("version " + std::to_string(version_) + " looks byte-swapped: big-endian GGUF is not supported", at);
    fail("unsupported version " + std::to_string(version_) + " (only versions 2 and 3)", at);
  }
  at = c.pos;
  uint64_t n_tensors = c.read<uint64_t>("tensor count");
  uint64_t at_kv = c.pos;
  uint64_t n_kv = c.read<uint64_t>("metadata count");
  // A KV takes at least key length (8) + type (4) + one byte; a tensor info at least
  // name length (8) + n_dims (4) + one dim (8) + type (4) + offset (8).
  if (n_kv > c.left() / 13)
    fail("metadata count " + std::to_string(n_kv) + " past end of file (size " + std::to_string(size_) + ")", at_kv);
  if (n_tensors > c.left() / 32)
    fail("tensor count " + std::to_string(n_tensors) + " past end of file (size " + std::to_string(size_) + ")", at);

  kvs_.reserve(static_cast<size_t>(n_kv));
  kv_index_.reserve(static_cast<size_t>(n_kv));
  for (uint64_t k = 0; k < n_kv; ++k) {
    uint64_t kat = c.pos;
    std::string_view key = c.read_string("metadata key #" + std::to_string(k));
    std::string field = "key '" + printable(key) + "'";
    if (key.empty()) fail("metadata key #" + std::to_string(k) + " is empty", kat);
    uint64_t tat = c.pos;
    uint32_t t = c.read<uint32_t>(field + " (value type)");
    if (!known_value_type(t)) fail(field + ": unknown value type " + std::to_string(t), tat);
    KV kv;
    kv.key = std::string(key);
    kv.offset = kat;
    kv.value = read_value(c, static_cast<ValueType>(t), field, 0);
    kvs_.push_back(std::move(kv));
    // Views into kvs_[i].key are stable: kvs_ was reserved and never grows past it.
    if (!kv_index_.emplace(std::string_view(kvs_.back().key), kvs_.size() - 1).second)
      fail(field + ": duplicate key", kat);
  }

  if (const Value* a = find("general.alignment")) {
    const KV& kv = kvs_[kv_index_.at("general.alignment")];
    if (!a->is_int()) fail(std::string("key 'general.alignment': expected an integer, got ") + value_type_name(a->type), kv.offset);
    bool neg = !is_unsigned(a->type) && a->num.i < 0;
    uint64_t al = neg ? 0 : a->num.u;
    if (neg || al == 0 || (al & (al - 1)) != 0)
      fail("key 'general.alignment': " + (neg ? std::to_string(a->num.i) : std::to_string(al)) +
               " is not a nonzero power of two",
           kv.offset);
    alignment_ = al;
  }

  tensors_.reserve(static_cast<size_t>(n_tensors));
  tensor_index_.reserve(static_cast<size_t>(n_tensors));
  std::vector<uint64_t> info_at;
  info_at.reserve(static_cast<size_t>(n_tensors));
  for (uint64_t ti = 0; ti < n_tensors; ++ti) {
    uint64_t tat = c.pos;
    std::string_view name = c.read_string("tensor #" + std::to_string(ti) + " name");
    std::string field = "tensor '" + printable(name) + "'";
    if (name.empty()) fail("tensor #" + std::to_string(ti) + " name is empty", tat);
    // Names are looked up from Python as str, so one that is not UTF-8 could never be found.
    if (!valid_utf8(name)) fail(field + ": name is not valid UTF-8", tat);
    TensorInfo t;
    t.name = std::string(name);
    uint64_t at_nd = c.pos;
    uint32_t nd = c.read<uint32_t>(field + " n_dims");
    if (nd == 0 || nd > kMaxDims)
      fail(field + ": n_dims " + std::to_string(nd) + " not in 1.." + std::to_string(kMaxDims), at_nd);
    int64_t n = 1;
    for (uint32_t d = 0; d < nd; ++d) {
      uint64_t dat = c.pos;
      int64_t v = c.read<int64_t>(field + " ne[" + std::to_string(d) + "]");
      if (v <= 0) fail(field + ": ne[" + std::to_string(d) + "] = " + std::to_string(v) + " is not positive", dat);
      if (n > std::numeric_limits<int64_t>::max() / v)
        fail(field + ": element count overflows int64 at ne[" + std::to_string(d) + "]", dat);
      n *= v;
      t.ne.push_back(v);
    }
    uint64_t at_type = c.pos;
    t.type = c.read<uint32_t>(field + " type");
    const TypeTraits* tr = type_traits(t.type);
    if (!tr) fail(field + ": unknown tensor type " + std::to_string(t.type), at_type);
    if (t.ne[0] % tr->block_size != 0)
      fail(field + ": ne[0] = " + std::to_string(t.ne[0]) + " is not a multiple of the " + tr->name +
               " block size " + std::to_string(tr->block_size),
           at_nd);
    if (n / tr->block_size > std::numeric_limits<int64_t>::max() / tr->type_size)
      fail(field + ": byte size overflows int64", at_nd);
    t.nbytes = static_cast<uint64_t>(type_nbytes(t.type, n));
    uint64_t at_off = c.pos;
    t.offset = c.read<uint64_t>(field + " offset");
    if (t.offset % alignment_ != 0)
      fail(field + ": offset " + std::to_string(t.offset) + " not aligned to " + std::to_string(alignment_), at_off);
    tensors_.push_back(std::move(t));
    info_at.push_back(tat);
    if (!tensor_index_.emplace(std::string_view(tensors_.back().name), tensors_.size() - 1).second)
      fail(field + ": duplicate tensor name", tat);
  }
  header_end_ = c.pos;

  // Data section starts at the header end rounded up to the alignment.
  uint64_t pad = (alignment_ - header_end_ % alignment_) % alignment_;
  if (header_end_ > std::numeric_limits<uint64_t>::max() - pad)
    fail("data section offset overflows (alignment " + std::to_string(alignment_) + ")", header_end_);
  data_offset_ = header_end_ + pad;

  // Each tensor's bytes must lie inside the file.
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const TensorInfo& t = tensors_[i];
    uint64_t room = data_offset_ <= size_ ? size_ - data_offset_ : 0;
    if (data_offset_ > size_ || t.offset > room || t.nbytes > room - t.offset) {
      // Report absolute positions; saturate where they would overflow.
      auto sat = [](uint64_t a, uint64_t b) {
        return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max() : a + b;
      };
      uint64_t beg = sat(data_offset_, t.offset);
      fail("tensor '" + printable(t.name) + "': data [" + std::to_string(beg) + ".." +
               std::to_string(sat(beg, t.nbytes)) + ") past end of file (size " + std::to_string(size_) + ")",
           info_at[i]);
    }
  }
  // No two tensors may share bytes.
  std::vector<size_t> order(tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tensors_[a].offset < tensors_[b].offset; });
  for (size_t k = 1; k < order.size(); ++k) {
    const TensorInfo& a = tensors_[order[k - 1]];
    const TensorInfo& b = tensors_[order[k]];
    if (a.offset + a.nbytes > b.offset)
      fail("tensor '" + printable(b.name) + "': data at offset " + std::to_string(b.offset) +
               " overlaps tensor '" + printable(a.name) + "' [" + std::to_string(a.offset) + ".." +
               std::to_string(a.offset + a.nbytes) + ")",
           info_at[order[k]]);
  }
}

const Value* File::find(std::string_view key) const {
  auto it = kv_index_.find(key);
  return it == kv_index_.end() ? nullptr : &kvs_[it->second].value;
}

namespace {
[[noreturn]] void wrong_type(std::string_view key, const Value& v, const char* want) {
  throw GGUFError("GGUF: key '" + printable(key) + "' has type " + value_type_name(v.type) + ", expected " + want);
}
}  // namespace

std::optional<int64_t> File::get_int(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_int()) wrong_type(key, *v, "an integer");
  if (is_unsigned(v->type) && v->num.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    throw GGUFError("GGUF: key '" + printable(key) + "': " + std::to_string(v->num.u) + " does not fit in int64");
  return v->as_int();
}

std::optional<double> File::get_float(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_int() && !v->is_float()) wrong_type(key, *v, "a number");
  return v->as_float();
}

std::optional<bool> File::get_bool(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::BOOL) wrong_type(key, *v, "a bool");
  return v->num.b;
}

std::optional<std::string> File::get_string(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::STRING) wrong_type(key, *v, "a string");
  return std::string(v->str);
}

const Value* File::get_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return nullptr;
  if (v->type != ValueType::ARRAY) wrong_type(key, *v, "an array");
  return v;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace dl::gguf
