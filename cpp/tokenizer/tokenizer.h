// Tokenizer for GGUF vocabularies: byte-level BPE ("gpt2") and SentencePiece-style BPE ("llama"),
// special-token matching, decoding, and a streaming UTF-8 holder. Built from plain vectors, so it
// knows nothing of GGUF; from_gguf (from_gguf.cpp) reads the metadata into those vectors.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace dl::gguf {
class File;
}

namespace dl {

enum class TokenType : int32_t {
  UNDEFINED = 0, NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6,
};

// Which split regex runs before byte-level BPE (see pretokenize.h).
enum class PreSplit { GPT2, LLAMA3, QWEN2, GPT4O };
PreSplit pre_split_from_name(const std::string& pre);  // tokenizer.ggml.pre -> split; unknown -> GPT2
// Splits UTF-8 text into pre-tokens (byte ranges [first, second)). Exposed for tests.
std::vector<std::pair<size_t, size_t>> pre_tokenize(std::string_view text, PreSplit split);

struct TokenizerConfig {
  std::string model;                   // "gpt2" or "llama"
  std::string pre;                     // tokenizer.ggml.pre ("" = default)
  std::vector<std::string> tokens;
  std::vector<float> scores;           // may be empty
  std::vector<int32_t> types;          // may be empty (all normal)
  std::vector<std::string> merges;     // "left right"; empty for SPM (derived from the vocabulary)
  int32_t bos = -1, eos = -1, unk = -1, pad = -1;
  bool add_bos = false, add_eos = false;
  bool add_space_prefix = false;       // SPM: prepend "▁" to the text
  // SPM as transformers builds it for Gemma: merge priority follows token order, not scores, and
  // tokens of several spaces (stored as real spaces) are spelled with "▁".
  bool gemma_style = false;
};

class Tokenizer {
 public:
  explicit Tokenizer(TokenizerConfig cfg);  // throws dl::Error on an inconsistent vocabulary
  // The vocabulary of tokenizer.ggml.* (from_gguf.cpp). spm_gemma: the family's quirk
  // (ArchTraits::spm_gemma), applied to a SentencePiece vocabulary; the tokenizer knows no
  // family, so model/model.cpp's load_tokenizer looks it up.
  static std::shared_ptr<Tokenizer> from_gguf(const gguf::File& f, bool spm_gemma);

  // add_special: BOS/EOS per the file's policy. parse_special: control tokens spelled in the text
  // become their ids (user-defined tokens always do, as in HF and llama.cpp).
  std::vector<int32_t> encode(std::string_view text, bool add_special = true,
                              bool parse_special = false) const;
  // Raw bytes of the decoded ids (may end inside a UTF-8 sequence). special: render control
  // tokens (and BOS/EOS/UNK/PAD) as their text; otherwise they give nothing, like HF's
  // skip_special_tokens=True and llama.cpp's default.
  std::string decode(const std::vector<int32_t>& ids, bool special = false) const;
  // The raw bytes one token stands for (control tokens: their text).
  std::string_view piece(int32_t id) const;
  // What `id` contributes to decode(): piece() or "" for a skipped special token.
  std::string_view render(int32_t id, bool special) const;

  int32_t n_vocab() const { return (int32_t)str_.size(); }
  int32_t bos() const { return bos_; }
  int32_t eos() const { return eos_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  bool is_byte_level() const { return byte_level_; }
  const std::string& model() const { return model_; }
  const std::string& pre() const { return pre_; }
  std::string_view token_text(int32_t id) const;  // as the file spells it
  TokenType token_type(int32_t id) const;
  int32_t token_to_id(std::string_view text) const;  // by file spelling; -1 if absent

 private:
  struct Merge { int32_t rank, result; };
  void check_id(int32_t id) const;
  void bpe_word(const int32_t* sym, size_t n, std::vector<int32_t>& out) const;
  void encode_text(std::string_view seg, bool first, std::vector<int32_t>& out) const;
  void build_spm_merges(const std::vector<float>& score);

  std::string model_, pre_;
  bool byte_level_ = false;
  PreSplit split_ = PreSplit::GPT2;
  // Every token's three strings (file spelling, raw bytes, what the BPE sees) are spans of one
  // byte arena; a string equal to the file spelling shares its bytes. A 262k vocabulary then
  // costs its text plus 24 bytes a token, not three heap strings a token.
  struct Span { uint32_t off, len; };
  struct TokenStr { Span text, piece, spell; };
  std::string arena_;
  std::vector<TokenStr> str_;
  std::string_view view(Span s) const { return std::string_view(arena_.data() + s.off, s.len); }
  std::string_view spell(int32_t id) const { return view(str_[id].spell); }
  std::vector<TokenType> types_;
  std::vector<bool> skip_;            // dropped by decode(special=false)
  // BPE spelling -> id: open addressing over ids (-1 empty), keys compared in the arena.
  std::vector<int32_t> vocab_;
  int32_t find_spell(std::string_view s) const;  // -1 if absent
  // uint64 -> value, open addressing (no node per entry); ~0 is never a key here.
  template <typename V>
  class U64Map {
   public:
    void reserve(size_t n);  // room for n keys at most ~0.7 full
    const V* find(uint64_t k) const;
    V* insert(uint64_t k, const V& v, bool* inserted);  // an existing key keeps its value
    size_t size() const { return size_; }
   private:
    struct Slot { uint64_t key; V val; };
    size_t slot(uint64_t k) const;
    std::vector<Slot> slots_;
    size_t size_ = 0;
  };
  U64Map<Merge> merges_;              // (left << 32 | right) -> rank, result
  int32_t byte_sym_[256];             // byte-level: byte -> id of its one-char token; SPM: <0xXX>
  int32_t bos_ = -1, eos_ = -1, unk_ = -1;
  bool add_bos_ = false, add_eos_ = false, add_space_prefix_ = false;
  // Added tokens matched in the raw text, leftmost-longest: a byte trie, edges in one hash map.
  struct TrieNode { int32_t id = -1; bool special = false; };
  std::vector<TrieNode> trie_;
  U64Map<int32_t> trie_edges_;        // (node << 8 | byte) -> child
  bool trie_first_[256] = {};
  size_t match_added(std::string_view text, size_t pos, int32_t* id, bool* special) const;
};

// Streaming: takes token pieces (raw bytes) and gives back only complete UTF-8 text, holding the
// bytes of an unfinished sequence for the next push. Invalid bytes become U+FFFD.
class Utf8Holder {
 public:
  std::string push(std::string_view bytes);
  std::string flush();  // what is held, invalid tail as U+FFFD
 private:
  std::string held_;
};

// Replaces invalid UTF-8 by U+FFFD (one per maximal invalid subpart, as Python and Rust do).
std::string utf8_sanitize(std::string_view s);

}  // namespace dl
