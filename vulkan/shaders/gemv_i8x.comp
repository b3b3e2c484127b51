// The q8-mode decode GEMV for 1 to 4 tokens over the int8 activations quant_act.comp rounded
// (DASLLAMA_VULKAN_GEMVI8=2; 3: SWAP=0, 4: PF=2; gemv_i8.comp's outputs bit for bit): y[t][r] = the block terms
// isum(W[r][b], xq[t][b]) * (dw * dx) added in block order into one accumulator by one fused
// multiply-add each (`precise`), as gemv_i8.comp and gemm_i8.comp add them, so a row's values
// do not depend on how many tokens share its step.
//
// Laid out for a GPU's memory system rather than for shared-memory reuse: a workgroup is one
// 32-wide subgroup (on NVIDIA a warp; any width works: the exchanges go through shared memory
// and barrier()) owning R rows of one of up to three weights (b0, b1 split the grid as in
// gemv.comp) and NT tokens (grid y); it walks k in windows of 32 blocks:
//  - each invocation loads its 16-byte units of every row straight from global memory, the
//    units of a row adjacent across invocations (q8_0: units l and l + 32 of the window's 64,
//    so each load instruction reads 512 contiguous bytes; q4_0: block l, 16 bytes), and the
//    next window's loads are issued before this window's math, so two windows of all R rows
//    are in flight (a 2048-wide row's whole 64 blocks; PF=2: the next two, three in flight);
//  - q8_0: invocations 2k and 2k + 1 hold the halves of blocks k and 16 + k; they swap one half
//    each through shared memory (a barrier), so each finishes one block's exact sum;
//  - each invocation writes the exact block sum (as a float) and its scale dw * dx for every
//    (row, token) into a term buffer; after one barrier, invocation o < R * NT adds output o's
//    32 terms in block order from it (vec4 reads); the buffers alternate, so one barrier a
//    window suffices for them (q8_0's swap takes a second).
// flags 1: y += the product (the residual). DOT=1: the packed 4x8 dot product (OpSDotKHR), else bytes.
// flags 2 (one weight; DASLLAMA_VULKAN_NORMTAIL=1): the last workgroup to finish then rounds y,
// RMS-normed (times nw where not 0), into the int8 scratch at xq as quant_act.comp would
// (qact.glsl, its order), for the next matmul: that quant_act's dispatch and barrier taken back.
// flags 4 (two weights, gate and up, of equal height a multiple of 32; DASLLAMA_VULKAN_GLUTAIL,
// on by default): the last of the 2 * 32 / R workgroups that wrote a 32-row block of gate and of
// up (a counter a block) computes that block's act(gate) * up as ops.comp's glu does (act in
// flags bits 8-15), writes it to y[2] and rounds it as quant_act.comp would into the int8
// scratch at w[2] (quants [n][rows], then at the next 256 bytes the scales [n][rows / 32]) for
// ffn down: the glu's dispatch (or quant_act32, which had it folded in) and its barrier taken back.
// flags 8 (three weights, Q, K and V, heads of head_dim rows, a multiple of R; DASLLAMA_VULKAN_KVTAIL,
// on by default): the step's ropes and KV store folded in. The last workgroup to finish a query
// head's rows rotates them in place; the last of a KV head's K and V workgroups rotates its keys
// (written back to k, as the rope would have left them) and stores the head's keys and values
// into the cache row through the block table, each as kv_store.comp would (rope_cs, f2h, q8_0's
// blocks): the kv_store dispatch (which had the ropes folded in) and its barrier taken back. The
// store's parameters lie in a block at nw (KvP); a counter a head at cnt (queries', then KV heads').
#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
#include "common.glsl"
#include "qact.glsl"
#define T_Q8_0S 40  // dequant.glsl's type ids
#define T_Q4_0S 41
// q8_0's loads: SWAP=1 (default) units l and l + 32 (each load instruction 512 contiguous bytes,
// halves swapped as below); SWAP=0 both units of block l (32 contiguous bytes a lane: each load
// instruction reads every other 16 bytes of 1 KiB, the second the rest, no swap nor its barrier).
#ifndef SWAP
#define SWAP 1
#endif
#define PAIRS (TYPE == T_Q8_0S && SWAP == 1)
#ifndef PF
#define PF 1  // windows loaded ahead
#endif
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

