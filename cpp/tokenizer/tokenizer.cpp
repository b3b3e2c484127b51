// dl::Tokenizer: vocabulary set-up, added-token matching, BPE (byte-level and SPM), decoding, and
// the streaming UTF-8 holder. The oracle is the tokenizer transformers builds from the same GGUF.
#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <cstring>
#include <queue>

#include "core/errors.h"
#include "tokenizer/utf8.h"

namespace dl {
namespace {

const char* kSpace = "\xE2\x96\x81";  // U+2581 "▁", SentencePiece's space

// GPT-2's byte <-> printable-char alphabet: printable Latin-1 bytes stand for themselves, the
// rest map to U+0100 upward in byte order.
struct ByteAlphabet {
  uint32_t to_cp[256];
  int16_t to_byte[324];
  ByteAlphabet() {
    std::fill(std::begin(to_byte), std::end(to_byte), int16_t(-1));
    uint32_t extra = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_cp[b] = printable ? b : extra++;
      to_byte[to_cp[b]] = int16_t(b);
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
}

// Code point boundaries of a (valid or not) UTF-8 string: byte offsets, size+1 entries.
std::vector<size_t> char_bounds(std::string_view s) {
  std::vector<size_t> b;
  b.reserve(s.size() + 1);
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    b.push_back(i);
    uint32_t cp;
    int k = utf8::next(p, s.size(), i, &cp);
    i += k > 0 ? k : k == 0 ? 1 : -k;
  }
  b.push_back(s.size());
  return b;
}

// Byte-level spelling -> raw bytes; nullopt-like false when a char is outside the alphabet.
bool unmap_byte_level(std::string_view tok, std::string& out) {
  out.clear();
  const auto* p = reinterpret_cast<const uint8_t*>(tok.data());
  size_t i = 0;
  while (i < tok.size()) {
    uint32_t cp;
    int k = utf8::next(p, tok.size(), i, &cp);
    if (k <= 0 || cp >= 324 || alphabet().to_byte[cp] < 0) return false;
    out += char(alphabet().to_byte[cp]);
    i += k;
  }
  return true;
}

std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (true) {
    size_t j = s.find(from, i);
    if (j == std::string_view::npos) break;
    out.append(s.substr(i, j - i));
    out.append(to);
    i = j + from.size();
  }
  out.append(s.substr(i));
  return out;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

}  // namespace

Tokenizer::Tokenizer(TokenizerConfig cfg)
    : model_(std::move(cfg.model)),
      pre_(std::move(cfg.pre)),
      bos_(cfg.bos),
      eos_(cfg.eos),
      unk_(cfg.unk),
      add_bos_(cfg.add_bos),
      add_eos_(cfg.add_eos),
      add_space_prefix_(cfg.add_space_prefix) {
  const size_t n = cfg.tokens.size();
  if (model_ == "gpt2") byte_level_ = true;
  // "gemma4": SentencePiece-style pieces ("▁" for space, <0xXX> byte tokens) merged by the file's
  // merges -- the SPM path below, with merges given rather than derived from scores.
  else if (model_ != "llama" && model_ != "gemma4")
    throw UnsupportedModelError("tokenizer model '" + model_ + "' is not supported (gpt2, llama, gemma4)");
  if (n == 0) throw Error("tokenizer: empty vocabulary");
  if (n > (size_t)INT32_MAX) throw Error("tokenizer: vocabulary too large");
  if (!cfg.scores.empty() && cfg.scores.size() != n)
    throw Error("tokenizer: " + std::to_string(cfg.scores.size()) + " scores for " + std::to_string(n) + " tokens");
  if (!cfg.types.empty() && cfg.types.size() != n)
    throw Error("tokenizer: " + std::to_string(cfg.types.size()) + " token types for " + std::to_string(n) + " tokens");
  for (int32_t id : {cfg.bos, cfg.eos, cfg.unk, cfg.pad})
    if (id < -1 || id >= (int32_t)n) throw Error("tokenizer: special token id " + std::to_string(id) + " out of range");
  if (byte_level_) split_ = pre_split_from_name(pre_);

  types_.resize(n, TokenType::NORMAL);
  for (size_t i = 0; i < cfg.types.size(); ++i) {
    int32_t t = cfg.types[i];
    types_[i] = (t >= 0 && t <= 6) ? TokenType(t) : TokenType::NORMAL;
  }

  // Spelling the BPE sees (vocab_ keys), and raw pieces, into the arena: the file spellings
  // first, then only the pieces and spellings that differ from them.
  size_t text_bytes = 0;
  for (const std::string& t : cfg.tokens) text_bytes += t.size();
  arena_.reserve(text_bytes + text_bytes / 4);
  str_.resize(n);
  auto put = [&](std::string_view b) {
    if (arena_.size() + b.size() > UINT32_MAX) throw Error("tokenizer: vocabulary text over 4 GiB");
    Span sp{(uint32_t)arena_.size(), (uint32_t)b.size()};
    arena_.append(b);
    return sp;
  };
  for (size_t i = 0; i < n; ++i) str_[i].text = str_[i].piece = str_[i].spell = put(cfg.tokens[i]);
  std::fill(std::begin(byte_sym_), std::end(byte_sym_), -1);
  std::string piece, sp;
  for (size_t i = 0; i < n; ++i) {
    const std::string& t = cfg.tokens[i];
    bool own_piece = true, own_spell = false;
    sp.clear();
    if (byte_level_) {
      if (!unmap_byte_level(t, piece)) {
        // Outside the byte alphabet (added tokens stored raw): the text is the bytes; HF respells
        // it in the alphabet so the BPE could still reach it.
        own_piece = false;
        for (unsigned char b : t) append_utf8(sp, alphabet().to_cp[b]);
        own_spell = true;
      }
    } else {
      if (types_[i] == TokenType::BYTE && t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
          hex_digit(t[3]) >= 0 && hex_digit(t[4]) >= 0) {
        int b = hex_digit(t[3]) * 16 + hex_digit(t[4]);
        piece.assign(1, char(b));
        byte_sym_[b] = (int32_t)i;
      } else {
        piece = replace_all(t, kSpace, " ");
      }
      // Gemma files store tokens of several spaces as real spaces; the text reaches the BPE with
      // "▁" for space, so spell them that way (as transformers does).
      if (cfg.gemma_style && t.find(' ') != std::string::npos &&
          std::all_of(t.begin(), t.end(), [](char c) { return c == ' ' || (c >= '\t' && c <= '\r'); })) {
        for (size_t k = 0; k < t.size(); ++k) sp += kSpace;
        own_spell = true;
      }
    }
    if (own_piece && piece != t) str_[i].piece = put(piece);
    if (own_spell && sp != t) str_[i].spell = put(sp);
  }
  arena_.shrink_to_fit();
  // The file's strings are in the arena now; merges (byte-level) are all that is read later.
  std::vector<std::string>().swap(cfg.tokens);
  {
    size_t cap = 16;
    while (cap < 2 * n) cap <<= 1;
    vocab_.assign(cap, -1);
    const size_t mask = cap - 1;
    for (size_t i = 0; i < n; ++i) {  // a later duplicate wins, as in a dict
      std::string_view k = spell((int32_t)i);
      size_t h = std::hash<std::string_view>()(k) & mask;
      while (vocab_[h] >= 0 && spell(vocab_[h]) != k) h = (h + 1) & mask;
      vocab_[h] = (int32_t)i;
    }
  }
  if (byte_level_) {
    std::string one;
    for (int b = 0; b < 256; ++b) {
      one.clear();
      append_utf8(one, alphabet().to_cp[b]);
      byte_sym_[b] = find_spell(one);
    }
  }

  // Merges: given (byte-level), or derived from the vocabulary (SPM).
  if (!cfg.merges.empty()) {
    merges_.reserve(cfg.merges.size());
    std::string joined;
    for (size_t r = 0; r < cfg.merges.size(); ++r) {
      const std::string& m = cfg.merges[r];
      size_t sp = m.find(' ', 1);
      if (sp == std::string::npos) continue;
      std::string_view l(m.data(), sp), rr(m.data() + sp + 1, m.size() - sp - 1);
      const int32_t il = find_spell(l), ir = find_spell(rr);
      joined.assign(l);
      joined.append(rr);
      const int32_t ij = find_spell(joined);
      if (il < 0 || ir < 0 || ij < 0) continue;  // HF rejects these too
      uint64_t key = (uint64_t(uint32_t(il)) << 32) | uint32_t(ir);
      bool inserted;
      merges_.insert(key, Merge{(int32_t)r, ij}, &inserted);
    }
  } else if (!byte_level_) {
    std::vector<float> score(n);
    for (size_t i = 0; i < n; ++i)
      score[i] = cfg.gemma_style ? -float(i) : (cfg.scores.empty() ? 0.f : cfg.scores[i]);
    build_spm_merges(score);
  }

  // Special tokens the way transformers registers them: control tokens (special), user-defined
  // tokens (plain added tokens, always matched), and BOS/EOS/UNK/PAD (special).
  skip_.assign(n, false);
  trie_.emplace_back();
  auto add = [&](int32_t id, bool special) {
    const std::string_view t = token_text(id);
    if (t.empty() || spell(id) != t) return;  // respelled tokens are not matched (not in HF's vocab)
    int32_t node = 0;
    for (unsigned char b : t) {
      uint64_t key = (uint64_t(node) << 8) | b;
      bool inserted;
      node = *trie_edges_.insert(key, (int32_t)trie_.size(), &inserted);
      if (inserted) trie_.emplace_back();
    }
    trie_first_[(unsigned char)t[0]] = true;
    if (trie_[node].id < 0 || special) trie_[node] = TrieNode{id, special};
    if (special) skip_[id] = true;
  };
  for (size_t i = 0; i < n; ++i)
    if (types_[i] == TokenType::USER_DEFINED) add((int32_t)i, false);
  for (size_t i = 0; i < n; ++i)
    if (types_[i] == TokenType::CONTROL) add((int32_t)i, true);
  for (int32_t id : {cfg.bos, cfg.eos, cfg.unk, cfg.pad})
    if (id >= 0) add(id, true), skip_[id] = true;
}

// transformers' generate_merges: every split of every token into two vocabulary tokens is a
// merge; sorted best score first, then longer left part, then longer right part; ties keep token
// order and, within a token, (left id, right id) order. Lengths count code points.
void Tokenizer::build_spm_merges(const std::vector<float>& score) {
  struct M { float score; uint32_t len_l, len_r; int32_t l, r, result; };
  std::vector<M> all;
  std::vector<M> local;
  for (size_t i = 0; i < str_.size(); ++i) {
    const std::string_view t = spell((int32_t)i);
    if (find_spell(t) != (int32_t)i) continue;  // duplicate spelling: once
    std::vector<size_t> b = char_bounds(t);
    size_t chars = b.size() - 1;
    local.clear();
    for (size_t k = 1; k < chars; ++k) {
      const int32_t il = find_spell(t.substr(0, b[k]));
      if (il < 0) continue;
      const int32_t ir = find_spell(t.substr(b[k]));
      if (ir < 0) continue;
      local.push_back(M{score[i], (uint32_t)k, (uint32_t)(chars - k), il, ir, (int32_t)i});
    }
    std::sort(local.begin(), local.end(), [](const M& a, const M& c) { return a.l != c.l ? a.l < c.l : a.r < c.r; });
    all.insert(all.end(), local.begin(), local.end());
  }
  std::stable_sort(all.begin(), all.end(), [](const M& a, const M& c) {
    if (a.score != c.score) return a.score > c.score;
    if (a.len_l != c.len_l) return a.len_l > c.len_l;
    return a.len_r > c.len_r;
  });
  merges_.reserve(all.size());
  for (size_t r = 0; r < all.size(); ++r) {
    uint64_t key = (uint64_t(uint32_t(all[r].l)) << 32) | uint32_t(all[r].r);
    bool inserted;
    merges_.insert(key, Merge{(int32_t)r, all[r].result}, &inserted);
  }
}

size_t Tokenizer::match_added(std::string_view text, size_t pos, int32_t* id, bool* special) const {
  int32_t node = 0;
  size_t best = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const int32_t* child = trie_edges_.find((uint64_t(node) << 8) | (unsigned char)text[i]);
    if (!child) break;
    node = *child;
    if (trie_[node].id >= 0) {
      best = i + 1 - pos;
      *id = trie_[node].id;
      *special = trie_[node].special;
    }
  }
  return best;
}

