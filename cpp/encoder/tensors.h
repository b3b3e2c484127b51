// Reading a tower's or a decoder's tensors from a GGUF (mmproj files, the whisper decoder),
// with errors that name the part being loaded ("audio tower", "vision tower", ...).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/backend.h"
#include "encoder/blocks.h"
#include "gguf/gguf.h"

namespace dl::encoder {

std::string shape_str(const gguf::TensorInfo& t);
// The tensor, or UnsupportedModelError.
const gguf::TensorInfo& need(const gguf::File& f, const std::string& name, const char* what);
// Throws unless t's type dequantizes rows of cols (a float or block type dividing cols).
void check_float_type(const gguf::TensorInfo& t, int64_t cols, const char* what);
// A 1-D parameter (bias, norm) of exactly n elements, whatever its nominal shape, as floats;
// empty when absent and not required.
std::vector<float> vec(const gguf::File& f, const std::string& name, int64_t n, const char* what,
                       bool required = true);
// A matrix of `rows` rows of `cols` (-1: any), read in place (Weight::host into the file). A
// tensor of 3 or 4 dims reads its last dim as rows and the others, flattened, as columns (a
// conv kernel [k, c_in, c_out] as c_out rows of k * c_in, im2col's order). Empty when absent
// and not required.
Weight mat(const gguf::File& f, const std::string& name, int64_t rows, int64_t cols, const char* what,
           bool required = true);
// One encoder block's weights under `prefix` (e.g. "a.blk.3."): ln1 / ln2, attn_{q,k,v,out} and
// ffn_{up,down}, with biases (attn_k.bias may be absent: whisper's keys have none), vectors
// uploaded to be. ffn_dim < 0: any width, set from ffn_up.
Layer load_layer(Backend& be, const gguf::File& f, const std::string& prefix, int64_t d, int64_t& ffn_dim,
                 const char* what);
// An integer key in [0, 2^20], or def when absent.
int meta_int(const gguf::File& f, const std::string& key, int def);

}  // namespace dl::encoder