layout(local_size_x = 32) in;
layout(push_constant, std430) uniform PC {
  uint64_t w[3], y[3];
  uint64_t xq, xd;  // quant_act's output: int8 [n][cols], f32 scales [n][cols / 32]
  uint64_t row_bytes;
  uint rows[3];
  uint cols, n, b0, b1, flags;
  uint64_t nw, cnt;  // flags 2: the norm weight (or 0) and the last workgroup's counter (left at 0)
  float eps;
} pc;
shared double red[256];  // flags 2: the row's partial sums of squares (qact.glsl's order)
shared bool tail_last;
float glu_act(uint act, float g) { return act == 5u ? silu(g) : act == 6u ? gelu_tanh(g) : max(g, 0.0f); }  // quant_act.comp's

const uint WB = 32u;                  // blocks a window
const uint NO = R * NT;               // outputs a workgroup (<= 32: one chain an invocation)
const uint ST = WB + 4u;              // an output's stride in the term buffers (words): the chains'
                                      // vec4 reads of 8 adjacent outputs on distinct banks
shared vec4 Sf[2][NO][ST / 4u];       // exact block sums as floats
shared vec4 Sc[2][NO][ST / 4u];       // their scales dw * dx
#if PAIRS
shared int Sh[NO][32];                // q8_0: the half-block sums a pair of invocations swaps
#endif
// The tails' scratch lives in shared arrays the GEMV is done with by then (no more shared memory
// a workgroup, so no fewer workgroups resident): a float kept in a double is exact.
#define GLU_V(t, i) red[(t) * 32u + (i)]     // flags 4: a block's GLU values, 32 a token
#define KV_H(e) red[e]                       // flags 8: a head's row (keys rotated here, then values)
#define KV_AMAX(i) Sf[0][0][(i) / 4u][(i) % 4u]  // flags 8: a q8_0 block's |x| (ST >= 32)
#include "kvtail.glsl"
#if TYPE == T_Q8_0S
const uint QU = 2u;                   // 16-byte units an invocation loads a row and window
#else
const uint QU = 1u;
#endif

uint s4(uint u) { return (u + 0x78787878u) ^ 0x80808080u; }  // gemm_i8.comp's
float i2f(int s) {  // gemm_i8.comp's exact block sum to float
  precise float f = intBitsToFloat(0x4B400000 + s) - 12582912.0f;
  return f;
}

