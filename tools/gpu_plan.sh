#!/bin/bash
# The pending GPU work of benchmarks/RESULTS.md's latest entry as named stages, each step under its
# own time limit, so a lent machine's few device calls (10 minutes each, 30 a session) go to
# running rather than typing: `bash tools/gpu_plan.sh checks` on the first call (it builds the
# tree through tools/gpu_machine.sh), then `compat`, `cuda`, `vulkan`, `peers` and `small` on the
# next calls while the machine is still warm (its /tmp keeps the build). Each step's whole output
# goes to $OUT/<stage>-<step>.log (the device tool brings $OUT back); stdout gets one line a step:
# its exit status, seconds and last line. A step that runs past its limit is stopped and the
# stage goes on. STEPS="a b" runs only the named steps of a stage.
set -u
OUT=${OUT:-/tmp/gpu_plan}
mkdir -p "$OUT"
t_all=$SECONDS
source tools/gpu_machine.sh > "$OUT/setup.log" 2>&1
tail -2 "$OUT/setup.log"

step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 lim=$2
  shift 2
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return; fi
  local t0=$SECONDS log="$OUT/$stage-$name.log"
  timeout -k 10 "$lim" "$@" > "$log" 2>&1
  local rc=$?
  echo "$stage/$name: rc=$rc $((SECONDS - t0)) s | $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-200)"
}


