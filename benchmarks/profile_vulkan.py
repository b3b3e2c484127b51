"""Vulkan decode and prefill A/B: the backend's switches, each in its own process, interleaved.

Each configuration (a set of DASLLAMA_VULKAN_* variables) loads the same random-weight model
(bench_cuda.py's shapes), prefills --ctx tokens, then times --steps single-token decode steps
(host wall time per step, which waits for the logits) and a pp512 prefill. Rounds alternate
the configurations so a noisy machine hits them alike; medians are printed. Run on the GPU:

    python benchmarks/profile_vulkan.py --shape llama1b --type q8_0 --rounds 3

The default configurations: everything on (but gemm.comp, opt-in); then one switch flipped at a
time (REPLAY=0: every step recorded into the stream; BARRIERS=all: a barrier after every
command; GEMV=0: matmul.comp's subgroup path in decode; ATTN_SPLIT=0: one workgroup per (head,
token); GEMM=1: gemm.comp (128 x 64 tiles) in prefill, not matmul_tile.comp's 64 x 64;
FUSE_GLU=0: the glu before ffn down its own dispatch; FUSE_ROPE=0: the ropes their own
dispatches before the KV store (=k: only the keys' folded into it, not the queries'); MERGE=dispatch: attention's splits joined by a second dispatch;
I8=0: q8-mode matmuls on f32 activations (matmul_tile.comp's tiles, gemv.comp), not int8;
I8=plain: the int8 GEMM / GEMV without the packed dot product; I8=coop: prefill on NV int8
cooperative matrices where present; I8=rows: 128-row int8 tiles at every size, a row's sums at a
time (fewer registers, the same bits); I8=coop2: NV int8 cooperative matrices in gemm_i8's stages,
each product's sums scaled in registers (not through shared memory as I8=coop; the default where
the device has them); I8=dot: gemm_i8's own tiles even there; I8=prefill:
int8 in prefill only, decode on gemv.comp's f32;
FLASH=enc: decoders' prefill attention on attention.comp's row-per-workgroup kernel, the tiles for
encoders only (the default before the sixteenth session; FLASH=0: never the tiles, FLASH=1: the
default); FLASHK=1: the tiles of flash.comp, not flash2.comp's; FLASH_BR=32 / 64: flash2's rows a
workgroup; FLASH_SG=0: flash2's row reductions through shared memory, not subgroup shuffles;
FLASH_UNITS=0: flash2's f16 tiles read 32 bits at a time with no register prefetch (before the
twenty-second session);
I8C_TILE=128: coop2's int8 GEMM in 128-row tiles at every size (not 64 where few);
GEMV_KS1_ROWS=0: gemv.comp (f16 decode) splits rows over subgroups at every height;
ATTN_DEC=0: decode attention on attention.comp (keys a workgroup a chunk), not attn_dec.comp
(keys a subgroup a round, K and V loaded together);
GEMVQ=0: q8-mode decode of 1-4 tokens on quant_act + gemv_i8, not gemv_q.comp (which rounds x itself, the GLU folded in);
GEMVI8=1: q8-mode decode of 1-4 tokens on quant_act + gemv_i8.comp, not gemv_i8x.comp (the
default is 3r4; GEMVI8=2: rows a workgroup picked; 2r2 / 2r4 / 2r8: forced; the glu before ffn down
folded into quant_act, the attention output rounded in the attention dispatch);
GEMVI8=3: the same, q8_0 a block a lane; GEMVI8=4: the same, two windows of k loaded ahead;
GEMVI8=2+NORMTAIL: and the normed rounding after a residual GEMV done by its last workgroup;
GLUTAIL=0: the glu before ffn down folded into quant_act32, not computed and rounded by the gate /
up GEMV's per-block tails (the default since the fifteenth session); KVTAIL=1: the ropes and the
KV store in the Q/K/V GEMV's per-head tails, not a kv_store dispatch (the default since the
twenty-first session); KVTAIL=0, TAILS=0: the KV tail off, both off;
READBACK=uncached: downloads into the first host-visible memory type, not a host-cached one;
F16C=0: f16 prefill on the f32 tiles, not NVIDIA's f16 cooperative matrices (gemm_f16c.comp, x
split into two f16 halves); F16C=k32 / n16 / w: its two 32-of-k stages, 16 x 16 x 16 products, 64-row
subgroup tiles; F16C_TILE=128 / 64: its tiles' rows forced),
and "old": all of them off, the stream before this work (but for the q4_0 split layout, which
DASLLAMA_VULKAN_SPLIT=0 turns off with q8_0's). --ctx
2048 makes the attention split matter more. Per-shader GPU time: run one
configuration with DASLLAMA_VULKAN_PROFILE=1 set (each command behind a barrier and no replay
there; the children's stderr, where the profile is printed, passes through). The process's table
sums every prefill and step, a slow one's too (the nineteenth session's F16 table on the H200
summed ~2.5x the GPU time its best pp512 could have taken, see RESULTS.md);
DASLLAMA_VULKAN_PROFILE=each (each=8: a table's 8 costliest shaders) adds a table per
submission (a prefill or a step is one), each headed by what it was.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_cuda import SHAPES, write_model
from gpu_clocks import ClockLog

CONFIGS = {
    "all on": {},
    "REPLAY=0": {"DASLLAMA_VULKAN_REPLAY": "0"},
    "BARRIERS=all": {"DASLLAMA_VULKAN_BARRIERS": "all"},
    "GEMV=0": {"DASLLAMA_VULKAN_GEMV": "0"},
    "ATTN_SPLIT=0": {"DASLLAMA_VULKAN_ATTN_SPLIT": "0"},
    "GEMM=1": {"DASLLAMA_VULKAN_GEMM": "1"},
    "FUSE_GLU=0": {"DASLLAMA_VULKAN_FUSE_GLU": "0"},
    "FUSE_ROPE=0": {"DASLLAMA_VULKAN_FUSE_ROPE": "0"},
    "FUSE_ROPE=k": {"DASLLAMA_VULKAN_FUSE_ROPE": "k"},
    "MERGE=dispatch": {"DASLLAMA_VULKAN_ATTN_SPLIT": "dispatch"},
    "I8=0": {"DASLLAMA_VULKAN_I8": "0"},
    "I8=plain": {"DASLLAMA_VULKAN_I8": "plain"},
    "I8=coop": {"DASLLAMA_VULKAN_I8": "coop"},
    "I8=prefill": {"DASLLAMA_VULKAN_I8": "prefill"},
    "I8=rows": {"DASLLAMA_VULKAN_I8": "rows"},
    "I8=coop2": {"DASLLAMA_VULKAN_I8": "coop2"},
    "I8=dot": {"DASLLAMA_VULKAN_I8": "dot"},
    "FLASH=1": {"DASLLAMA_VULKAN_FLASH": "1"},
    "FLASH=enc": {"DASLLAMA_VULKAN_FLASH": "enc"},
    "FLASH=0": {"DASLLAMA_VULKAN_FLASH": "0"},
    "FLASHK=1": {"DASLLAMA_VULKAN_FLASHK": "1"},
    "FLASH_BR=32": {"DASLLAMA_VULKAN_FLASH_BR": "32"},
    "FLASH_BR=64": {"DASLLAMA_VULKAN_FLASH_BR": "64"},
    "FLASH_SG=0": {"DASLLAMA_VULKAN_FLASH_SG": "0"},
    "FLASH_UNITS=0": {"DASLLAMA_VULKAN_FLASH_UNITS": "0"},
    "I8C_TILE=128": {"DASLLAMA_VULKAN_I8C_TILE": "128"},
    "GEMV_KS1_ROWS=0": {"DASLLAMA_VULKAN_GEMV_KS1_ROWS": "0"},
    "GEMVQ=0": {"DASLLAMA_VULKAN_GEMVQ": "0"},
    "ATTN_DEC=0": {"DASLLAMA_VULKAN_ATTN_DEC": "0"},
    "GEMVI8=1": {"DASLLAMA_VULKAN_GEMVI8": "1"},
    "GEMVI8=2": {"DASLLAMA_VULKAN_GEMVI8": "2"},
    "GEMVI8=2r2": {"DASLLAMA_VULKAN_GEMVI8": "2r2"},
    "GEMVI8=2r4": {"DASLLAMA_VULKAN_GEMVI8": "2r4"},
    "GEMVI8=2r8": {"DASLLAMA_VULKAN_GEMVI8": "2r8"},
    "GEMVI8=3": {"DASLLAMA_VULKAN_GEMVI8": "3"},
    "GEMVI8=4": {"DASLLAMA_VULKAN_GEMVI8": "4"},
    "GEMVI8=2+NORMTAIL": {"DASLLAMA_VULKAN_GEMVI8": "2", "DASLLAMA_VULKAN_NORMTAIL": "1"},
    "GLUTAIL=0": {"DASLLAMA_VULKAN_GLUTAIL": "0"},
    "KVTAIL=0": {"DASLLAMA_VULKAN_KVTAIL": "0"},
    "KVTAIL=1": {"DASLLAMA_VULKAN_KVTAIL": "1"},
    "TAILS=0": {"DASLLAMA_VULKAN_GLUTAIL": "0", "DASLLAMA_VULKAN_KVTAIL": "0"},
    "READBACK=uncached": {"DASLLAMA_VULKAN_READBACK": "uncached"},
    "F16C=0": {"DASLLAMA_VULKAN_F16C": "0"},
    "F16C=k32": {"DASLLAMA_VULKAN_F16C": "k32"},
    "F16C=n16": {"DASLLAMA_VULKAN_F16C": "n16"},
    "F16C=w": {"DASLLAMA_VULKAN_F16C": "w"},
    "F16C_TILE=128": {"DASLLAMA_VULKAN_F16C_TILE": "128"},
    "F16C_TILE=64": {"DASLLAMA_VULKAN_F16C_TILE": "64"},
    "old": {"DASLLAMA_VULKAN_REPLAY": "0", "DASLLAMA_VULKAN_BARRIERS": "all", "DASLLAMA_VULKAN_GEMV": "0",
            "DASLLAMA_VULKAN_ATTN_SPLIT": "0", "DASLLAMA_VULKAN_GEMM": "0", "DASLLAMA_VULKAN_FUSE_GLU": "0",
            "DASLLAMA_VULKAN_FUSE_ROPE": "0", "DASLLAMA_VULKAN_I8": "0", "DASLLAMA_VULKAN_GEMVI8": "1",
            "DASLLAMA_VULKAN_FLASH": "enc", "DASLLAMA_VULKAN_F16C": "0"},
}


def child(path: str, device: str, ctx: int, steps: int, pp: int) -> dict:
    import dasllama as d

    # DASLLAMA_VULKAN_PROFILE=each prints a table per submission (a prefill or a step is one):
    # each is headed here by what it was, so a slow first prefill shows apart from the rest.
    each = os.environ.get("DASLLAMA_VULKAN_PROFILE", "").startswith("each")

    def mark(what: str) -> None:
        if each:
            print(f"profile_vulkan: next submission: {what}", file=sys.stderr, flush=True)

    m = d.load_model(path, device=device)
    s = d.create_session(m, n_ctx=ctx + steps + 8)
    # The SM clock over each timed stretch (gpu_clocks.py: the driver idles it at light load).
    with ClockLog(int(device.split(":")[1]) if ":" in device else 0) as clk:
        mark(f"prefill of {ctx}")
        d.eval(m, s, [3 + i % 1000 for i in range(ctx)])
        times = []
        t0 = time.perf_counter()
        for i in range(steps):
            mark(f"decode step {i}")
            t = time.perf_counter()
            d.eval(m, s, [5 + i % 1000])
            times.append(time.perf_counter() - t)
        out = {"step_ms": statistics.median(times[2:] if steps > 4 else times) * 1e3,
               "sm_steps": clk.span(t0, time.perf_counter())}
        if pp:
            each_ms, sm = [], []
            for r in range(3):
                s = d.create_session(m, n_ctx=pp + 8)
                mark(f"pp{pp} prefill {r}")
                t = time.perf_counter()
                d.eval(m, s, [3 + i % 1000 for i in range(pp)])
                each_ms.append((time.perf_counter() - t) * 1e3)
                sm.append(clk.span(t, time.perf_counter()))
            out["pp_tps"] = pp / (min(each_ms) * 1e-3)
            out["pp_ms"] = [round(x, 2) for x in each_ms]  # each round's wall time: the first is often slower
            out["sm_pp"] = sm
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama1b", choices=sorted(SHAPES))
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("--device", default="vulkan")
    ap.add_argument("--ctx", type=int, default=16, help="prompt tokens before the timed steps")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--pp", type=int, default=512, help="prefill length timed (0: none)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="names from: " + ", ".join(CONFIGS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.device, args.ctx, args.steps, args.pp)))
        return
    names = [c for c in args.configs.split(",") if c]
    for c in names:
        if c not in CONFIGS:
            sys.exit(f"unknown configuration {c!r}")
    res = {c: [] for c in names}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "m.gguf")
        write_model(path, args.shape, args.type)
        for r in range(args.rounds):
            for c in names:
                env = dict(os.environ, **CONFIGS[c])
                p = subprocess.run([sys.executable, __file__, "--child", path, "--device", args.device, "--ctx",
                                    str(args.ctx), "--steps", str(args.steps), "--pp", str(args.pp)],
                                   env=env, stdout=subprocess.PIPE, text=True)  # stderr passes (the profile)
                if p.returncode != 0:
                    sys.exit(f"{c}: failed (its stderr above)")
                res[c].append(json.loads(p.stdout.strip().splitlines()[-1]))
                print(f"round {r} {c:13s} {res[c][-1]}", flush=True)
    print(f"\n{args.shape} {args.type} on {args.device}, ctx {args.ctx}, medians of {args.rounds} rounds:")
    for c in names:
        step = statistics.median(x["step_ms"] for x in res[c])
        pp = f"  pp{args.pp} {statistics.median(x['pp_tps'] for x in res[c]):8.0f} t/s" if args.pp else ""
        print(f"  {c:13s} decode {step:7.3f} ms/step ({1e3 / step:6.0f} t/s){pp}")


if __name__ == "__main__":
    main()