void main() {
  const uint l = gl_LocalInvocationID.x;
  uint wg = gl_WorkGroupID.x, mi = 0u;
  if (wg >= pc.b0) {
    wg -= pc.b0, mi = 1u;
    if (wg >= pc.b1) wg -= pc.b1, mi = 2u;
  }
  const uint rows = pc.rows[mi], nb = pc.cols / 32u, r0 = wg * R;
  const uint t0 = gl_WorkGroupID.y * NT, nt = min(NT, pc.n - t0);
#if PAIRS
  const uint64_t scales = uint64_t(pc.cols);
  // Units l and l + 32 of the window: blocks l / 2 and 16 + l / 2, halves l % 2. The block whose
  // sum (and term) this invocation finishes: the first for even l, the second for odd.
  const uint bw = (l & 1u) == 0u ? l >> 1 : 16u + (l >> 1);
#elif TYPE == T_Q8_0S
  const uint64_t scales = uint64_t(pc.cols);
  const uint bw = l;
#else
  const uint64_t scales = uint64_t(pc.cols / 2u);
  const uint bw = l;
#endif
  uint64_t wrow[R];
  [[unroll]] for (uint r = 0u; r < R; ++r) wrow[r] = pc.w[mi] + uint64_t(min(r0 + r, rows - 1u)) * pc.row_bytes;

  // A window's loads (blocks past the row read its last block; their terms are never added).
  uvec4 q[R][QU], x[NT][2];
  float dw[R], dx[NT];
#if TYPE == T_Q8_0S
#if PAIRS
#define UNITS(kb0)                                                                                    \
  const uint ua = min(2u * (kb0) + l, 2u * nb - 1u), ub = min(2u * (kb0) + 32u + l, 2u * nb - 1u);
#else
#define UNITS(kb0)                                                                                    \
  const uint ua = 2u * min((kb0) + l, nb - 1u), ub = ua + 1u;
#endif
#define LOADW(kb0, q, dw, x, dx)                                                                   \
  {                                                                                                \
    UNITS(kb0)                                                                                       \
    const uint bs = min((kb0) + bw, nb - 1u);                                                      \
    [[unroll]] for (uint r = 0u; r < R; ++r) {                                                     \
      q[r][0] = V4U(wrow[r] + uint64_t(ua) * 16u).v[0];                                            \
      q[r][1] = V4U(wrow[r] + uint64_t(ub) * 16u).v[0];                                            \
      dw[r] = h2f(rd16(wrow[r] + scales + uint64_t(bs) * 2u));                                     \
    }                                                                                              \
    [[unroll]] for (uint t = 0u; t < NT; ++t) {                                                    \
      const uint64_t xr = pc.xq + uint64_t(t0 + min(t, nt - 1u)) * pc.cols;                        \
      x[t][0] = V4U(xr + uint64_t(ua) * 16u).v[0];                                                 \
      x[t][1] = V4U(xr + uint64_t(ub) * 16u).v[0];                                                 \
      dx[t] = F32(pc.xd + (uint64_t(t0 + min(t, nt - 1u)) * nb + bs) * 4u).v[0];                   \
    }                                                                                              \
  }
#else
#define LOADW(kb0, q, dw, x, dx)                                                                   \
  {                                                                                                \
    const uint bs = min((kb0) + l, nb - 1u);                                                       \
    [[unroll]] for (uint r = 0u; r < R; ++r) {                                                     \
      q[r][0] = V4U(wrow[r] + uint64_t(bs) * 16u).v[0];                                            \
      dw[r] = h2f(rd16(wrow[r] + scales + uint64_t(bs) * 2u));                                     \
    }                                                                                              \
    [[unroll]] for (uint t = 0u; t < NT; ++t) {                                                    \
      const uint64_t xr = pc.xq + uint64_t(t0 + min(t, nt - 1u)) * pc.cols + uint64_t(bs) * 32u;   \
      x[t][0] = V4U(xr).v[0];                                                                      \
      x[t][1] = V4U(xr + 16u).v[0];                                                                \
      dx[t] = F32(pc.xd + (uint64_t(t0 + min(t, nt - 1u)) * nb + bs) * 4u).v[0];                   \
    }                                                                                              \
  }
#endif
  LOADW(0u, q, dw, x, dx)
#if PF == 2
  // PF=2: two windows ahead in flight, not one (long rows: ffn down's 8192 columns).
  uvec4 q1[R][QU], x1[NT][2];
  float dw1[R], dx1[NT];
  if (WB < nb) LOADW(WB, q1, dw1, x1, dx1)
#endif

  const uint o = l, orow = o % R, otok = o / R;
  const bool chain = o < NO && otok < nt && r0 + orow < rows;
  float acc = 0.0f;
  uint buf = 0u;
  for (uint kb0 = 0u; kb0 < nb; kb0 += WB, buf ^= 1u) {
    uvec4 qn[R][QU], xn[NT][2];
    float dwn[R], dxn[NT];
#if PF == 2
    const bool more = kb0 + WB < nb;
    if (kb0 + 2u * WB < nb) LOADW(kb0 + 2u * WB, qn, dwn, xn, dxn)
#else
    const bool more = kb0 + WB < nb;
    if (more) LOADW(kb0 + WB, qn, dwn, xn, dxn)
#endif
#if TYPE == T_Q8_0S && !PAIRS
    [[unroll]] for (uint r = 0u; r < R; ++r)
      [[unroll]] for (uint t = 0u; t < NT; ++t) {
        if (t >= nt) break;
        int s = 0;
        [[unroll]] for (uint c = 0u; c < 4u; ++c) s = DOT4(q[r][0][c], x[t][0][c]) + s;
        [[unroll]] for (uint c = 0u; c < 4u; ++c) s = DOT4(q[r][1][c], x[t][1][c]) + s;
        precise float sc = dw[r] * dx[t];
        Sf[buf][t * R + r][bw / 4u][bw % 4u] = i2f(s);
        Sc[buf][t * R + r][bw / 4u][bw % 4u] = sc;
      }
#elif PAIRS
    // Half-block sums: p[0] of unit l (block l / 2), p[1] of unit l + 32 (block 16 + l / 2).
    // Even l keeps its first and hands its second to l + 1; odd l the other way round.
    int keep[R][NT];
    [[unroll]] for (uint r = 0u; r < R; ++r)
      [[unroll]] for (uint t = 0u; t < NT; ++t) {
        if (t >= nt) break;
        int p0 = 0, p1 = 0;
        [[unroll]] for (uint c = 0u; c < 4u; ++c) p0 = DOT4(q[r][0][c], x[t][0][c]) + p0;
        [[unroll]] for (uint c = 0u; c < 4u; ++c) p1 = DOT4(q[r][1][c], x[t][1][c]) + p1;
        keep[r][t] = (l & 1u) == 0u ? p0 : p1;
        Sh[t * R + r][l] = (l & 1u) == 0u ? p1 : p0;
      }
    barrier();  // the swapped halves are in (and the last window's reads of Sh are done: see below)
    [[unroll]] for (uint r = 0u; r < R; ++r)
      [[unroll]] for (uint t = 0u; t < NT; ++t) {
        if (t >= nt) break;
        const uint oi = t * R + r;
        // even l: its block's second half is odd l + 1's first; odd l: its block's first half is
        // even l - 1's second.
        const int s = (l & 1u) == 0u ? keep[r][t] + Sh[oi][l + 1u] : Sh[oi][l - 1u] + keep[r][t];
        precise float sc = dw[r] * dx[t];
        Sf[buf][oi][bw / 4u][bw % 4u] = i2f(s);
        Sc[buf][oi][bw / 4u][bw % 4u] = sc;
      }
#else
    [[unroll]] for (uint r = 0u; r < R; ++r) {
      const uvec4 u = q[r][0];  // elements 0-15 low nibbles, 16-31 high
      const uvec4 w0 = uvec4(s4(u.x & 0x0F0F0F0Fu), s4(u.y & 0x0F0F0F0Fu), s4(u.z & 0x0F0F0F0Fu), s4(u.w & 0x0F0F0F0Fu));
      const uvec4 w1 = uvec4(s4((u.x >> 4) & 0x0F0F0F0Fu), s4((u.y >> 4) & 0x0F0F0F0Fu), s4((u.z >> 4) & 0x0F0F0F0Fu),
                             s4((u.w >> 4) & 0x0F0F0F0Fu));
      [[unroll]] for (uint t = 0u; t < NT; ++t) {
        if (t >= nt) break;
        const uvec4 x0 = x[t][0], x1 = x[t][1];
        int s = 0;
        [[unroll]] for (uint c = 0u; c < 4u; ++c) s = DOT4(w0[c], x0[c]) + s;
        [[unroll]] for (uint c = 0u; c < 4u; ++c) s = DOT4(w1[c], x1[c]) + s;
        precise float sc = dw[r] * dx[t];
        Sf[buf][t * R + r][bw / 4u][bw % 4u] = i2f(s);
        Sc[buf][t * R + r][bw / 4u][bw % 4u] = sc;
      }
    }
#endif
    barrier();  // the window's terms are in; the buffer written next was read a window ago
    if (chain) {
      const uint m = min(WB, nb - kb0);
      [[unroll]] for (uint k4 = 0u; k4 < WB / 4u; ++k4) {
        const vec4 f = Sf[buf][o][k4], c = Sc[buf][o][k4];
        [[unroll]] for (uint i = 0u; i < 4u; ++i) {
          if (k4 * 4u + i < m) {
            precise float a = fma(f[i], c[i], acc);
            acc = a;
          }
        }
      }
    }
#if PF == 2
    if (more) q = q1, dw = dw1, x = x1, dx = dx1;
    if (kb0 + 2u * WB < nb) q1 = qn, dw1 = dwn, x1 = xn, dx1 = dxn;
#else
    if (more) q = qn, dw = dwn, x = xn, dx = dxn;
#endif
  }
  if (chain) {
    F32C yp = F32C(pc.y[mi] + (uint64_t(t0 + otok) * rows + r0 + orow) * 4u);
    yp.v[0] = (pc.flags & 1u) != 0u ? yp.v[0] + acc : acc;
  }
  if ((pc.flags & 4u) != 0u) {
    // Every workgroup has all the tokens (grid y is 1) and R rows of one 32-row block.
    const uint blk = r0 / 32u;
    memoryBarrierBuffer();
    barrier();
    if (l == 0u) {
      U32 c = U32(pc.cnt + uint64_t(blk) * 4u);
      const uint done = atomicAdd(c.v[0], 1u);
      tail_last = done == 2u * (32u / R) - 1u;
      if (tail_last) c.v[0] = 0u;  // both weights' workgroups have counted: ready for the next dispatch
    }
    barrier();
    if (!tail_last) return;
    memoryBarrierBuffer();
    const uint act = (pc.flags >> 8) & 0xffu, dim = rows, nbq = dim / 32u;
    for (uint t = 0u; t < pc.n; ++t) {
      const uint64_t e = uint64_t(t) * dim + blk * 32u + l;
      const float g = F32C(pc.y[0] + e * 4u).v[0], u = F32C(pc.y[1] + e * 4u).v[0];
      const float v = glu_act(act, g) * u;
      F32(pc.y[2] + e * 4u).v[0] = v;
      GLU_V(t, l) = v;
    }
    barrier();
    if (l < pc.n) {  // token l's block: qact.glsl's rounding, as quant_act.comp rounds it
      vec4 v[8];
      [[unroll]] for (uint i = 0u; i < 8u; ++i)
        v[i] = vec4(GLU_V(l, 4u * i), GLU_V(l, 4u * i + 1u), GLU_V(l, 4u * i + 2u), GLU_V(l, 4u * i + 3u));
      uint w[8];
      const float d = qa_round(v, w);
      const uint64_t qb = (uint64_t(pc.n) * dim + 255u) & ~uint64_t(255);
      V4U q = V4U(pc.w[2] + uint64_t(l) * dim + uint64_t(blk) * 32u);
      q.v[0] = uvec4(w[0], w[1], w[2], w[3]);
      q.v[1] = uvec4(w[4], w[5], w[6], w[7]);
      F32(pc.w[2] + qb + (uint64_t(l) * nbq + blk) * 4u).v[0] = d;
    }
    return;
  }
  if ((pc.flags & 8u) != 0u) {
    KvP P = KvP(pc.nw);
    const uint hd = P.head_dim, nq = pc.rows[0] / hd, head = r0 / hd;
    memoryBarrierBuffer();
    barrier();
    if (l == 0u) {
      U32 c = U32(pc.cnt + uint64_t(mi == 0u ? head : nq + head) * 4u);
      const uint done = atomicAdd(c.v[0], 1u);
      tail_last = done == (mi == 0u ? 1u : 2u) * (hd / R) - 1u;
      if (tail_last) c.v[0] = 0u;  // every workgroup of the head has counted: ready for the next dispatch
    }
    barrier();
    if (!tail_last) return;
    memoryBarrierBuffer();
    kv_tail(P, mi, head, pc.n, pc.y[0], pc.y[1], pc.y[2], pc.rows[0], pc.rows[1], pc.rows[2], l, 32u);
    return;
  }
  if ((pc.flags & 2u) == 0u) return;
  // The last workgroup rounds y for the next matmul (quant_act.comp's norm path, step for step).
  memoryBarrierBuffer();
  barrier();
  if (l == 0u) {
    U32 c = U32(pc.cnt);
    const uint done = atomicAdd(c.v[0], 1u);
    tail_last = done == gl_NumWorkGroups.x * gl_NumWorkGroups.y - 1u;
    if (tail_last) c.v[0] = 0u;  // every workgroup has counted: ready for the next dispatch
  }
  barrier();
  if (!tail_last) return;
  memoryBarrierBuffer();
  const uint cols = rows, nbq = cols / 32u;  // y's width: the next matmul's
  const uint64_t qb = (uint64_t(pc.n) * cols + 255u) & ~uint64_t(255);
  for (uint t = 0u; t < pc.n; ++t) {
    const uint64_t yr = pc.y[0] + uint64_t(t) * cols * 4u;
    // Invocation l sums for qact.glsl's lanes l + 32 j (j < 8), each over its elements in
    // order (qa_partial's sums), 8 of each lane's loads in flight at once, not one.
    F32C yv = F32C(yr);
    precise double ss[8];
    [[unroll]] for (uint j = 0u; j < 8u; ++j) ss[j] = 0.0lf;
    for (uint i0 = 0u; i0 < cols; i0 += 2048u) {
      float e[8][8];
      [[unroll]] for (uint k = 0u; k < 8u; ++k)
        [[unroll]] for (uint j = 0u; j < 8u; ++j) {
          const uint i = i0 + 256u * k + 32u * j + l;
          e[k][j] = i < cols ? yv.v[i] : 0.0f;
        }
      [[unroll]] for (uint k = 0u; k < 8u; ++k)
        [[unroll]] for (uint j = 0u; j < 8u; ++j)
          if (i0 + 256u * k + 32u * j + l < cols) ss[j] += double(e[k][j]) * double(e[k][j]);
    }
    [[unroll]] for (uint j = 0u; j < 8u; ++j) red[32u * j + l] = ss[j];
    barrier();
    for (uint h = 128u; h > 0u; h >>= 1) {
      for (uint v = l; v < h; v += 32u) red[v] += red[v + h];
      barrier();
    }
    const float sc = qa_scale(red[0], cols, pc.eps);
    barrier();  // red[0] read before the next token's partials
    for (uint b = l; b < nbq; b += 32u) {
      F32C xr = F32C(yr + uint64_t(b) * 128u);
      vec4 v[8];
      [[unroll]] for (uint i = 0u; i < 8u; ++i) v[i] = vec4(xr.v[4u * i], xr.v[4u * i + 1u], xr.v[4u * i + 2u], xr.v[4u * i + 3u]);
      qa_norm(v, sc, pc.nw, b * 32u);
      uint w[8];
      const float d = qa_round(v, w);
      V4U q = V4U(pc.xq + uint64_t(t) * cols + uint64_t(b) * 32u);
      q.v[0] = uvec4(w[0], w[1], w[2], w[3]);
      q.v[1] = uvec4(w[4], w[5], w[6], w[7]);
      F32(pc.xq + qb + (uint64_t(t) * nbq + b) * 4u).v[0] = d;
    }
  }
}
