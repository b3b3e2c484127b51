// y[t][r] = sum_k W[r][k] x[t][k]: an invocation per (4 weight rows, 8 tokens) walks the rows
// serially, decoding each 8-element group once and reusing every x value for 4 rows (a 4x8
// register tile). No shared memory and no barriers: cheap on lavapipe (where loads are per-lane
// gathers and a barrier is a coroutine switch), and the x reads are the same for the whole
// workgroup (a broadcast on a GPU). One kernel for decode and prefill (the plain path).
// Built with -DMOE it is matmul_id: workgroup row y is one (token, slot) pair, whose expert
// ids[p] picks the slice of the expert stack it reads (plus that expert's bias, if any).
#version 450
#include "common.glsl"
#include "dequant.glsl"

#ifdef SG
// The subgroup path (-DSG, for devices with subgroup arithmetic): a subgroup per weight row, its
// lanes taking 8-element groups in turn (adjacent lanes read adjacent bytes: coalesced), the
// partial sums joined by subgroupAdd. rows * subgroup-size invocations instead of rows / 4: what
// a GPU needs to stream the weights at its bandwidth in decode. Any subgroup size works; a
// workgroup holds RW rows, looped over when it has fewer subgroups than that.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
layout(local_size_x = 128) in;
#else
layout(local_size_x = 64) in;
#endif
#ifdef MOE
layout(push_constant, std430) uniform PC {
  uint64_t w, x, y;
  uint64_t row_bytes;
  uint64_t ids, bias;
  uint rows, cols, x_div, pair_base;  // rows: one expert's; pair_base: the pair count when GROUPED
} pc;
#ifdef GROUPED
const uint NT = 8u, NR = 4u;
#else
const uint NT = 1u, NR = 4u;
#endif
#elif defined(SG)
// Up to three weights of one type and width against the same x (matmul_multi: Q/K/V, gate/up)
// in one dispatch: workgroups [0, b0) take weight 0, the next b1 weight 1, the rest weight 2.
// Each row is computed exactly as alone.
// matmul_step fuses into it too: x RMS-normed on the way (flags bit 0; times norm_w when set:
// each subgroup sums the squares of the x it reads, which is all of it), and the result added
// into y (bit 1, the residual).
layout(push_constant, std430) uniform PC {
  uint64_t w[3], y[3];
  uint64_t x, row_bytes, norm_w;
  uint rows[3];
  uint cols, n, b0, b1, flags;
  float eps;
} pc;
const uint NT = 8u, NR = 4u;
#else
layout(push_constant, std430) uniform PC {
  uint64_t w, x, y;
  uint64_t row_bytes;
  uint rows, cols, n, pad_;
} pc;
const uint NT = 8u, NR = 4u;
#endif

#ifdef SG
const uint RW = 4u;
#ifdef GROUPED
// matmul_id for prefill and batched steps: a workgroup per (expert, RW rows) gathers the pairs
// routed to its expert, then streams each of its rows once per NT of them, so an expert is read
// once per 8 tokens, not once per token. Each pair's sum runs as in the ungrouped kernel.
shared uint plist[4096];
shared uint pcount;
#endif