// Standard BPE over one word: repeatedly merge the adjacent pair of lowest rank, leftmost first.
void Tokenizer::bpe_word(const int32_t* sym, size_t n, std::vector<int32_t>& out) const {
  if (n == 1) {
    out.push_back(sym[0]);
    return;
  }
  struct Node { int32_t id, prev, next; };
  std::vector<Node> s(n);
  for (size_t i = 0; i < n; ++i) s[i] = Node{sym[i], (int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1};
  struct Cand { int32_t rank, pos, result; };
  auto cmp = [](const Cand& a, const Cand& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::priority_queue<Cand, std::vector<Cand>, decltype(cmp)> q(cmp);
  auto push = [&](int32_t pos) {
    if (pos < 0 || s[pos].next < 0) return;
    const Merge* m = merges_.find((uint64_t(uint32_t(s[pos].id)) << 32) | uint32_t(s[s[pos].next].id));
    if (m) q.push(Cand{m->rank, pos, m->result});
  };
  for (size_t i = 0; i + 1 < n; ++i) push((int32_t)i);
  while (!q.empty()) {
    Cand c = q.top();
    q.pop();
    Node& a = s[c.pos];
    if (a.id < 0 || a.next < 0) continue;  // merged away
    const Merge* m = merges_.find((uint64_t(uint32_t(a.id)) << 32) | uint32_t(s[a.next].id));
    if (!m || m->result != c.result || m->rank != c.rank) continue;  // stale
    Node& b = s[a.next];
    a.id = c.result;
    b.id = -1;
    a.next = b.next;
    if (b.next >= 0) s[b.next].prev = c.pos;
    push(a.prev);
    push(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = s[i].next) out.push_back(s[i].id);
}

void Tokenizer::encode_text(std::string_view seg, bool first, std::vector<int32_t>& out) const {
  if (seg.empty()) return;
  std::vector<int32_t> sym;
  if (byte_level_) {
    for (auto [a, b] : pre_tokenize(seg, split_)) {
      sym.clear();
      for (size_t i = a; i < b; ++i) {
        int32_t id = byte_sym_[(unsigned char)seg[i]];
        if (id >= 0) sym.push_back(id);  // a vocabulary missing a byte drops it, as HF does
      }
      if (!sym.empty()) bpe_word(sym.data(), sym.size(), out);
    }
    return;
  }
  // SPM: spaces as "▁" (and one in front of the text when asked), one word, chars as symbols,
  // byte tokens for chars the vocabulary lacks, UNK (fused) when even those are missing.
  // The prefix goes only on the text's first segment, and not when it already starts with a
  // space: transformers' Metaspace(prepend_scheme="first"); llama.cpp would add one there too.
  std::string norm;
  if (add_space_prefix_ && first && seg[0] != ' ') norm = kSpace;
  norm += replace_all(seg, " ", kSpace);
  std::vector<size_t> b = char_bounds(norm);
  bool prev_unk = false;
  for (size_t k = 0; k + 1 < b.size(); ++k) {
    std::string_view ch(norm.data() + b[k], b[k + 1] - b[k]);
    const int32_t id = find_spell(ch);
    if (id >= 0) {
      sym.push_back(id);
      prev_unk = false;
      continue;
    }
    bool all = true;
    for (unsigned char c : ch) all = all && byte_sym_[c] >= 0;
    if (all) {
      for (unsigned char c : ch) sym.push_back(byte_sym_[c]);
      prev_unk = false;
    } else if (unk_ >= 0 && !prev_unk) {
      sym.push_back(unk_);
      prev_unk = true;
    }
  }
  if (!sym.empty()) bpe_word(sym.data(), sym.size(), out);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (add_special && add_bos_ && bos_ >= 0) out.push_back(bos_);
  size_t seg = 0, i = 0;
  while (i < text.size()) {
    if (!trie_first_[(unsigned char)text[i]]) {
      ++i;
      continue;
    }
    int32_t id = -1;
    bool special = false;
    size_t len = match_added(text, i, &id, &special);
    if (len == 0) {
      ++i;
    } else if (special && !parse_special) {
      i += len;  // stays text; no other added token is looked for inside it (HF does the same)
    } else {
      encode_text(text.substr(seg, i - seg), seg == 0, out);
      out.push_back(id);
      i += len;
      seg = i;
    }
  }
  encode_text(text.substr(seg), seg == 0, out);
  if (add_special && add_eos_ && eos_ >= 0) out.push_back(eos_);
  return out;
}

void Tokenizer::check_id(int32_t id) const {
  if (id < 0 || id >= (int32_t)str_.size())
    throw Error("token id " + std::to_string(id) + " out of range [0, " + std::to_string(str_.size()) + ")");
}

std::string_view Tokenizer::piece(int32_t id) const {
  check_id(id);
  return view(str_[id].piece);
}

std::string_view Tokenizer::render(int32_t id, bool special) const {
  check_id(id);
  if (skip_[id] && !special) return {};
  return view(str_[id].piece);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool special) const {
  std::string out;
  for (int32_t id : ids) out.append(render(id, special));
  // SPM with a space prefix: the prefix space is not part of the text (HF's Strip decoder).
  if (!byte_level_ && add_space_prefix_ && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

std::string_view Tokenizer::token_text(int32_t id) const {
  check_id(id);
  return view(str_[id].text);
}

TokenType Tokenizer::token_type(int32_t id) const {
  check_id(id);
  return types_[id];
}

int32_t Tokenizer::token_to_id(std::string_view text) const {
  for (size_t i = 0; i < str_.size(); ++i)
    if (view(str_[i].text) == text) return (int32_t)i;
  return -1;
}

int32_t Tokenizer::find_spell(std::string_view s) const {
  const size_t mask = vocab_.size() - 1;
  for (size_t h = std::hash<std::string_view>()(s) & mask;; h = (h + 1) & mask) {
    const int32_t id = vocab_[h];
    if (id < 0 || spell(id) == s) return id;
  }
}

template <typename V>
size_t Tokenizer::U64Map<V>::slot(uint64_t k) const {
  // murmur3's finalizer (ids differ in low bits only), then onto [0, capacity) by a multiply,
  // so the table need not be a power of two: ~0.7 full, not 0.5 at the next power.
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  return (size_t)(((unsigned __int128)k * slots_.size()) >> 64);
}

template <typename V>
void Tokenizer::U64Map<V>::reserve(size_t n) {
  const size_t cap = std::max<size_t>(16, n + n / 2);
  if (cap <= slots_.size()) return;
  std::vector<Slot> old(cap, Slot{~0ull, V{}});
  old.swap(slots_);
  size_ = 0;
  bool inserted;
  for (const Slot& s : old)
    if (s.key != ~0ull) insert(s.key, s.val, &inserted);
}

template <typename V>
const V* Tokenizer::U64Map<V>::find(uint64_t k) const {
  if (slots_.empty()) return nullptr;
  for (size_t h = slot(k);;) {
    if (slots_[h].key == k) return &slots_[h].val;
    if (slots_[h].key == ~0ull) return nullptr;
    if (++h == slots_.size()) h = 0;
  }
}

template <typename V>
V* Tokenizer::U64Map<V>::insert(uint64_t k, const V& v, bool* inserted) {
  if (10 * (size_ + 1) > 7 * slots_.size()) reserve(2 * (size_ + 1));
  for (size_t h = slot(k);;) {
    Slot& s = slots_[h];
    if (s.key == k) {
      *inserted = false;
      return &s.val;
    }
    if (s.key == ~0ull) {
      s = Slot{k, v};
      ++size_;
      *inserted = true;
      return &s.val;
    }
    if (++h == slots_.size()) h = 0;
  }
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  size_t i = 0;
  while (i < s.size()) {
    uint32_t cp;
    int k = utf8::next(p, s.size(), i, &cp);
    if (k > 0) {
      out.append(s.substr(i, k));
      i += k;
    } else {
      out += "\xEF\xBF\xBD";
      if (k == 0) break;  // an unfinished tail is one maximal subpart
      i += -k;
    }
  }
  return out;
}

std::string Utf8Holder::push(std::string_view bytes) {
  held_.append(bytes);
  // Hold back an unfinished sequence at the end; everything before it can go.
  const auto* p = reinterpret_cast<const uint8_t*>(held_.data());
  size_t n = held_.size(), cut = n;
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    size_t i = n - back;
    if ((p[i] & 0xC0) != 0x80) {  // the last lead byte
      uint32_t cp;
      if (utf8::next(p, n, i, &cp) == 0) cut = i;
      break;
    }
  }
  std::string out = utf8_sanitize(std::string_view(held_).substr(0, cut));
  held_.erase(0, cut);
  return out;
}

std::string Utf8Holder::flush() {
  std::string out = utf8_sanitize(held_);
  held_.clear();
  return out;
}

}  // namespace dl
