// The q8-mode decode GEMV for 1 to 4 tokens (NT: 1, 2 or 4 a variant), x rounded here: one
// dispatch where quant_act.comp + gemv_i8.comp are two with a barrier between them, and with the
// GLU before ffn down folded in, one where those are three. Each output is what gemv_i8.comp and
// gemm_i8.comp give it, bit for bit: x's blocks rounded by qact.glsl's code (quant_act.comp's),
// exact int8 block sums, and acc = fma(sum, dw * dx, acc) once a block in block order
// (`precise`), so a row's values do not depend on how many tokens share its step.
//
// A workgroup of 256 invocations owns rw rows (pc.rwcb & 255: 8, 16 or 32, the host's pick) of
// one of up to three weights (b0, b1 split the grid as in gemv.comp) and walks their blocks in
// chunks of cb (pc.rwcb >> 8; rw * cb <= PAIRS):
//  - first it issues its loads of the first chunk's weights, then rounds x (all n tokens, RMS
//    norm or GLU on the way) into shared memory, which hides the loads' latency;
//  - per chunk, each invocation takes P (row, block) pairs, adjacent invocations on adjacent
//    blocks of a row (16-byte loads, coalesced), computes the pair's exact block sum for each
//    token against x in shared memory and leaves it with the block's weight scale in a term
//    buffer, while the next chunk's weights are already loading;
//  - after one barrier, invocation (row, token) < rw * n adds the chunk's terms in block order
//    (4 blocks a 16-byte shared read); the buffers alternate, so the other invocations go on
//    to the next chunk meanwhile.
// flags: 1 x RMS-normed first (aux: the norm weight, or 0), 2 y += the product (the residual),
// 4 GLU: x = act(gate) * up (x the gate, w[1] up, y[1] their row strides low / high 32 bits,
// act in flags bits 8-15, ops.comp's codes), and the GLU's values written to w[2] by the last
// workgroup to finish (aux its counter, left at 0), as gemv.comp's GLU does.
// DOT=1: the packed 4x8 dot product (OpSDotKHR), else bytes.
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#include "common.glsl"
#include "qact.glsl"
#define T_Q8_0S 40  // dequant.glsl's type ids
#define T_Q4_0S 41
#if DOT
#extension GL_EXT_spirv_intrinsics : require
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int sdot4(uint a, uint b, spirv_literal int fmt);
#define DOT4(a, b) sdot4(a, b, 0)
#else
int DOT4(uint a, uint b) {
  int s = 0;
  [[unroll]] for (uint i = 0u; i < 4u; ++i) s += sbyte(a, i) * sbyte(b, i);
  return s;
}
#endif

layout(local_size_x = 256) in;
layout(push_constant, std430) uniform PC {
  uint64_t w[3], y[3];
  uint64_t x, aux;
  uint row_bytes;
  uint rows[3];
  uint cols, n, b0, b1, flags;
  float eps;
  uint rwcb;
} pc;

// Sizes under 32 KiB of shared memory a variant (the host mirrors PAIRS and NBX).
#if NT == 1
const uint PAIRS = 512u, NBX = 512u;  // (row, block) pairs a chunk; x's blocks at most
#elif NT == 2
const uint PAIRS = 256u, NBX = 256u;
#else
const uint PAIRS = 256u, NBX = 96u;
#endif
const uint P = PAIRS / 256u, SLOT = PAIRS + 128u;  // pairs an invocation; a term buffer's words (rw * (cb + 4))
shared uvec4 Xs[NT][2][NBX];        // x's quants: block b's bytes 0-15 at [t][0][b], 16-31 at [t][1][b]
shared vec4 Xd[NT][NBX / 4u];       // their scales (4 blocks a vec4), 0 past the last block
shared ivec4 Ss[2][NT][SLOT / 4u];  // a chunk's block sums: [buffer][token][row * (cb + 4) + block]
shared vec4 Ws[2][SLOT / 4u];       // the weight scales of the same (row, block)s
shared double red[256];             // the RMS norm's partial sums (qact.glsl's order)
shared bool glu_last;

uint s4(uint u) { return (u + 0x78787878u) ^ 0x80808080u; }  // gemm_i8.comp's
float i2f(int s) {  // gemm_i8.comp's exact block sum to float
  precise float f = intBitsToFloat(0x4B400000 + s) - 12582912.0f;
  return f;
}
#include "glu.glsl"