void main() {
#ifdef MOE
  const uint rows = pc.rows, wg = gl_WorkGroupID.x;
#ifdef GROUPED
  const uint e = gl_WorkGroupID.y;
  if (gl_LocalInvocationID.x == 0u) pcount = 0u;
  barrier();
  for (uint q = gl_LocalInvocationID.x; q < pc.pair_base; q += gl_WorkGroupSize.x)  // pair_base: the pair count
    if (uint(I32(pc.ids).v[q]) == e) plist[atomicAdd(pcount, 1u)] = q;
  barrier();
  const uint total = pcount;
#else
  const uint e = uint(I32(pc.ids).v[pc.pair_base + gl_WorkGroupID.y]);
  const uint total = 1u;
#endif
  const uint64_t wbase = pc.w + uint64_t(e) * pc.rows * pc.row_bytes;
#else
  uint wg = gl_WorkGroupID.x, mi = 0u;
  if (wg >= pc.b0) {
    wg -= pc.b0, mi = 1u;
    if (wg >= pc.b1) wg -= pc.b1, mi = 2u;
  }
  const uint rows = pc.rows[mi];
  const uint64_t wbase = pc.w[mi];
  const uint total = min(NT, pc.n - gl_WorkGroupID.y * NT);
#endif
  const uint ng = (pc.cols + 7u) / 8u;
  const bool xvec = pc.cols % 8u == 0u && (pc.x & 15ul) == 0ul;  // every x row 16-byte aligned
  for (uint c0 = 0u; c0 < total; c0 += NT) {
    // This pass's x rows and y rows (row 0 of each output vector).
    const uint nt = min(NT, total - c0);
    uint64_t xa[NT], ya[NT];
    [[unroll]] for (uint t = 0u; t < NT; ++t) {
      const uint tt = c0 + min(t, nt - 1u);
#ifdef MOE
#ifdef GROUPED
      const uint p = plist[tt];
#else
      const uint p = pc.pair_base + gl_WorkGroupID.y;
#endif
      xa[t] = pc.x + uint64_t(p / pc.x_div) * pc.cols * 4u;
      ya[t] = pc.y + uint64_t(p) * pc.rows * 4u;
#else
      const uint tok = gl_WorkGroupID.y * NT + tt;
      xa[t] = pc.x + uint64_t(tok) * pc.cols * 4u;
      ya[t] = pc.y[mi] + uint64_t(tok) * rows * 4u;
#endif
    }
    for (uint rr = gl_SubgroupID; rr < RW; rr += gl_NumSubgroups) {
      const uint r = wg * RW + rr;
      if (r >= rows) break;  // the same r in the whole subgroup
      const uint64_t row = wbase + uint64_t(r) * pc.row_bytes;
      float acc[NT], ss[NT];
      [[unroll]] for (uint t = 0u; t < NT; ++t) acc[t] = 0.0f, ss[t] = 0.0f;
#ifdef MOE
      const bool norm = false;
#else
      const bool norm = (pc.flags & 1u) != 0u;
#endif
      // Two groups a lane per pass, both decoded before either is used: their loads are in
      // flight together (a GPU does not overlap a loop's iterations on its own). Each group's
      // products are summed in element order either way.
      const uint S = gl_SubgroupSize;
      for (uint g0 = gl_SubgroupInvocationID; g0 < ng; g0 += 2u * S) {
        float v[2][8];
        dq8(row, g0, pc.cols, v[0]);
        const bool two = g0 + S < ng;
        if (two) dq8(row, g0 + S, pc.cols, v[1]);
        [[unroll]] for (uint u = 0u; u < 2u; ++u) {
          if (u == 1u && !two) break;
          const uint e0 = (g0 + u * S) * 8u;
          const uint ne = min(8u, pc.cols - e0);
          [[unroll]] for (uint t = 0u; t < NT; ++t) {
            if (t >= nt) break;
            const uint64_t xe = xa[t] + uint64_t(e0) * 4u;
            float xv[8];
            if (xvec) {  // two 16-byte loads
              V4 xr = V4(xe);
              const vec4 a = xr.v[0], b = xr.v[1];
              xv[0] = a.x, xv[1] = a.y, xv[2] = a.z, xv[3] = a.w, xv[4] = b.x, xv[5] = b.y, xv[6] = b.z, xv[7] = b.w;
            } else {
              F32 xr = F32(xe);
              [[unroll]] for (uint i = 0u; i < 8u; ++i) xv[i] = i < ne ? xr.v[i] : 0.0f;
            }
#ifndef MOE
            if (norm) {
              [[unroll]] for (uint i = 0u; i < 8u; ++i) ss[t] += xv[i] * xv[i];  // xv is 0 past cols
              if (pc.norm_w != 0ul) {
                F32 nw = F32(pc.norm_w + uint64_t(e0) * 4u);
                [[unroll]] for (uint i = 0u; i < 8u; ++i) xv[i] *= i < ne ? nw.v[i] : 0.0f;
              }
            }
#endif
            [[unroll]] for (uint i = 0u; i < 8u; ++i) {
              if (i >= ne) break;
              acc[t] += v[u][i] * xv[i];
            }
          }
        }
      }
      [[unroll]] for (uint t = 0u; t < NT; ++t) {
        if (t >= nt) break;
        float s = subgroupAdd(acc[t]);
#ifndef MOE
        if (norm) s *= 1.0f / sqrt(subgroupAdd(ss[t]) / float(pc.cols) + pc.eps);
#endif
#ifdef MOE
        if (subgroupElect())
          F32(ya[t] + uint64_t(r) * 4u).v[0] = s + (pc.bias != 0ul ? F32(pc.bias).v[e * rows + r] : 0.0f);
#else
        if (subgroupElect()) {
          F32 yo = F32(ya[t] + uint64_t(r) * 4u);
          yo.v[0] = (pc.flags & 2u) != 0u ? yo.v[0] + s : s;
        }
#endif
      }
    }
  }
}
#else
void main() {
  const uint r0 = gl_GlobalInvocationID.x * NR;
  if (r0 >= pc.rows) return;
#ifdef MOE
  const uint p = pc.pair_base + gl_WorkGroupID.y;
  const uint e = uint(I32(pc.ids).v[p]);
  const uint64_t wbase = pc.w + uint64_t(e) * pc.rows * pc.row_bytes;
  const uint64_t xbase = pc.x + uint64_t(p / pc.x_div) * pc.cols * 4u;
  const uint64_t ybase = pc.y + uint64_t(p) * pc.rows * 4u;
  const uint t0 = 0u, nt = 1u;
#else
  const uint64_t wbase = pc.w, xbase = pc.x, ybase = pc.y;
  const uint t0 = gl_WorkGroupID.y * NT;
  const uint nt = min(NT, pc.n - t0);
#endif
  uint64_t row[NR];
  // Rows past the end repeat the last one (computed, not stored).
  [[unroll]] for (uint j = 0u; j < NR; ++j) row[j] = wbase + uint64_t(min(r0 + j, pc.rows - 1u)) * pc.row_bytes;
  const uint ng = (pc.cols + 7u) / 8u;
  float acc[NR][NT];
  [[unroll]] for (uint j = 0u; j < NR; ++j)
    [[unroll]] for (uint t = 0u; t < NT; ++t) acc[j][t] = 0.0f;
  for (uint g = 0u; g < ng; ++g) {
    float v[NR][8];
    [[unroll]] for (uint j = 0u; j < NR; ++j) dq8(row[j], g, pc.cols, v[j]);
    const uint e0 = g * 8u;
    const uint ne = min(8u, pc.cols - e0);
    [[unroll]] for (uint t = 0u; t < NT; ++t) {
      if (t >= nt) break;
      F32 xr = F32(xbase + (uint64_t(t0 + t) * pc.cols + e0) * 4u);
      [[unroll]] for (uint i = 0u; i < 8u; ++i) {
        if (i >= ne) break;
        const float xv = xr.v[i];
        [[unroll]] for (uint j = 0u; j < NR; ++j) acc[j][t] += v[j][i] * xv;
      }
    }
  }
#ifdef MOE
  [[unroll]] for (uint j = 0u; j < NR; ++j)
    if (r0 + j < pc.rows)
      F32(ybase + uint64_t(r0 + j) * 4u).v[0] =
          acc[j][0] + (pc.bias != 0ul ? F32(pc.bias).v[e * pc.rows + r0 + j] : 0.0f);
#else
  [[unroll]] for (uint t = 0u; t < NT; ++t)
    [[unroll]] for (uint j = 0u; j < NR; ++j)
      if (t < nt && r0 + j < pc.rows) F32(ybase + (uint64_t(t0 + t) * pc.rows + r0 + j) * 4u).v[0] = acc[j][t];
#endif
}
#endif