for stage in "$@"; do
  case $stage in
    checks)  # the session's GPU code, first: tests before timings
      step cuda_new 240 python -m pytest -q -x tests/test_cuda.py \
        -k "f16_prefill_tiles or block_formats or flash_attention_f16 or gemma4"
      step ops 240 python -m pytest -q tests/test_backend_ops.py -k "attention or block_formats or f16"
      step vulkan_new 240 python -m pytest -q tests/test_vulkan.py \
        -k "flash_cm or block_formats or f16_prefill_split or subgroup_path or flash_variants or gemma4"
      ;;
    defaults)  # every device test with the session's defaults on (two calls: CUDA, then Vulkan)
      step cuda_all 400 python -m pytest -q tests/test_cuda.py -k "not pre_ampere"
      ;;
    vk_new)  # the twenty-seventh session's Vulkan path still opt-in (gemv.comp's KV tail: slower on
      # the H100, F16 tg256 550 -> 505) and the full-device tests
      step tests 300 python -m pytest -q tests/test_vulkan.py -k "gemv_tails or f16_prefill_split or without_room or full_device"
      step kvtail 200 python benchmarks/ab_cuda.py --device vulkan --types f16 --rounds 2 \
        DASLLAMA_VULKAN_KVTAIL=1 DASLLAMA_VULKAN_KVTAIL=2
      # the suspicion for its loss: the tail's registers in every workgroup of the GEMV (the
      # driver's statistics of gemv1_1 beside gemv1_kv_1)
      # CUDA: a one-row step's decode attention unsplit on a 16-warp block (DASLLAMA_CUDA_ATTN_WIDE=N: up
      # to N of its batches of keys; 0 off): the harness against float64, the model tests with it, the speed
      step wideops 300 python -m pytest -q tests/test_backend_ops.py -k "paged_attention_gqa"
      step widetests 300 env DASLLAMA_CUDA_ATTN_WIDE=4 python -m pytest -q tests/test_cuda.py -k "every_family_and_format or greedy"
      step wide 300 python benchmarks/ab_cuda.py --types q8_0,q4_0,f16 --rounds 2 DASLLAMA_CUDA_ATTN_WIDE=0 \
        DASLLAMA_CUDA_ATTN_WIDE=2 DASLLAMA_CUDA_ATTN_WIDE=4
      step regs 120 env DASLLAMA_VULKAN_PIPESTATS=1 DASLLAMA_VULKAN_KVTAIL=2 python benchmarks/ab_cuda.py \
        --device vulkan --types f16 --rounds 1 DASLLAMA_VULKAN_KVTAIL=2
      ;;
    cuda_new)  # the twenty-eighth session's CUDA path (opt-in): x rounded once a matmul_multi of f16 weights
      step tests 240 python -m pytest -q tests/test_backend_ops.py tests/test_cuda.py -k "matmul_multi_f16 or f16_model"
      step multi 240 python benchmarks/ab_cuda.py --types f16 --no-tg --rounds 3 \
        DASLLAMA_CUDA_F16_MULTI=0 DASLLAMA_CUDA_F16_MULTI=1
      ;;
    s29)  # the twenty-ninth session's unrun CUDA paths (opt-in): head 256 on flash_h16_k, q4_K's int8
      # GEMV, block formats' batched steps decoded to f16 (then cuBLAS); and why Q4_K_M's steps crawl
      step tests 240 python -m pytest -q tests/test_cuda.py -k "flash_attention_f16 or decoded_to_f16 or cublas or f16_prefill_tiles or q4k_int8"
      step q4ki8 200 python benchmarks/ab_cuda.py --types q4_k_m --batches 4,16 --rounds 2 \
        DASLLAMA_CUDA_Q4K_I8=0 DASLLAMA_CUDA_Q4K_I8=1
      step h256 150 python benchmarks/ab_cuda.py --shapes gemma270m --types q8_0 --no-tg --rounds 2 \
        DASLLAMA_CUDA_FLASH_H256=0 DASLLAMA_CUDA_FLASH_H256=1
      step dqmin 300 python benchmarks/ab_cuda.py --types q4_k_m --batches 4,16,64 --rounds 2 \
        DASLLAMA_CUDA_DQF16_MIN=65 DASLLAMA_CUDA_DQF16_MIN=33 DASLLAMA_CUDA_DQF16_MIN=2,DASLLAMA_CUDA_DQF16_SLAB_KB=65536 \
        DASLLAMA_CUDA_DQF16_MIN=9,DASLLAMA_CUDA_DQF16_SLAB_KB=65536
      step qkprof 120 bash -c "cd benchmarks && python profile_cuda.py --type q4_k_m --batch 64 --steps 8"
      step qkprof1 120 bash -c "cd benchmarks && python profile_cuda.py --type q4_k_m --steps 16"
      ;;
    s30)  # the thirtieth session's: q5_K / q6_K on int8 dot products (opt-in), f16's batched steps
      # on cuBLAS from 2 tokens, and where Q4_K_M's batched steps go
      step tests 240 python -m pytest -q tests/test_cuda.py -k "k_quant_int8 or decoded_to_f16 or f16_model or q4_k"
      step q56 240 python benchmarks/ab_cuda.py --types q4_k_m,q6_K,q5_K --batches 4,16 --rounds 2 \
        DASLLAMA_CUDA_Q56K_I8=0 DASLLAMA_CUDA_Q56K_I8=1
      step f16min 150 python benchmarks/ab_cuda.py --types f16 --no-tg --batches 4,16 --rounds 2 \
        DASLLAMA_CUDA_F16_MMA_MIN=33 DASLLAMA_CUDA_F16_MMA_MIN=2
      step prof16 100 bash -c "cd benchmarks && DASLLAMA_CUDA_Q56K_I8=1 python profile_cuda.py --type q4_k_m --batch 16 --steps 8"
      step prof1 100 bash -c "cd benchmarks && DASLLAMA_CUDA_Q56K_I8=1 python profile_cuda.py --type q4_k_m --steps 16"
      ;;
    s32)  # K-quant steps on int8 mmas (default from 9 tokens; timed only at 16): where they should start
      step tests 200 python -m pytest -q -x tests/test_cuda.py -k "k_quant or mixed or logits_in_parts"
      # the logits in parts of the vocabulary, each part's download beside the next part's product
      step parts 300 python benchmarks/ab_cuda.py --types q8_0 --no-tg --batches 4,16,64 --rounds 2 \
        DASLLAMA_CUDA_LOGIT_PARTS=0 DASLLAMA_CUDA_LOGIT_PARTS=2 DASLLAMA_CUDA_LOGIT_PARTS=4 DASLLAMA_CUDA_LOGIT_PARTS=8
      step kmma 300 python benchmarks/ab_cuda.py --types q4_k_m,q6_K,q5_K --no-tg --batches 4,8,16 --rounds 2 \
        DASLLAMA_CUDA_KMMA=0 DASLLAMA_CUDA_KMMA=1
      # 17-32 tokens: the decoding to f16 + cuBLAS (default) against the mmas
      step kmax 200 python benchmarks/ab_cuda.py --types q4_k_m,q6_K --no-tg --batches 24,32 --rounds 2 \
        DASLLAMA_CUDA_KMMA_MAX=16 DASLLAMA_CUDA_KMMA_MAX=32
      # Q8_0's batched steps kernel by kernel, PDL off so no kernel's time holds its wait (the
      # head's product against the logits' download)
      step prof4 120 env DASLLAMA_CUDA_PDL=0 python benchmarks/profile_cuda.py --batch 4 --steps 16
      step prof4p 120 python benchmarks/profile_cuda.py --batch 4 --steps 16
      step prof16 120 env DASLLAMA_CUDA_PDL=0 python benchmarks/profile_cuda.py --batch 16 --steps 16
      step prof64 120 env DASLLAMA_CUDA_PDL=0 python benchmarks/profile_cuda.py --batch 64 --steps 8
      step prof64p 120 python benchmarks/profile_cuda.py --batch 64 --steps 8
      ;;
    s32b)  # the defaults s32 set (K-quant mmas from 5 to 32 tokens, logits in 4 parts): every CUDA
      # test, then the tree's table
      step all 420 python -m pytest -q tests/test_cuda.py -k "not pre_ampere"
      step table 300 python benchmarks/ab_cuda.py --types q8_0,q4_0,f16,q4_k_m --batches 4,8,16,64 --rounds 1 DASLLAMA_NONE=1
      ;;
    s32c)  # where a batched step's device idles on the host, and why the 4-token GEMV is slower than one token's
      step gap4 120 python benchmarks/profile_cuda.py --batch 4 --steps 16
      step gap16 120 python benchmarks/profile_cuda.py --batch 16 --steps 16
      step ncu4 200 ncu --clock-control none --kernel-name regex:gemv_q8_k --launch-skip 200 --launch-count 4 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section LaunchStats python benchmarks/bench_cuda_batch.py --batch 4 --steps 6
      step table 200 python benchmarks/ab_cuda.py --types q8_0,q4_k_m --batches 4,16,64 --rounds 1 DASLLAMA_NONE=1
      ;;
    s32d)  # what makes a batched step's graph launch slow: PDL's edges, the logits' event nodes
      step gap4 60 python benchmarks/profile_cuda.py --batch 4 --steps 16
      step gap4pdl0 60 env DASLLAMA_CUDA_PDL=0 python benchmarks/profile_cuda.py --batch 4 --steps 16
      step gap4parts0 60 env DASLLAMA_CUDA_LOGIT_PARTS=0 python benchmarks/profile_cuda.py --batch 4 --steps 16
      step gap1 60 python benchmarks/profile_cuda.py --steps 16
      # the same launches without CUPTI (whose tracing may slow a graph's launch): the backend's own clock
      step host4 60 env DASLLAMA_CUDA_HOSTPROF=1 python benchmarks/bench_cuda_batch.py --batch 4 --steps 64
      step host4pdl0 60 env DASLLAMA_CUDA_HOSTPROF=1 DASLLAMA_CUDA_PDL=0 python benchmarks/bench_cuda_batch.py --batch 4 --steps 64
      step host4parts0 60 env DASLLAMA_CUDA_HOSTPROF=1 DASLLAMA_CUDA_LOGIT_PARTS=0 python benchmarks/bench_cuda_batch.py --batch 4 --steps 64
      step host16 60 env DASLLAMA_CUDA_HOSTPROF=1 python benchmarks/bench_cuda_batch.py --batch 16 --steps 64
      ;;
    s33)  # the thirty-second session's defaults (logits in 4 parts, K-quant mmas 5-32) on an H200,
      # where the issue's marks were taken (that session had only H100s)
      step tests 300 python -m pytest -q tests/test_cuda.py -k "k_quant or mixed or logits_in_parts or speculated or greedy_batch"
      step vktests 200 python -m pytest -q tests/test_vulkan.py -k "greedy_batch or speculated"
      # batched greedy streams (ids from the device) beside eval_batch's logits, one process
      step greedy 300 python benchmarks/ab_cuda.py --types q8_0 --no-tg --batches 4,16,64 --greedy --rounds 2 DASLLAMA_NONE=1
      step table 300 python benchmarks/ab_cuda.py --types q8_0,q4_0,f16,q4_k_m --batches 4,16,64 --rounds 1 DASLLAMA_NONE=1
      step parts 240 python benchmarks/ab_cuda.py --types q8_0 --no-tg --batches 4,16,64 --rounds 2 \
        DASLLAMA_CUDA_LOGIT_PARTS=0 DASLLAMA_CUDA_LOGIT_PARTS=4
      ;;
    s33b)  # argmax split over blocks (CUDA) / workgroups (Vulkan) with a last-block join
      step tests 300 python -m pytest -q tests/test_backend_ops.py tests/test_cuda.py tests/test_vulkan.py \
        -k "argmax or greedy or speculated or pipelined"
      step cuda 420 python benchmarks/ab_cuda.py --types q8_0,f16 --batches 4,16,64 --greedy --rounds 2 \
        DASLLAMA_ARGMAX_SPLIT=0 DASLLAMA_NONE=1
      step vk 400 python benchmarks/ab_cuda.py --device vulkan --types f16,q8_0 --batches 4,16 --greedy --rounds 2 \
        DASLLAMA_ARGMAX_SPLIT=0 DASLLAMA_NONE=1
      ;;
    s33c)  # the greedy ids into a pinned block (their copy overlapping the next recording), the GQA
      # kernel's teacher-forced model test, and greedy / logits steps with GQA off and on
      step tests 300 python -m pytest -q tests/test_cuda.py -k "gqa_decode or greedy_batch"
      step ab 400 python benchmarks/ab_cuda.py --types q8_0 --batches 4,16,64 --greedy --rounds 2 \
        DASLLAMA_CUDA_ATTN_GQA=0 DASLLAMA_CUDA_ATTN_GQA=1
      step table 300 python benchmarks/bench_cuda.py --types q8_0,q4_0,f16 --batches 4,16,64 --greedy
      ;;
    s34)  # decode attention's key splits in steps of several rows (DASLLAMA_CUDA_ATTN_GQA_MINB, default 4;
      # 1 is the rule before): the attention harness and model tests, then the batched rows
      step tests 400 python -m pytest -q tests/test_backend_ops.py tests/test_cuda.py -k "gqa or greedy_batch or speculated"
      step ab 450 python benchmarks/ab_cuda.py --types q8_0,q4_0 --batches 4,16,64 --rounds 2 DASLLAMA_CUDA_ATTN_GQA_MINB=1 \
        DASLLAMA_CUDA_ATTN_GQA_MINB=2 DASLLAMA_CUDA_ATTN_GQA_MINB=4 DASLLAMA_CUDA_ATTN_GQA_MINB=8
      ;;
    s44)  # issue 14's last items on an H200: SmolLM2's end-to-end check on Vulkan (its Q4_1 GGUF, 94 MiB,
      # carried in three parts: .hub/smollm2.gguf.part0, part1, part2, one named in each of three warm
      # calls' carry beside .whl, .gl, .vkb and .dlb, which leaves the others in place there; run this
      # stage on the third), then llama.cpp's Vulkan build beside ours again, to confirm the forty-first
      # session's one-run ratios
      step smollm2 200 bash -c 'd=${DASLLAMA_HOME:-$HOME/.cache/dasllama}/smollm2-135m-instruct && mkdir -p "$d" &&
        cat .hub/smollm2.gguf.part0 .hub/smollm2.gguf.part1 .hub/smollm2.gguf.part2 > "$d/SmolLM2-135M-Instruct.Q4_1.gguf" &&
        python -m pytest -q tests/test_vulkan.py tests/test_devices.py -k "smollm2 or unknown_and_malformed"'
      step vkpeers 300 python benchmarks/bench_gpu_peers.py --types f16,q8_0,q4_0 --rounds 2 --ours vulkan \
        --llama-server /tmp/skb/llama-server
      ;;
    s43)  # as run in the forty-first session (attn_dec_wd since removed: H200 tg256 F16 829 -> 768,
      # Q8_0 854 -> 786): a one-row step's decode attention on one 512-invocation workgroup a head,
      # unsplit (attn_dec_wd / attn_dec_kfw, DASLLAMA_VULKAN_ATTN_WIDE up to N keys, opt-in): its
      # checks, then the A/B at tg256 (contexts up to ~260 keys: 256 covers most of the steps)
      # (with s42's checks of the fortieth session's final defaults, in one process)
      step tests 150 python -m pytest -q tests/test_backend_ops.py tests/test_vulkan.py -k "vulkan_wide or \
glu_then_matmul or attn_kv_fold_alike or decode_split_joins or gemv_glu_tail_alike or gemv_tails_alike or \
decode_steps or (greedy and not smollm2) or f16_model"
      step ab 230 python benchmarks/ab_cuda.py --device vulkan --types f16,q8_0 --rounds 2 \
        DASLLAMA_VULKAN_ATTN_WIDE=0 DASLLAMA_VULKAN_ATTN_WIDE=256
      ;;
    s42)  # the fortieth session's final defaults (GLUT and KVFOLD on, the splits' join with its loads issued
      # together): the checks on the GPU, the A/B against each fold off, beside llama.cpp's Vulkan build
      step tests 200 python -m pytest -q tests/test_backend_ops.py tests/test_vulkan.py -k "glu_then_matmul or \
paged_attention_gqa or attn_kv_fold_alike or decode_split_joins or gemv_glu_tail_alike or gemv_tails or decode_steps or \
greedy or f16_model"
      step ab 150 python benchmarks/ab_cuda.py --device vulkan --types f16 --rounds 2 DASLLAMA_NONE=1 \
        DASLLAMA_VULKAN_GLUT=0 DASLLAMA_VULKAN_KVFOLD=0,DASLLAMA_VULKAN_GLUT=0
      step vkpeers 300 python benchmarks/bench_gpu_peers.py --types f16,q8_0,q4_0 --rounds 2 --ours vulkan \
        --llama-server /tmp/skb/llama-server
      # where the final F16 step goes (STEPPROF), after the table
      step stepprof 90 env DASLLAMA_VULKAN_STEPPROF=1 python benchmarks/ab_cuda.py --device vulkan --types f16 \
        --rounds 1 DASLLAMA_NONE=1
      ;;
    s41)  # as run (ATTN_PMERGE since made the only join; GLUT the default): the second round on F16 decode: the folded GLU's output in 16-byte units (no
      # switch; FUSE_GLU=0 is the unfused glu), the glu in the gate / up GEMV's block tails instead (GLUT=1),
      # KVFOLD's default, the splits' join with its loads issued together (ATTN_PMERGE), fewer splits
      # (ATTN_KEYS=64)
      step ab 300 python benchmarks/ab_cuda.py --device vulkan --types f16 --rounds 2 DASLLAMA_VULKAN_KVFOLD=0 \
        DASLLAMA_NONE=1 DASLLAMA_VULKAN_FUSE_GLU=0 DASLLAMA_VULKAN_GLUT=1 DASLLAMA_VULKAN_ATTN_PMERGE=1 \
        DASLLAMA_VULKAN_ATTN_KEYS=64
      ;;
    s41b)  # where the F16 and Q8_0 steps go now (STEPPROF; F16 with GLUT=1 too); the join and the split
      # count in q8 mode (its attn_dec rounds the output, QFOLD)
      step stepprof 120 env DASLLAMA_VULKAN_STEPPROF=1 python benchmarks/ab_cuda.py --device vulkan --types f16,q8_0 \
        --rounds 1 DASLLAMA_NONE=1 DASLLAMA_VULKAN_GLUT=1
      step abq8 240 python benchmarks/ab_cuda.py --device vulkan --types q8_0,q4_0 --rounds 2 DASLLAMA_NONE=1 \
        DASLLAMA_VULKAN_ATTN_PMERGE=1 DASLLAMA_VULKAN_ATTN_KEYS=64
      ;;
    s41c)  # the new harness and model checks on the GPU
      step tests 240 env DASLLAMA_VULKAN_GLUT=1 DASLLAMA_VULKAN_ATTN_PMERGE=1 python -m pytest -q \
        tests/test_backend_ops.py tests/test_vulkan.py -k "glu_then_matmul or paged_attention_multi or \
attn_kv_fold_alike or attn_pmerge_alike or gemv_glu_tail_alike or gemv_tails or decode_steps or greedy"
      ;;
    s41p)  # then beside llama.cpp's Vulkan build (carry .peers/skb.tar.xz)
      step vkpeers 300 python benchmarks/bench_gpu_peers.py --types f16,q8_0,q4_0 --rounds 2 --ours vulkan \
        --llama-server /tmp/skb/llama-server
      ;;
    s40)  # as run in the fortieth session (QX since removed: q8_0 tg256 736 -> 380): F16's KV store in
      # the decode attention (KVFOLD), both folds' bits, CUDA's wide-row GEMVs (R1_WIDE: 886 -> 890)
      step ab 300 python benchmarks/ab_cuda.py --device vulkan --types f16 --rounds 2 \
        DASLLAMA_VULKAN_KVFOLD=0 DASLLAMA_VULKAN_KVFOLD=1
      step tests 150 python -m pytest -q tests/test_vulkan.py -k "attn_kv_fold_alike or step_profile"
      step r1w 150 python benchmarks/ab_cuda.py --types f16 --rounds 2 DASLLAMA_CUDA_R1_WIDE=0 \
        DASLLAMA_CUDA_R1_WIDE=8192
      ;;
    s39b)  # zero-code A/Bs: CUDA's one-row GEMVs at 2 rows a warp for F16 (DASLLAMA_CUDA_R1=2, timed for q8_0 /
      # q4_0 only so far); Vulkan q8 mode on gemv_q.comp (DASLLAMA_VULKAN_GEMVQ=1, last timed in the twelfth
      # session); the cm2_mark helper's test (not yet run on a GPU)
      step gemvq 240 python benchmarks/ab_cuda.py --device vulkan --types q8_0,q4_0 --rounds 2 \
        DASLLAMA_VULKAN_GEMVQ=0 DASLLAMA_VULKAN_GEMVQ=1
      step cm2 150 python -m pytest -q tests/test_vulkan.py -k "f16_prefill_coopmat2"
      # where a replayed Vulkan decode step's time goes, dispatch by dispatch (DASLLAMA_VULKAN_STEPPROF: stamps
      # recorded into the step's own command buffer, fusions and replay as they run)
      step stepprof 200 env DASLLAMA_VULKAN_STEPPROF=1 python benchmarks/ab_cuda.py --device vulkan \
        --types f16,q8_0,q4_0 --rounds 1 DASLLAMA_NONE=1
      ;;
    s38)  # Vulkan's prefill attention on the workgroup-scope matrices (flash_cm2.comp, default where the device
      # has them; DASLLAMA_VULKAN_FLASH_CM=1: the subgroup-scope flash_cm): the harness against float64 (the
      # cases with pages of whole tiles, sinks), each variant by name, the models' prefill; the A/B; where an
      # F16 pp512 goes now; beside llama.cpp's Vulkan build (carry .peers/skb.tar.xz)
      step flashops 200 python -m pytest -q tests/test_backend_ops.py -k "attention_q8_mode"
      step flashtests 300 python -m pytest -q tests/test_vulkan.py -k "(flash_cm or q8_mode_prefill or f16_model or greedy) and not smollm2"
      step flashab 240 python benchmarks/ab_cuda.py --device vulkan --types f16,q8_0,q4_0 --no-tg --rounds 2 \
        DASLLAMA_VULKAN_FLASH_CM=1 DASLLAMA_VULKAN_FLASH_CM=cm2
      step vkgrid 90 env DASLLAMA_VULKAN_PROFILE=each=30 DASLLAMA_VULKAN_PROFILE_GRID=1 python benchmarks/ab_cuda.py \
        --device vulkan --types f16 --no-tg --rounds 1 DASLLAMA_NONE=1
      step vkgrid8 90 env DASLLAMA_VULKAN_PROFILE=each=30 DASLLAMA_VULKAN_PROFILE_GRID=1 python benchmarks/ab_cuda.py \
        --device vulkan --types q8_0 --no-tg --rounds 1 DASLLAMA_VULKAN_Q8CM2=0 DASLLAMA_VULKAN_Q8CM2=dq
      step vkpeers 240 python benchmarks/bench_gpu_peers.py --types f16,q8_0,q4_0 --rounds 2 --ours vulkan \
        --llama-server /tmp/skb/llama-server
      # CUDA: what holds an F16 decode step's GEMVs (Q / K / V with its rope at 1.4 TB/s) under the copy
      step ncugemv 200 ncu --clock-control none --kernel-name regex:gemv_direct_k --launch-skip 64 --launch-count 8 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section LaunchStats python benchmarks/ab_cuda.py --types f16 --rounds 1 DASLLAMA_NONE=1
      ;;
    s38b)  # a prefill's norm and f16 rounding as one dispatch (norm.comp's mode 2; DASLLAMA_VULKAN_NORM_ROUND=0:
      # the two): bits against the two, the models' prefill; q8_0 / q4_0 decoded in the workgroup-scope tiles'
      # loads as one f16 product a weight (DASLLAMA_VULKAN_Q8CM2=1, formerly 8-9k t/s): its harness; the A/Bs
      step tests 300 python -m pytest -q tests/test_vulkan.py \
        -k "norm_round or block_formats or f16_model or q8_mode_prefill or f16_prefill_coopmat2"
      step nrab 200 python benchmarks/ab_cuda.py --device vulkan --types f16,q4_k_m --no-tg --rounds 2 \
        DASLLAMA_VULKAN_NORM_ROUND=0 DASLLAMA_VULKAN_NORM_ROUND=1
      step q8ab 200 python benchmarks/ab_cuda.py --device vulkan --types q8_0,q4_0 --no-tg --rounds 2 \
        DASLLAMA_VULKAN_Q8CM2=0 DASLLAMA_VULKAN_Q8CM2=1 DASLLAMA_VULKAN_Q8CM2=dq
      # (The session's flash_cm2 variants, cm2p and cm2r32, ran here: cm2p was removed, cm2r32's 32 rows are now
      # the default at head size 64; s38c's r64 step times it against 64 rows.)
      ;;
    s38c)  # the session's final defaults (flash_cm2 with 32 rows at head size 64, q8_0 / q4_0 prefill decoded
      # to f16, the fused norm): the harness (q8-mode attention and matmuls), the Vulkan tests they touch,
      # the tile A/B, then beside llama.cpp's Vulkan build
      step ops 200 python -m pytest -q tests/test_backend_ops.py -k "attention_q8_mode or matmul_q8_mode"
      step tests 330 python -m pytest -q tests/test_vulkan.py \
        -k "(flash_cm or q8_mode or norm_round or f16_model or f16_prefill_coopmat2 or int8_prefill) and not smollm2"
      step r64 120 python benchmarks/ab_cuda.py --device vulkan --types f16 --no-tg --rounds 2 \
        DASLLAMA_VULKAN_FLASH_CM=cm2r64 DASLLAMA_VULKAN_FLASH_CM=cm2
      step vkpeers 240 python benchmarks/bench_gpu_peers.py --types f16,q8_0,q4_0 --rounds 2 --ours vulkan \
        --llama-server /tmp/skb/llama-server
      ;;
    s37)  # Vulkan's f16 prefill on the workgroup-scope tiles by default (their whole tiles unclamped and
      # unrolled): the harness of every tile (with the Q8CM2=dq child) and the whole-tile cases; prefill
      # against the subgroup-scope k64 tiles; Q8CM2's two forms; beside llama.cpp's Vulkan llama-server (carry
      # .peers/skb.tar.xz); an F16 pp512 by shader and grid; the wide block's helper (CUDA one-row harness);
      # where a CUDA F16 step goes (PDL off). Past one call's 10 minutes: STEPS="..." splits it.
      step cm2test 300 python -m pytest -q tests/test_vulkan.py -k "f16_prefill_coopmat2 or block_formats_prefill or f16_prefill_split"
      step wholetiles 120 python -m pytest -q tests/test_backend_ops.py -k "token_scales or matmul_f16_q8_mode"
      step vkab 200 python benchmarks/ab_cuda.py --device vulkan --types f16,q4_k_m --rounds 2 \
        DASLLAMA_VULKAN_F16C=k64 DASLLAMA_VULKAN_F16C=1
      step q8ab 150 python benchmarks/ab_cuda.py --device vulkan --types q8_0,q4_0 --no-tg --rounds 2 \
        DASLLAMA_VULKAN_Q8CM2=0 DASLLAMA_VULKAN_Q8CM2=1 DASLLAMA_VULKAN_Q8CM2=dq
      step vkpeers 240 python benchmarks/bench_gpu_peers.py --types f16,q8_0,q4_0 --rounds 2 --ours vulkan \
        --llama-server /tmp/skb/llama-server
      step vkgrid 90 env DASLLAMA_VULKAN_PROFILE=each=30 DASLLAMA_VULKAN_PROFILE_GRID=1 python benchmarks/ab_cuda.py \
        --device vulkan --types f16 --no-tg --rounds 1 DASLLAMA_NONE=1
      step ops 200 python -m pytest -q tests/test_backend_ops.py -k "paged_attention_gqa and tok1"
      step prof16 90 env DASLLAMA_CUDA_PDL=0 python benchmarks/profile_cuda.py --type f16 --steps 16
      ;;
    s36)  # decode attention's wide block (DASLLAMA_CUDA_ATTN_WIDE, default 2; 0: the key splits as before):
      # the harness against float64 (every one-row case on it too), the model tests with it over more keys,
      # the A/B; then where Vulkan's pp512 and F16 decode go, shader by shader (each dispatch behind a barrier)
      step ops 300 python -m pytest -q tests/test_backend_ops.py -k "paged_attention_gqa or paged_attention_multi"
      step tests 300 env DASLLAMA_CUDA_ATTN_WIDE=4 python -m pytest -q tests/test_cuda.py -k "every_family_and_format or greedy or attention_early or gemv_rope"
      step wide 300 python benchmarks/ab_cuda.py --types q8_0,q4_0,f16 --rounds 2 DASLLAMA_CUDA_ATTN_WIDE=0 \
        DASLLAMA_CUDA_ATTN_WIDE=2 DASLLAMA_CUDA_ATTN_WIDE=4
      step vkpp 200 python benchmarks/ab_cuda.py --device vulkan --types f16,q8_0 --no-tg --rounds 1 DASLLAMA_VULKAN_PROFILE=each=24
      step vktg 150 env DASLLAMA_VULKAN_PROFILE=each=16 python benchmarks/profile_vulkan.py --type f16 --rounds 1 --steps 8 \
        --configs "all on"
      ;;
    fold)  # the lean GEMVs, rounding and rope as the only kernels (the same sums as before): the op
      # harness's matmuls (rows over 8 warps), the model tests against the CPU, the fused / tail paths
      # against op by op; then the speed and where an F16 / Q8_0 one-token step goes (PDL off: each
      # kernel's own time)
      step ops 300 python -m pytest -q tests/test_backend_ops.py -k "matmul"
      step tests 400 python -m pytest -q tests/test_cuda.py -k "every_family_and_format or greedy or fused or tail or batch or speculated"
      step bench 200 python benchmarks/ab_cuda.py --types q8_0,q4_0,f16 --batches 4 --rounds 2 DASLLAMA_CUDA_PDL=1
      step prof16 120 env DASLLAMA_CUDA_PDL=0 python benchmarks/profile_cuda.py --type f16 --steps 16
      step prof8 120 env DASLLAMA_CUDA_PDL=0 python benchmarks/profile_cuda.py --type q8_0 --steps 16
      ;;
    rope)  # the Q / K / V GEMV doing the rope and KV stores (DASLLAMA_CUDA_GEMV_ROPE, default on): bits
      # against the two launches, the model tests, then the speed and the one-token step's kernels
      step tests 420 python -m pytest -q tests/test_cuda.py -k "gemv_rope or every_family_and_format or greedy or batch or speculated"
      step ab 300 python benchmarks/ab_cuda.py --types q8_0,q4_0,f16 --batches 4 --rounds 3 DASLLAMA_CUDA_GEMV_ROPE=0 \
        DASLLAMA_CUDA_GEMV_ROPE=1
      step prof8 120 env DASLLAMA_CUDA_PDL=0 python benchmarks/profile_cuda.py --type q8_0 --steps 16
      ;;
    early)  # decode attention's first key batch loaded before pdl_wait (DASLLAMA_CUDA_ATTN_EARLY), and the
      # GEMV tail that rounds the next input (TAILS bit 1) again now that the GEMVs are lean
      step tests 400 python -m pytest -q tests/test_cuda.py tests/test_backend_ops.py -k "attention_early or gqa or paged_attention or greedy or gemv_rope"
      step ab 300 python benchmarks/ab_cuda.py --types q8_0,q4_0,f16 --batches 4 --rounds 3 DASLLAMA_CUDA_ATTN_EARLY=0 \
        DASLLAMA_CUDA_ATTN_EARLY=1 DASLLAMA_CUDA_ATTN_EARLY=1,DASLLAMA_CUDA_TAILS=3
      ;;
    gqa)  # the grouped-query decode attention (DASLLAMA_CUDA_ATTN_GQA=1, opt-in, not yet run on a GPU):
      # its harness and model tests, the batched steps A/B, the split rule against forced counts,
      # and the kernels' times (attn_gqa_k against attn_k) with PDL off
      step tests 480 python -m pytest -q tests/test_backend_ops.py tests/test_cuda.py -k "gqa or paged_attention"
      step ab 400 python benchmarks/ab_cuda.py --types q8_0 --no-tg --batches 4,16,64 --rounds 2 \
        DASLLAMA_CUDA_ATTN_GQA=0 DASLLAMA_CUDA_ATTN_GQA=1
      step splits 300 python benchmarks/ab_cuda.py --types q8_0 --no-tg --batches 4,16,64 --rounds 2 \
        DASLLAMA_CUDA_ATTN_GQA=1,DASLLAMA_CUDA_ATTN_GQA_SPLITS=1 DASLLAMA_CUDA_ATTN_GQA=1,DASLLAMA_CUDA_ATTN_GQA_SPLITS=2 \
        DASLLAMA_CUDA_ATTN_GQA=1,DASLLAMA_CUDA_ATTN_GQA_SPLITS=4
      step prof64 120 env DASLLAMA_CUDA_PDL=0 DASLLAMA_CUDA_ATTN_GQA=1 python benchmarks/profile_cuda.py --batch 64 --steps 8
      step prof16 120 env DASLLAMA_CUDA_PDL=0 DASLLAMA_CUDA_ATTN_GQA=1 python benchmarks/profile_cuda.py --batch 16 --steps 16
      step prof4 120 env DASLLAMA_CUDA_PDL=0 DASLLAMA_CUDA_ATTN_GQA=1 python benchmarks/profile_cuda.py --batch 4 --steps 16
      step prof1 120 env DASLLAMA_CUDA_PDL=0 DASLLAMA_CUDA_ATTN_GQA=1 python benchmarks/profile_cuda.py --steps 16
      ;;
    vk_ki8)  # the thirtieth session's Vulkan K-quant GEMVs on int8 (opt-in, checked on lavapipe only)
      step tests 200 python -m pytest -q tests/test_vulkan.py -k "k_quant_int8 or block_formats"
      step ab 240 python benchmarks/ab_cuda.py --device vulkan --types q4_k_m,q6_K,q5_K --rounds 2 \
        DASLLAMA_VULKAN_KI8=0 DASLLAMA_VULKAN_KI8=1
      ;;
    cublas)  # the f16 prefill's products through cuBLAS (the default where found) against our tiles
      step tests 240 python -m pytest -q tests/test_backend_ops.py tests/test_cuda.py \
        -k "f16 and not pre_ampere"
      step ab 300 python benchmarks/ab_cuda.py --types f16,q4_k_m --no-tg --rounds 2 \
        DASLLAMA_CUDA_CUBLAS=0 DASLLAMA_CUDA_CUBLAS=1
      ;;
    cm2)  # NVIDIA's workgroup-scope matrices for the Vulkan f16 prefill (needs .vkb/glslang from
      # tools/build_glslang.sh carried: the build then has gemm_f16m): tests, then the A/B, every
      # setting with the extensions on (Vulkan 1.3) so only the tiles differ. Nothing to time
      # where the device or the build lacks them (every cm2 setting would fall back to the default).
      if ! python -c "import dasllama, sys; f = dasllama.system_info()['devices']['vulkan']['devices'][0]['features']; print(f); sys.exit('f16 coopmat2' not in f)"; then
        echo "cm2: no workgroup-scope matrices here (the device's features above; .vkb/glslang carried?)"
        DASLLAMA_VULKAN_COOPMAT_LIST=1 python -c "import dasllama; dasllama.system_info()" 2>&1 | grep -i coopmat | tail -20
        continue
      fi
      step tests 300 env DASLLAMA_VULKAN_COOPMAT2=1 python -m pytest -q tests/test_vulkan.py -k "f16_prefill_coopmat2 or f16_model"
      step tiles 400 env DASLLAMA_VULKAN_COOPMAT2=1 python benchmarks/ab_cuda.py --device vulkan --types f16,q4_k_m \
        --no-tg --rounds 2 DASLLAMA_VULKAN_F16C=1 DASLLAMA_VULKAN_F16C=cm2 DASLLAMA_VULKAN_F16C=cm2l DASLLAMA_VULKAN_F16C=cm2m
      # q8 mode's q8_0 / q4_0 on them too, each block decoded in the tiles' loads
      step q8tiles 300 env DASLLAMA_VULKAN_COOPMAT2=1 python benchmarks/ab_cuda.py --device vulkan --types q8_0,q4_0 \
        --no-tg --rounds 2 DASLLAMA_VULKAN_F16C=1 DASLLAMA_VULKAN_F16C=cm2,DASLLAMA_VULKAN_Q8CM2=1 \
        DASLLAMA_VULKAN_F16C=cm2l,DASLLAMA_VULKAN_Q8CM2=1
      # where a pp512's time goes, shader by shader (a table a submission: the prefills')
      step prof 200 env DASLLAMA_VULKAN_COOPMAT2=1 DASLLAMA_VULKAN_COOPMAT_LIST=1 python benchmarks/ab_cuda.py \
        --device vulkan --types f16 --no-tg --rounds 1 DASLLAMA_VULKAN_F16C=1,DASLLAMA_VULKAN_PROFILE=each=14 \
        DASLLAMA_VULKAN_F16C=cm2,DASLLAMA_VULKAN_PROFILE=each=14
      ;;
    vk_defaults)
      step vk_all 540 python -m pytest -q tests/test_vulkan.py tests/test_backend_ops.py \
        -k "not smollm2 and not qwen3_asr and (not lavapipe or flash_cm or subgroup_path or block_formats_prefill)"
      ;;
    compat)  # a pre-Ampere GPU's paths (the compute_75 PTX, no tensor cores) on this one
      step pre_ampere 400 python -m pytest -q tests/test_cuda.py -k pre_ampere
      ;;
    cuda)  # CUDA A/Bs of the opt-in kernels (one process a setting pair, interleaved rounds)
      step f16h_tile 200 python benchmarks/ab_cuda.py --types f16 --no-tg --rounds 2 DASLLAMA_CUDA_F16H_TILE=128x64 DASLLAMA_CUDA_F16H_TILE=128x64k64
      step flash_f16 200 python benchmarks/ab_cuda.py --types q8_0,f16 --no-tg --rounds 2 DASLLAMA_CUDA_FLASH_F16=0 DASLLAMA_CUDA_FLASH_F16=1
      step dqf16 200 python benchmarks/ab_cuda.py --types q4_k_m --rounds 2 DASLLAMA_CUDA_DQF16=0 DASLLAMA_CUDA_DQF16=1
      ;;
    vulkan)  # Vulkan A/Bs
      step flash_cm 200 python benchmarks/ab_cuda.py --device vulkan --types q8_0,q4_0,f16 --no-tg --rounds 2 \
        DASLLAMA_VULKAN_FLASH_CM=0 DASLLAMA_VULKAN_FLASH_CM=1
      step dqf16 150 python benchmarks/ab_cuda.py --device vulkan --types q4_k_m --rounds 2 DASLLAMA_VULKAN_DQF16=0 DASLLAMA_VULKAN_DQF16=1
      step attn_dec256 120 python benchmarks/ab_cuda.py --device vulkan --shapes gemma270m --types q8_0 --rounds 2 \
        DASLLAMA_VULKAN_ATTN_DEC=0 DASLLAMA_VULKAN_ATTN_DEC=1
      ;;
    chain)  # a decode step's weight reads chained as its kernels are (bench_cuda_chain.cu; RESULTS.md,
      # forty-second session, H100 only so far): the launches' boundaries alone, on this card
      step chain 120 bash -c 'nvcc -O3 -arch=sm_90 benchmarks/bench_cuda_chain.cu -o /tmp/chain && /tmp/chain'
      ;;
    modes)  # forty-third session: a one-token step with f32 activations (fp32 mode: direct GEMVs that norm
      # x themselves, no rounding launches) beside q8 mode's int8 GEMVs, and each kernel's own share
      # of the step's timeline in both
      step ab 300 python benchmarks/ab_cuda.py --types q8_0,q4_0 --batches 4 --rounds 2 BENCH_MODE=q8 BENCH_MODE=fp32
      step prof8 120 bash -c "cd benchmarks && python profile_cuda.py --type q8_0 --steps 16"
      step prof32 120 bash -c "cd benchmarks && BENCH_MODE=fp32 python profile_cuda.py --type q8_0 --steps 16"
      step prof16 120 bash -c "cd benchmarks && python profile_cuda.py --type f16 --steps 16"
      ;;
    minb)  # forty-third session: the one-token q8 GEMVs at three blocks an SM (80 registers, unspilled)
      # against four (64, ~100 bytes spilled a thread), and auto (three where the grid fits one wave
      # of three; the build's default then); the same sums, so the model tests with the default
      step tests 300 python -m pytest -q -x tests/test_cuda.py -k "greedy_tokens or every_family or fused_decode_ops or gemv_rope"
      step ab 300 python benchmarks/ab_cuda.py --types q8_0,q4_0,f16 --batches 4 --rounds 3 DASLLAMA_CUDA_MINB1=4 \
        DASLLAMA_CUDA_MINB1=3 DASLLAMA_CUDA_MINB1=auto
      ;;
    minb2)  # the same with three as the default: the tests, and four beside the default (NCU=1: also
      # ncu of the one-token GEMVs at four and three)
      step tests 300 python -m pytest -q -x tests/test_cuda.py -k "greedy_tokens or every_family or fused_decode_ops or gemv_rope or speculated"
      step ab 200 python benchmarks/ab_cuda.py --types q8_0,q4_0 --rounds 2 DASLLAMA_CUDA_MINB1=4 DASLLAMA_NONE=1
      for q in 4 3; do
        [ -n "${NCU:-}" ] || continue
        step ncu$q 150 env DASLLAMA_CUDA_MINB1=$q ncu --clock-control none --kernel-name regex:gemv_q8 \
          --launch-skip 200 --launch-count 5 --metrics gpu__time_duration.sum,smsp__inst_executed.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio \
          python benchmarks/bench_cuda_batch.py --batch 1 --steps 6
      done
      ;;
    glu)  # the GLU tail writing ffn down's input beside its own (not over it): the tests, the
      # three-block default's, and the tail against the glu_quantize launch
      step tests 300 python -m pytest -q -x tests/test_cuda.py -k "glu_tail_over or fused_decode_ops or greedy_tokens or every_family or gemv_rope or speculated"
      step ab 200 python benchmarks/ab_cuda.py --types q8_0,q4_0 --rounds 3 DASLLAMA_CUDA_TAILS=0 DASLLAMA_CUDA_TAILS=2
      ;;
    defaults44)  # the new one-token defaults (q8 at 2 rows a group, no GLU tail): the tests that cover
      # those kernels, then the defaults beside the old ones
      step tests 300 python -m pytest -q -x tests/test_cuda.py -k "glu_tail_over or fused_decode_ops or greedy_tokens or every_family or gemv_rope or speculated or tail or q8_mode"
      step ops 200 python -m pytest -q -x tests/test_backend_ops.py -k "matmul_q8_mode or matmul_step"
      step ab 200 python benchmarks/ab_cuda.py --types q8_0,q4_0,f16 --rounds 3 DASLLAMA_NONE=1 \
        DASLLAMA_CUDA_R1=4,DASLLAMA_CUDA_TAILS=2
      ;;
    loop)  # the one-token q8 GEMVs as persistent grids (DASLLAMA_CUDA_LOOP), the next GEMV's weights
      # asked into L2 (DASLLAMA_CUDA_PF_NEXT): timed, then bit for bit
      step ab 420 python benchmarks/ab_cuda.py --types q8_0,q4_0 --rounds 2 DASLLAMA_CUDA_LOOP=0 \
        DASLLAMA_CUDA_LOOP=1 DASLLAMA_CUDA_LOOP=3 DASLLAMA_CUDA_LOOP=7 DASLLAMA_CUDA_PF_NEXT=8 \
        DASLLAMA_CUDA_PF_NEXT=32 DASLLAMA_CUDA_LOOP=3,DASLLAMA_CUDA_PF_NEXT=8
      step abf16 200 python benchmarks/ab_cuda.py --types f16 --rounds 2 DASLLAMA_CUDA_PF_NEXT=0 \
        DASLLAMA_CUDA_PF_NEXT=8 DASLLAMA_CUDA_PF_NEXT=32
      step tests 240 python -m pytest -q -x tests/test_cuda.py -k "persistent_gemv"
      step prof 90 env DASLLAMA_CUDA_LOOP=3 python benchmarks/profile_cuda.py --type q8_0 --steps 16
      ;;
    peers)  # the issues' side-by-side table: ours (CUDA, Vulkan) beside llama.cpp's CUDA and Vulkan builds
      # (batched rows beside llama-batched-bench's where .peers/llcuda.tar.xz has it: /tmp/lbb.sh)
      step table 560 python benchmarks/bench_gpu_peers.py --types q8_0,q4_0,f16,q4_k_m --rounds 2 \
        --batches 4,16,64 --batch-devices cuda --ours cuda,vulkan --llama-bench /tmp/lb.sh \
        $( [ -x /tmp/lbb.sh ] && echo --llama-batched-bench /tmp/lbb.sh ) --llama-server /tmp/skb/llama-server
      ;;
    small)  # the issue's small shapes at one stream, where launches are everything
      for sh in gemma270m smollm135m; do
        step "$sh" 280 python benchmarks/bench_gpu_peers.py --shape "$sh" --types q8_0,q4_0 --rounds 2 \
          --ours cuda,vulkan --llama-bench /tmp/lb.sh --llama-server /tmp/skb/llama-server
      done
      ;;
    *) echo "unknown stage $stage (checks, defaults, chain, modes, minb, minb2, glu, defaults44, loop, s44, s43, s42, s41, s41b, s41c, s41p, s40, s39b, s38, s38b, s38c, vk_new, cuda_new, s29, s30, s32, s32b, s32c, s32d, s33, s34, s36, s37, fold, rope, early, gqa, vk_ki8, cublas, cm2, vk_defaults, compat, cuda, vulkan, peers, small)" ;;
  esac
done
echo "gpu_plan: $* in $((SECONDS - t_all)) s"
