// Pre-tokenizer splits for byte-level BPE: one hand-written matcher per split regex (no std::regex),
// following the regex's leftmost-first alternation and greedy backtracking exactly.
#include <algorithm>

#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode_tables.h"
#include "tokenizer/utf8.h"

namespace dl {
namespace {

using namespace tok::ucd;

uint16_t lookup_flags(uint32_t cp) {
  const Range* lo = std::begin(kRanges);
  const Range* hi = std::end(kRanges);
  const Range* r = std::upper_bound(lo, hi, cp, [](uint32_t c, const Range& x) { return c < x.first; });
  if (r == lo) return 0;
  --r;
  return cp <= r->last ? r->flags : 0;
}

uint16_t cp_flags(uint32_t cp) {
  static const auto latin = [] {
    std::vector<uint16_t> t(256);
    for (uint32_t c = 0; c < 256; ++c) t[c] = lookup_flags(c);
    return t;
  }();
  return cp < 256 ? latin[cp] : lookup_flags(cp);
}

// Text as code points with their byte offsets; an invalid run becomes one U+FFFD (flags 0).
struct Cps {
  std::vector<uint32_t> cp;
  std::vector<uint16_t> fl;
  std::vector<size_t> off;  // n + 1 entries
  size_t n = 0;

  explicit Cps(std::string_view s) {
    const auto* p = reinterpret_cast<const uint8_t*>(s.data());
    size_t i = 0, len = s.size();
    cp.reserve(len);
    off.reserve(len + 1);
    while (i < len) {
      uint32_t c;
      int k = utf8::next(p, len, i, &c);
      if (k <= 0) {
        c = 0xFFFD;
        k = k == 0 ? 1 : -k;  // a cut-off tail byte by byte; an invalid run as one char
      }
      cp.push_back(c);
      off.push_back(i);
      i += k;
    }
    off.push_back(len);
    n = cp.size();
    fl.resize(n);
    for (size_t j = 0; j < n; ++j) fl[j] = cp_flags(cp[j]);
  }

