// The row and elementwise ops, one pipeline picked by `op`: add, add_bias, scale, softcap,
// gelu_erf, glu (silu / gelu_tanh / swiglu_oai / sigmoid), copy_rows, im2col (channel-major or row input), im2col_2d (any strides), avg_pool.
// Invocations stride over the output elements.
#version 450
#include "common.glsl"

layout(local_size_x = 256) in;
layout(push_constant, std430) uniform PC {
  uint64_t a, b, c;  // op-specific addresses (see below)
  uint op, n;        // n: output elements
  uint p0, p1, p2, p3, p4, p5, p6;
  float f0;
} pc;

const uint ADD = 0u, ADD_BIAS = 1u, SCALE = 2u, SOFTCAP = 3u, GELU_ERF = 4u, GLU_SILU = 5u, GLU_GELU = 6u,
           COPY_ROWS = 7u, IM2COL = 8u, AVG_POOL = 9u, GLU_OAI = 10u,
           GLU_SIGMOID = 11u, IM2COL_2D = 12u, GLU_RELU = 13u;

float swiglu_oai(float gate, float up) {
  const float g = min(gate, 7.0f), u = clamp(up, -7.0f, 7.0f);
  const float z = 1.702f * g;
  const float e = exp(-abs(z));
  return g * ((z >= 0.0f ? 1.0f : e) / (1.0f + e)) * (u + 1.0f);
}

void main() {
  F32 A = F32(pc.a), B = F32(pc.b), C = F32(pc.c);
  for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += gl_NumWorkGroups.x * 256u) {
    switch (pc.op) {
      case ADD: A.v[i] += B.v[i]; break;                      // a += b
      case ADD_BIAS: A.v[i] += B.v[i % pc.p0]; break;         // rows of p0 += b
      case SCALE: A.v[i] *= pc.f0; break;
      case SOFTCAP: A.v[i] = pc.f0 * tanh_safe(A.v[i] / pc.f0); break;
      case GELU_ERF: {
        const float y = A.v[i];
        A.v[i] = 0.5f * y * (1.0f + erf_f(y * 0.70710678118654752f));
        break;
      }
      case GLU_SILU:
      case GLU_GELU: {  // c[r][k] = act(a[r * p1 + k]) * b[r * p2 + k], dim p0
        const uint r = i / pc.p0, k = i % pc.p0;
        const float g = A.v[r * pc.p1 + k];
        C.v[i] = (pc.op == GLU_SILU ? silu(g) : gelu_tanh(g)) * B.v[r * pc.p2 + k];
        break;
      }
      case GLU_SIGMOID: {  // an output gate: sigmoid(a) * b, layout as GLU_SILU
        const uint r = i / pc.p0, k = i % pc.p0;
        C.v[i] = B.v[r * pc.p2 + k] / (1.0f + exp(-A.v[r * pc.p1 + k]));
        break;
      }
      case GLU_RELU: {  // max(a, 0) * b, layout as GLU_SILU
        const uint r = i / pc.p0, k = i % pc.p0;
        C.v[i] = max(A.v[r * pc.p1 + k], 0.0f) * B.v[r * pc.p2 + k];
        break;
      }
      case GLU_OAI: {  // gpt-oss's clamped SwiGLU, layout as GLU_SILU
        const uint r = i / pc.p0, k = i % pc.p0;
        C.v[i] = swiglu_oai(A.v[r * pc.p1 + k], B.v[r * pc.p2 + k]);
        break;
      }
      case COPY_ROWS: {  // c[r * p1 + k] = a[r * p2 + k], width p0
        const uint r = i / pc.p0, k = i % pc.p0;
        C.v[r * pc.p1 + k] = A.v[r * pc.p2 + k];
        break;
      }
      case IM2COL: {  // c[t][ch * k + j] = x(ch, t * stride + j - pad); p0 C, p1 T, p2 k, p3 stride, p4 pad,
                      // p5 x_stride, p6 rows layout ([T][C]) or not ([C][x_stride])
        const uint w = pc.p0 * pc.p2;
        const uint t = i / w, ck = i % w, ch = ck / pc.p2, j = ck % pc.p2;
        const int s = int(t * pc.p3 + j) - int(pc.p4);
        C.v[i] = s < 0 || s >= int(pc.p1) ? 0.0f : (pc.p6 != 0u ? A.v[uint(s) * pc.p0 + ch] : A.v[ch * pc.p5 + uint(s)]);
        break;
      }
      case IM2COL_2D: {  // c[p][(ch * kh + i) * kw + j] = x(ch, h, w) at ch * p3 + h * p4 + w * p5; p0 C,
                         // p1 H, p2 W, p6 kh | kw << 8 | stride << 16 | pad << 24, f0's bits W_out
        const uint kh = pc.p6 & 255u, kw = (pc.p6 >> 8) & 255u, st = (pc.p6 >> 16) & 255u, pd = pc.p6 >> 24;
        const uint wout = floatBitsToUint(pc.f0), width = pc.p0 * kh * kw;
        const uint p = i / width, q = i % width, ch = q / (kh * kw), r = q % (kh * kw);
        const int h = int((p / wout) * st + r / kw) - int(pd), w = int((p % wout) * st + r % kw) - int(pd);
        C.v[i] = h < 0 || h >= int(pc.p1) || w < 0 || w >= int(pc.p2) ? 0.0f
                 : A.v[ch * pc.p3 + uint(h) * pc.p4 + uint(w) * pc.p5];
        break;
      }
      case AVG_POOL: {  // c[r][d] = mean of a rows r*k .. ; p0 n_rows, p1 dim, p2 k
        const uint r = i / pc.p1, d = i % pc.p1;
        const uint r0 = r * pc.p2, r1 = min(pc.p0, r0 + pc.p2);
        float s = 0.0f;
        for (uint j = r0; j < r1; ++j) s += A.v[j * pc.p1 + d];
        C.v[i] = s / float(r1 - r0);
        break;
      }
    }
  }
}