void main() {
  const uint tid = gl_LocalInvocationID.x;
  uint wg = gl_WorkGroupID.x, mi = 0u;
  if (wg >= pc.b0) {
    wg -= pc.b0, mi = 1u;
    if (wg >= pc.b1) wg -= pc.b1, mi = 2u;
  }
  const uint rows = pc.rows[mi], n = pc.n, nb = pc.cols / 32u;
  const uint rw = pc.rwcb & 0xffu, cb = pc.rwcb >> 8, cs = cb + 4u;  // rows, blocks a chunk, a row's stride in Ss / Ws
  const uint r0 = wg * rw;
  const uint64_t wbase = pc.w[mi];
  const bool norm = (pc.flags & 1u) != 0u, glu = (pc.flags & 4u) != 0u;
#if TYPE == T_Q8_0S
  const uint64_t scales = uint64_t(pc.cols);
#else
  const uint64_t scales = uint64_t(pc.cols / 2u);
#endif
  // This invocation's pairs: row lr[j] of the workgroup's, block lb[j] of each chunk.
  uint lr[P], lb[P];
  uint64_t wrow[P];
  [[unroll]] for (uint j = 0u; j < P; ++j) {
    const uint p = tid + 256u * j;
    lr[j] = p / cb, lb[j] = p % cb;
    wrow[j] = wbase + uint64_t(min(r0 + min(lr[j], rw - 1u), rows - 1u)) * pc.row_bytes;
  }
  uvec4 q[P][2];
  float dq[P];
#if TYPE == T_Q8_0S
#define LOADW(kb0, q, dq)                                                                          \
  [[unroll]] for (uint j = 0u; j < P; ++j) {                                                       \
    const uint b = (kb0) + lb[j];                                                                  \
    q[j][0] = uvec4(0u), q[j][1] = uvec4(0u), dq[j] = 0.0f;                                        \
    if (lr[j] < rw && b < nb) {                                                                    \
      q[j][0] = V4U(wrow[j] + uint64_t(b) * 32u).v[0];                                             \
      q[j][1] = V4U(wrow[j] + uint64_t(b) * 32u + 16u).v[0];                                       \
      dq[j] = h2f(rd16(wrow[j] + scales + uint64_t(b) * 2u));                                      \
    }                                                                                              \
  }
#else
#define LOADW(kb0, q, dq)                                                                          \
  [[unroll]] for (uint j = 0u; j < P; ++j) {                                                       \
    const uint b = (kb0) + lb[j];                                                                  \
    q[j][0] = uvec4(0x88888888u), dq[j] = 0.0f;                                                    \
    if (lr[j] < rw && b < nb) {                                                                    \
      q[j][0] = V4U(wrow[j] + uint64_t(b) * 16u).v[0];                                             \
      dq[j] = h2f(rd16(wrow[j] + scales + uint64_t(b) * 2u));                                      \
    }                                                                                              \
  }
#endif
  LOADW(0u, q, dq)

  // x rounded into shared memory: the RMS scales first where normed.
  const uint gs = uint(pc.y[1]), us = uint(pc.y[1] >> 32), act = (pc.flags >> 8) & 0xffu;
  float sc[NT];
  [[unroll]] for (uint t = 0u; t < NT; ++t) sc[t] = 1.0f;
  if (norm) {
    for (uint t = 0u; t < NT; ++t) {
      if (t >= n) break;
      red[tid] = qa_partial(F32(pc.x + uint64_t(t) * pc.cols * 4u), pc.cols, tid);
      barrier();
      for (uint h = 128u; h > 0u; h >>= 1) {
        if (tid < h) red[tid] += red[tid + h];
        barrier();
      }
      sc[t] = qa_scale(red[0], pc.cols, pc.eps);
      barrier();  // red[0] read before the next token's partials
    }
  }
  const uint nb4 = (nb + 3u) & ~3u;
  for (uint task = tid; task < n * nb4; task += 256u) {
    const uint t = task / nb4, b = task % nb4;
    float d = 0.0f;
    if (b < nb) {
      vec4 v[8];
      if (glu) {
        V4 gr = V4(pc.x + (uint64_t(t) * gs + b * 32u) * 4u), ur = V4(pc.w[1] + (uint64_t(t) * us + b * 32u) * 4u);
        [[unroll]] for (uint i = 0u; i < 8u; ++i) {
          const vec4 g = gr.v[i], u = ur.v[i];
          [[unroll]] for (uint c = 0u; c < 4u; ++c) v[i][c] = glu_act(act, g[c]) * u[c];
        }
      } else {
        V4 xr = V4(pc.x + (uint64_t(t) * pc.cols + b * 32u) * 4u);
        [[unroll]] for (uint i = 0u; i < 8u; ++i) v[i] = xr.v[i];
        if (norm) qa_norm(v, sc[min(t, NT - 1u)], pc.aux, b * 32u);
      }
      uint qw[8];
      d = qa_round(v, qw);
      Xs[t][0][b] = uvec4(qw[0], qw[1], qw[2], qw[3]);
      Xs[t][1][b] = uvec4(qw[4], qw[5], qw[6], qw[7]);
    }
    Xd[t][b / 4u][b % 4u] = d;
  }
  barrier();

  const bool chain = tid < rw * n;
  const uint crow = tid % rw, ctok = min(tid / rw, NT - 1u), cbase = crow * cs / 4u;
  float acc = 0.0f;
  uint buf = 0u;
  for (uint kb0 = 0u; kb0 < nb; kb0 += cb, buf ^= 1u) {
    uvec4 qn[P][2];
    float dn[P];
    const bool more = kb0 + cb < nb;
    if (more) LOADW(kb0 + cb, qn, dn)
    [[unroll]] for (uint j = 0u; j < P; ++j) {
      if (lr[j] >= rw) continue;
      const uint xb = min(kb0 + lb[j], nb - 1u), at = lr[j] * cs + lb[j];  // past nb: weights 0
      uvec4 w0, w1;
#if TYPE == T_Q8_0S
      w0 = q[j][0], w1 = q[j][1];
#else
      const uvec4 u = q[j][0];  // elements 0-15 low nibbles, 16-31 high
      w0 = uvec4(s4(u.x & 0x0F0F0F0Fu), s4(u.y & 0x0F0F0F0Fu), s4(u.z & 0x0F0F0F0Fu), s4(u.w & 0x0F0F0F0Fu));
      w1 = uvec4(s4((u.x >> 4) & 0x0F0F0F0Fu), s4((u.y >> 4) & 0x0F0F0F0Fu), s4((u.z >> 4) & 0x0F0F0F0Fu),
                 s4((u.w >> 4) & 0x0F0F0F0Fu));
#endif
      [[unroll]] for (uint t = 0u; t < NT; ++t) {
        if (t >= n) break;
        const uvec4 x0 = Xs[t][0][xb], x1 = Xs[t][1][xb];
        int s = 0;
        [[unroll]] for (uint c = 0u; c < 4u; ++c) s = DOT4(w0[c], x0[c]) + s;
        [[unroll]] for (uint c = 0u; c < 4u; ++c) s = DOT4(w1[c], x1[c]) + s;
        Ss[buf][t][at / 4u][at % 4u] = s;
      }
      Ws[buf][at / 4u][at % 4u] = dq[j];
    }
    barrier();  // the chunk's terms are in; the buffer written next was read a chunk ago
    if (chain) {
      const uint m4 = (min(cb, nb - kb0) + 3u) / 4u;  // blocks past nb: sum 0, scales 0
      for (uint k = 0u; k < m4; ++k) {
        const ivec4 s = Ss[buf][ctok][cbase + k];
        const vec4 wd = Ws[buf][cbase + k], xd = Xd[ctok][kb0 / 4u + k];
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
          precise float f = wd[i] * xd[i];
          precise float a = fma(i2f(s[i]), f, acc);
          acc = a;
        }
      }
    }
    if (more) q = qn, dq = dn;
  }
  if (chain && r0 + crow < rows) {
    F32 yp = F32(pc.y[mi] + (uint64_t(ctok) * rows + r0 + crow) * 4u);
    yp.v[0] = (pc.flags & 2u) != 0u ? yp.v[0] + acc : acc;
  }
  if (!glu) return;
  // Every workgroup has read its gate and up: the last one writes the GLU (out may be up).
  barrier();
  if (tid == 0u) {
    U32 cnt = U32(pc.aux);
    glu_last = atomicAdd(cnt.v[0], 1u) == gl_NumWorkGroups.x - 1u;
    if (glu_last) cnt.v[0] = 0u;
  }
  barrier();
  if (glu_last) glu_write(pc.x, pc.w[1], pc.w[2], gs, us, n, pc.cols, act, tid, 256u);
}