  bool has(size_t i, uint16_t f) const { return i < n && (fl[i] & f); }
  bool L(size_t i) const { return has(i, tok::ucd::L); }
  bool N(size_t i) const { return has(i, tok::ucd::N); }
  bool S(size_t i) const { return has(i, WS); }
  bool crlf(size_t i) const { return i < n && (cp[i] == '\r' || cp[i] == '\n'); }
  // [^\s\p{L}\p{N}]
  bool other(size_t i) const { return i < n && !(fl[i] & (tok::ucd::L | tok::ucd::N | WS)); }
  // [^\r\n\p{L}\p{N}]
  bool pre(size_t i) const { return i < n && !crlf(i) && !(fl[i] & (tok::ucd::L | tok::ucd::N)); }
  bool U(size_t i) const { return has(i, Lu | Lt | Lm | Lo | M); }
  bool W(size_t i) const { return has(i, Ll | Lm | Lo | M); }
};

uint32_t lower_ascii(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

// '(s|t|re|ve|m|ll|d) at i: its length, or 0.
size_t contraction(const Cps& t, size_t i, bool ci) {
  if (i >= t.n || t.cp[i] != '\'' || i + 1 >= t.n) return 0;
  uint32_t a = ci ? lower_ascii(t.cp[i + 1]) : t.cp[i + 1];
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 >= t.n) return 0;
  uint32_t b = ci ? lower_ascii(t.cp[i + 2]) : t.cp[i + 2];
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// The whitespace alternatives shared by all splits, at a whitespace char i:
// [\s*[\r\n]+ |] \s+(?!\S) | \s+
size_t match_space(const Cps& t, size_t i, bool newline_alt) {
  size_t j = i, last_nl = SIZE_MAX;
  while (t.S(j)) {
    if (t.crlf(j)) last_nl = j;
    ++j;
  }
  if (newline_alt && last_nl != SIZE_MAX) return last_nl + 1;
  if (j == t.n || j - i < 2) return j;
  return j - 1;  // leave the last space to prefix the next word
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
size_t match_gpt2(const Cps& t, size_t i) {
  if (size_t c = contraction(t, i, false)) return i + c;
  size_t j = i + (t.cp[i] == ' ' ? 1 : 0);
  if (t.L(j)) {
    while (t.L(j)) ++j;
    return j;
  }
  if (t.N(j)) {
    while (t.N(j)) ++j;
    return j;
  }
  if (t.other(j)) {
    while (t.other(j)) ++j;
    return j;
  }
  if (t.S(i)) return match_space(t, i, false);
  return i + 1;
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}
// | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+        (Llama-3; Qwen2 with max_digits 1)
size_t match_llama3(const Cps& t, size_t i, size_t max_digits) {
  if (size_t c = contraction(t, i, true)) return i + c;
  if ((t.pre(i) && t.L(i + 1)) || t.L(i)) {
    size_t j = i + 1;
    while (t.L(j)) ++j;
    return j;
  }
  if (t.N(i)) {
    size_t j = i;
    while (j < i + max_digits && t.N(j)) ++j;
    return j;
  }
  size_t j = i + (t.cp[i] == ' ' ? 1 : 0);
  if (t.other(j)) {
    while (t.other(j)) ++j;
    while (t.crlf(j)) ++j;
    return j;
  }
  if (t.S(i)) return match_space(t, i, true);
  return i + 1;
}

// [U]*[W]+ at k with backtracking (U = Lu Lt Lm Lo M, W = Ll Lm Lo M): end, or SIZE_MAX.
size_t match_uw(const Cps& t, size_t k) {
  size_t u = k;
  while (t.U(u)) ++u;
  for (size_t p = u;; --p) {
    if (t.W(p)) {
      size_t q = p;
      while (t.W(q)) ++q;
      return q;
    }
    if (p == k) return SIZE_MAX;
  }
}

// [^\r\n\p{L}\p{N}]?U*W+C?|[^\r\n\p{L}\p{N}]?U+W*C?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*
// |\s*[\r\n]+|\s+(?!\S)|\s+        with C = (?i:'s|'t|'re|'ve|'m|'ll|'d)   (GPT-4o, Llama-4)
size_t match_gpt4o(const Cps& t, size_t i) {
  size_t e = SIZE_MAX;
  if (t.pre(i)) e = match_uw(t, i + 1);
  if (e == SIZE_MAX) e = match_uw(t, i);
  if (e == SIZE_MAX) {
    size_t j = SIZE_MAX;
    if (t.pre(i) && t.U(i + 1)) j = i + 1;
    else if (t.U(i)) j = i;
    if (j != SIZE_MAX) {
      while (t.U(j)) ++j;
      while (t.W(j)) ++j;
      e = j;
    }
  }
  if (e != SIZE_MAX) return e + contraction(t, e, true);
  if (t.N(i)) {
    size_t j = i;
    while (j < i + 3 && t.N(j)) ++j;
    return j;
  }
  size_t j = i + (t.cp[i] == ' ' ? 1 : 0);
  if (t.other(j)) {
    while (t.other(j)) ++j;
    while (t.crlf(j) || (j < t.n && t.cp[j] == '/')) ++j;
    return j;
  }
  if (t.S(i)) return match_space(t, i, true);
  return i + 1;
}

}  // namespace

PreSplit pre_split_from_name(const std::string& pre) {
  // The names transformers maps to each split when it builds a tokenizer from a GGUF; anything
  // else (default, gpt-2, smollm, ...) gets GPT-2's byte-level regex there, so here too.
  // llama.cpp splits every digit apart first for "smollm" (and starcoder, refact, ...); with
  // SmolLM2's vocabulary (no token joins a digit to anything) both give the same ids.
  static const char* llama3[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                                 "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"};
  static const char* qwen2[] = {"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"};
  static const char* gpt4o[] = {"gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"};
  for (const char* s : llama3)
    if (pre == s) return PreSplit::LLAMA3;
  for (const char* s : qwen2)
    if (pre == s) return PreSplit::QWEN2;
  for (const char* s : gpt4o)
    if (pre == s) return PreSplit::GPT4O;
  return PreSplit::GPT2;
}

std::vector<std::pair<size_t, size_t>> pre_tokenize(std::string_view text, PreSplit split) {
  Cps t(text);
  std::vector<std::pair<size_t, size_t>> out;
  size_t i = 0;
  while (i < t.n) {
    size_t e;
    switch (split) {
      case PreSplit::LLAMA3: e = match_llama3(t, i, 3); break;
      case PreSplit::QWEN2: e = match_llama3(t, i, 1); break;
      case PreSplit::GPT4O: e = match_gpt4o(t, i); break;
      default: e = match_gpt2(t, i); break;
    }
    if (e <= i) e = i + 1;
    out.emplace_back(t.off[i], t.off[e]);
    i = e;
  }
  return out;
}

}  // namespace dl
