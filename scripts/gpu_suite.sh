#!/usr/bin/env bash
# The one command that runs every GPU test and the benchmarks on a CUDA machine.
#
#   GPU_SUITE_OUT=/some/dir bash scripts/gpu_suite.sh
#
# Writes its logs and tables to $GPU_SUITE_OUT (default ./gpu-results) and ends with a summary.
# GPU_SUITE_PARTS picks sections (default: "tests bench graph_bench serving"; also "adapter_reads", "lora_decode",
# "lora_serving", "many_adapters", "norm_shrink", "expand_silu", "lora_steps", "penalties", "expand_tiles", "stacked_afold", "afold_qkv", "many_steps", "blas_env", "scheduler", "host", "gemv", "decode_chain", "profile", "profile_compare", "prefix_cache", "soak", and "tp" on a
# machine with 2 GPUs). Files past the summary and the markdown tables are packed into logs.tar.gz at the end.
# GPU_SUITE_PYTEST_ARGS adds pytest arguments (split on spaces, e.g. "-v -x"); GPU_SUITE_PYTEST_K
# is a -k expression (may hold spaces). Wheels fetched by scripts/fetch_gpu_wheels.sh into ./.whl
# are installed into ./.site first when the machine lacks them (it has no network).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${GPU_SUITE_OUT:-$ROOT/gpu-results}
PARTS=${GPU_SUITE_PARTS:-"tests bench graph_bench serving"}  # run them as separate calls to stay under 10 min each
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT/.site:$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false
export SGLANG_CACHE_DIR=${SGLANG_CACHE_DIR:-/tmp/sglang-cache}
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || echo "wheel install failed (see pip.log)"
fi

say "== gpu_suite $(date -u +%Y-%m-%dT%H:%MZ)"
$PY - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import torch, triton, transformers
print(f"torch {torch.__version__} cuda {torch.version.cuda} triton {triton.__version__} "
      f"transformers {transformers.__version__}")
print("device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
EOF

status=0

# Whole LoRA steps of one shape with profile_forward (8 rank-16 adapters, csgmv, graphs, prefill
# 128), appended to a markdown file; its "LoRA / base" lines go to the summary with a prefix.
#   lora_step_rows <model> <markdown> <log> <summary prefix> <more profile_forward args...>
lora_step_rows() {
  local model=$1 md=$2 log=$3 prefix=$4 start tmp=/tmp/lora_step_rows.md
  shift 4
  start=$(date +%s)
  rm -f "$tmp"
  $PY benchmark/profile_forward.py --model "$model" --adapters 8 --lora-backend csgmv --paths graph --no-hf-anchor \
    --tokens 128 --tc-modes "" "$@" --out "$tmp" >>"$log" 2>&1 || status=1
  cat "$tmp" >>"$md" 2>/dev/null
  say "$prefix$model steps: $(( $(date +%s) - start ))s"
  grep -E "(LoRA|variant) / base" "$tmp" 2>/dev/null | sed "s/^/$prefix/" | tee -a "$SUMMARY"
}
if [[ " $PARTS " == *" tests "* ]]; then
  say "== GPU tests (pytest -m gpu)"
  start=$(date +%s)
  kexpr=()
  [ -n "${GPU_SUITE_PYTEST_K:-}" ] && kexpr=(-k "$GPU_SUITE_PYTEST_K")
  # --durations: the slowest tests, for planning the device minutes.
  $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE --durations=25 ${GPU_SUITE_PYTEST_ARGS:-} "${kexpr[@]}" test/registered \
    >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  say "$(tail -n 1 "$OUT/gpu_tests.log") (rc=$rc, $(( $(date +%s) - start ))s)"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20 | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" bench "* ]]; then
  say "== benchmarks"
  BENCH=$OUT/bench.log
  : >"$BENCH"
  # Issue 2's eager numbers: prefill at 128 and 2048 tokens, decode at batch 1 and 32.
  for shape in qwen3-4b llama-3.1-8b; do
    ckpt=/tmp/sglang-ckpt-$shape
    $PY -m sglang.srt.tools.make_checkpoint --arch "${shape%%-*}" --preset "$shape" --no-weights --out "$ckpt" >>"$BENCH" 2>&1
    for cfg in "1 128 16" "1 2048 2" "32 128 16"; do
      set -- $cfg
      line=$($PY -m sglang.bench_one_batch --model-path "$ckpt" --load-format dummy --disable-cuda-graph \
        --max-total-tokens 65536 --batch-size "$1" --input-len "$2" --output-len "$3" --warmup 2 --repeats 5 \
        2>>"$BENCH" | tail -n 1)
      echo "bench_one_batch $shape eager bs=$1 in=$2 out=$3: $line" | tee -a "$BENCH" >>"$SUMMARY"
    done
  done
fi

if [[ " $PARTS " == *" graph_bench "* ]]; then
  # Issue 4's and 5's sweep: LoRA x {eager, breakable, full} side by side, one model shape per
  # process so that a run cut short keeps the finished shapes' tables.
  say "== prefill/decode graph benchmark"
  : >"$OUT/prefill_graph.md"
  for model in ${GPU_SUITE_BENCH_MODELS:-qwen3-4b llama-3.1-8b qwen2.5-0.5b}; do
    start=$(date +%s)
    $PY benchmark/lora/bench_prefill_graph.py --models "$model" --out "/tmp/prefill_graph_$model.md" \
      >>"$OUT/graph_bench.log" 2>&1 || status=1
    cat "/tmp/prefill_graph_$model.md" >>"$OUT/prefill_graph.md" 2>/dev/null
    say "$model: $(( $(date +%s) - start ))s"
    grep -E "^- " "/tmp/prefill_graph_$model.md" 2>/dev/null | sed "s/^- /- $model /" >>"$SUMMARY"
  done
fi

if [[ " $PARTS " == *" profile "* ]]; then
  # Issue 10's table: wall vs GPU-busy, kernels per layer, torch ops and top kernels per path, base
  # and rank-16 LoRA, side by side with HF transformers + torch.compile in the same call (its own process; 8B
  # shape, ~5.5 min on an H200, most of it torch.compile); the Qwen3-4B shape, base only, for its
  # decode aim row (~1 min). One process per shape.
  # GPU_SUITE_PROFILE_MODELS picks shapes (default: both).
  say "== profile_forward (lean forward)"
  : >"$OUT/profile_forward.md"
  for model in ${GPU_SUITE_PROFILE_MODELS:-llama-3.1-8b qwen3-4b}; do
    start=$(date +%s)
    case $model in
      llama-3.1-8b) extra=(--tokens 128,2048,4096) ;;
      *) extra=(--tokens 128 --lora none --no-hf-anchor) ;;
    esac
    $PY benchmark/profile_forward.py --model "$model" "${extra[@]}" ${GPU_SUITE_TC_MODES+--tc-modes "$GPU_SUITE_TC_MODES"} \
      --out "/tmp/profile_forward_$model.md" \
      >>"$OUT/profile.log" 2>&1 || status=1
    cat "/tmp/profile_forward_$model.md" >>"$OUT/profile_forward.md" 2>/dev/null
    say "$model: $(( $(date +%s) - start ))s"
    grep -E "^\| $model \| (none|lora) \| (prefill 128|decode bs1) \|" "/tmp/profile_forward_$model.md" 2>/dev/null \
      | cut -d'|' -f3-10 >>"$SUMMARY"
    grep -E "^- .* = \*\*" "/tmp/profile_forward_$model.md" 2>/dev/null >>"$SUMMARY"
  done
fi

if [[ " $PARTS " == *" profile_compare "* ]]; then
  # One forward shape profiled from two trees in this one call, alternating (before, after,
  # before, after), so a refactor can show it is no slower: GPU_SUITE_BEFORE is a tarball of the
  # other tree (`git archive -o before.tar.gz REV python benchmark`, carried to the machine).
  # Default shape: the 8B, 128-token prefill and decode batch 1 on the graphs, base and LoRA.
  say "== profile_compare (${GPU_SUITE_BEFORE:-no GPU_SUITE_BEFORE given})"
  before=$(mktemp -d)
  if [ -n "${GPU_SUITE_BEFORE:-}" ] && tar xzf "$GPU_SUITE_BEFORE" -C "$before"; then
    : >"$OUT/profile_compare.md"
    for round in 1 2; do
      for side in before after; do
        tree=$ROOT; extra=(--tc-modes "")  # the same paths on both sides: no tc_piecewise
        [ $side = before ] && tree=$before && extra=()
        start=$(date +%s)
        PYTHONPATH=$tree/python:$ROOT/.site $PY "$tree/benchmark/profile_forward.py" --model llama-3.1-8b \
          --tokens 128 --paths graph --no-hf-anchor "${extra[@]}" ${GPU_SUITE_COMPARE_ARGS:-} \
          --out "/tmp/compare_$side$round.md" \
          >>"$OUT/profile_compare.log" 2>&1 || status=1
        { echo "### $side (round $round)"; cat "/tmp/compare_$side$round.md" 2>/dev/null; echo; } >>"$OUT/profile_compare.md"
        say "$side round $round: $(( $(date +%s) - start ))s"
        grep -E "^\| llama-3.1-8b \| (none|lora) \| (prefill 128|decode bs1) \|" "/tmp/compare_$side$round.md" 2>/dev/null \
          | cut -d'|' -f3-10 | sed "s/^/$side$round /" >>"$SUMMARY"
      done
    done
  else
    status=1
  fi
fi

if [[ " $PARTS " == *" norm_shrink "* ]]; then
  # Issue 16: the norm fused into the folded qkv / gate_up shrink_pack at decode (--lora-fuse-norm;
  # benchmark/lora/bench_norm_shrink.py), GPU µs per step under graph replay against the two
  # kernels it replaces and the base, then whole Qwen3-4B decode steps with the norms apart, fused
  # (on) and row-wise, folded and unfolded (~3 min).
  say "== norm + shrink_pack fused (decode)"
  start=$(date +%s)
  # GPU_SUITE_NORM_TILES (e.g. "32768 65536") also times the fused kernel with wider column tiles;
  # GPU_SUITE_NORM_ARGS more bench_norm_shrink arguments (e.g. "--early-start --decode-bs 1 8 64").
  $PY benchmark/lora/bench_norm_shrink.py ${GPU_SUITE_NORM_TILES:+--tile-elements $GPU_SUITE_NORM_TILES} \
    ${GPU_SUITE_NORM_ARGS:-} --out "$OUT/norm_shrink.md" >"$OUT/norm_shrink.log" 2>&1 || status=1
  say "norm_shrink: $(( $(date +%s) - start ))s"
  grep -E "^\| [0-9]+ \||^\| (qwen|llama)" "$OUT/norm_shrink.md" 2>/dev/null >>"$SUMMARY"
fi
# The whole decode step with --lora-fuse-norm against LoRA without it and the base, in one process
# (GPU_SUITE_NORM_STEPS=0: the kernel table above only).
if [[ " $PARTS " == *" norm_shrink "* && "${GPU_SUITE_NORM_STEPS:-1}" != 0 ]]; then
  : >"$OUT/norm_shrink_steps.md"
  lora_step_rows qwen3-4b "$OUT/norm_shrink_steps.md" "$OUT/norm_shrink.log" "" \
    --lora none,lora-unfused,lora-fused,lora-rowwise --decode-bs 1,64 --decode-adapters 1,8
  # Unfolded modules (what qkv / gate_up are with many slots): base GEMM + shrink + expand, the
  # norm computing the shrink with --lora-fuse-norm on.
  lora_step_rows qwen3-4b "$OUT/norm_shrink_steps.md" "$OUT/norm_shrink.log" "unfolded " \
    --lora none,lora-unfused,lora-fused --lora-fold off --decode-bs 1,64 --decode-adapters 1,8
fi

if [[ " $PARTS " == *" expand_silu "* ]]; then
  # Issues 16 / 18: 64 slots (qkv_proj and gate_up_proj unfolded), gate_up_proj's expand in the
  # SiLU-and-mul's kernel at every batch (SGLANG_LORA_EXPAND_SILU=1) against the default (prefills
  # from 1,024 tokens), whole steps (prefill 512 and 16 x 512, decode 64 on 32 adapters), each LoRA
  # kernel's time listed, after the GPU test that checks it against eager and the engine without it
  # (~3 min).
  say "== gate_up's expand in the SiLU-and-mul (64 slots)"
  start=$(date +%s)
  # GPU_SUITE_ES_TEST=0 skips the test; GPU_SUITE_ES_ARGS replaces the step arguments (e.g. other
  # variants: lora-expand-silu-256 / -64, the fused kernel's column tile).
  if [ "${GPU_SUITE_ES_TEST:-1}" != 0 ]; then
    $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE -k expand_silu test/registered \
      >"$OUT/expand_silu_test.log" 2>&1 || status=1
    say "expand_silu test: $(tail -n 1 "$OUT/expand_silu_test.log")"
  fi
  # shellcheck disable=SC2086
  lora_step_rows qwen3-4b "$OUT/expand_silu.md" "$OUT/expand_silu.log" "" --adapters 64 --rounds 2 --max-total-tokens 32768 \
    ${GPU_SUITE_ES_ARGS:---lora none,lora,lora-expand-silu --tokens 512 --prefill-batches 16x512 --decode-bs 64 --decode-adapters 32}
  say "expand_silu: $(( $(date +%s) - start ))s"
fi

if [[ " $PARTS " == *" lora_steps "* ]]; then
  # Issue 16's whole-step rows in one process per shape (~2 min each): the base, LoRA as served
  # (--lora-fuse-norm auto, o_proj / down_proj row-wise at small decode batches), LoRA with the
  # norms apart (off), and the default without the row-wise kernels (lora-segments,
  # SGLANG_LORA_ROWWISE_DECODE=0) and with the row-wise kernels up to 32 rows (rows:32, where the
  # crossover may lie), 8 rank-16 adapters, csgmv, graphs:
  # prefill 128 (breakable), decode 1, 8, 32 and 64 on 1 and 8 adapters; the runners measured in
  # turn over three rounds (--rounds), so the order in the process does not pick the winner.
  # GPU_SUITE_STEPS_MODELS picks shapes, GPU_SUITE_STEPS_VARIANTS the --lora variants (e.g.
  # "none,lora,lora-prefill-unfold": csgmv's folded modules apart at prefill; lora-expand-pdl: the
  # expand as a programmatic dependent; lora-chunk-32 / lora-chunk-64: csgmv's segment rows;
  # lora-pack-in-place: without the A-fold at prefill; lora-copying: nor the norms and SiLU-and-mul
  # writing into x_aug at prefill; lora-norm-release: RMSNorm releasing its PDL dependents;
  # lora-late-loads / none-late-loads: EARLY_LOADS, WEIGHT_FIRST, LOC_FIRST off; lora-norm-weight-early:
  # NORM_WEIGHT_EARLY on; lora-norm-weight-late: off, under SGLANG_LORA_NORM_WEIGHT_EARLY=1;
  # lora-no-fold-gemv: cuBLAS over all of W_aug at one-row decode batches; lora-no-afold-gemv:
  # cuBLAS over the A-folded o_proj / down_proj's [W; A] at one row, SGLANG_LORA_AFOLD_GEMV=0) and
  # GPU_SUITE_STEPS_ARGS adds profile_forward arguments (e.g. "--prefill-batches 16x512").
  say "== LoRA steps: default (fused norms, row-wise at small batches) vs unfused vs segments only vs base"
  : >"$OUT/lora_steps.md"
  for model in ${GPU_SUITE_STEPS_MODELS:-qwen3-4b llama-3.1-8b}; do
    lora_step_rows "$model" "$OUT/lora_steps.md" "$OUT/lora_steps.log" "" \
      --lora "${GPU_SUITE_STEPS_VARIANTS:-none,lora-unfused,lora-segments,lora,lora-rowwise-32}" \
      --decode-bs 1,8,32,64 --decode-adapters 1,8 --rounds 3 ${GPU_SUITE_STEPS_ARGS:-}
  done
fi

if [[ " $PARTS " == *" penalties "* ]]; then
  # Sampling penalties, logit_bias and min_new_tokens: the sampling tail of a 64-request decode
  # step as served, beside the base decode step of the same shape (benchmark/bench_penalties.py, ~1 min).
  say "== sampling penalties vs the decode step"
  start=$(date +%s)
  $PY benchmark/bench_penalties.py --model qwen3-4b --bs 64 --out "$OUT/penalties.md" >"$OUT/penalties.log" 2>&1 || status=1
  say "penalties: $(( $(date +%s) - start ))s"
  grep -E "^\| [a-z-]+ \||^Base decode" "$OUT/penalties.md" 2>/dev/null | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" gemv "* ]]; then
  # Issue 21: the decode GEMMs at batch 1-8 against the weight-read floor, cuBLAS against a
  # candidate Triton GEMV (benchmark/bench_gemv.py), before anything is built on it (~1.5 min).
  say "== decode GEMMs: cuBLAS vs a Triton GEMV"
  start=$(date +%s)
  # GPU_SUITE_GEMV_ARGS adds arguments, e.g. "--bs 1 --fold-slots 8": the LoRA-folded GEMMs, cuBLAS
  # against the engine's one-row GEMVs (lora/triton_ops/fold_gemv.py).
  $PY benchmark/bench_gemv.py ${GPU_SUITE_GEMV_ARGS:-} --out "$OUT/gemv.md" >"$OUT/gemv.log" 2>&1 || status=1
  say "gemv: $(( $(date +%s) - start ))s"
  grep -E "^\| (llama|qwen)" "$OUT/gemv.md" 2>/dev/null | cut -d'|' -f2-16 >>"$SUMMARY"
fi

if [[ " $PARTS " == *" decode_chain "* ]]; then
  # Issue 21: a decode layer's kernel chain at batch 1 and 8 (benchmark/bench_decode_chain.py):
  # cuBLAS against a Triton GEMV, with and without programmatic dependent launch and an L2
  # prefetch of the weights before the dependency wait (~2 min).
  say "== decode chain: PDL and weight prefetch"
  start=$(date +%s)
  $PY benchmark/bench_decode_chain.py ${GPU_SUITE_CHAIN_ARGS:-} --out "$OUT/decode_chain.md" >"$OUT/decode_chain.log" 2>&1 || status=1
  say "decode_chain: $(( $(date +%s) - start ))s"
  grep -E "^\| (llama|qwen)" "$OUT/decode_chain.md" 2>/dev/null | cut -d'|' -f2-8 >>"$SUMMARY"
fi

if [[ " $PARTS " == *" expand_tiles "* ]]; then
  # Issue 18: the unfolded expand's tile plans (benchmark/lora/bench_expand_tiles.py) at 64 slots,
  # decode 64 on 1-64 adapters and a prefill, each plan checked bit for bit against the default (~1 min).
  say "== unfolded expand tile plans"
  start=$(date +%s)
  $PY benchmark/lora/bench_expand_tiles.py --out "$OUT/expand_tiles.md" >"$OUT/expand_tiles.log" 2>&1 || status=1
  say "expand_tiles: $(( $(date +%s) - start ))s"
  grep -E "^\| (qkv|gate)" "$OUT/expand_tiles.md" 2>/dev/null | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" stacked_afold "* ]]; then
  # Issue 16: qkv_proj / gate_up_proj as folded today (shrink_pack or the fused norm, GEMM over
  # W_aug) against the A-fold's shape (GEMM over [W; A], the expand into a strided output), kernels
  # only, 8 adapters, prefill 128 / 4x128 / 512 and decode 64 (benchmark/lora/bench_stacked_afold.py, ~1 min).
  say "== qkv / gate_up: the B fold against the A-fold"
  start=$(date +%s)
  $PY benchmark/lora/bench_stacked_afold.py --out "$OUT/stacked_afold.md" >"$OUT/stacked_afold.log" 2>&1 || status=1
  say "stacked_afold: $(( $(date +%s) - start ))s"
  grep -E "^\| (qwen|llama)" "$OUT/stacked_afold.md" 2>/dev/null | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" afold_qkv "* ]]; then
  # Issue 16: qkv_proj A-folded at prefill (SGLANG_LORA_AFOLD_QKV, prefills up to 1,024 tokens): its GPU
  # test (graph = eager, the expand launched), then whole steps of both shapes, the default against
  # the A-fold never (lora-no-afold-qkv) and at every prefill (lora-afold-qkv): prefill 128 and 512
  # (GPU_SUITE_AFOLD_TOKENS) and decode 64 on 8 adapters (~3 min).
  say "== qkv_proj's A-fold at prefill"
  start=$(date +%s)
  $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE -k afold_qkv test/registered \
    >"$OUT/afold_qkv_test.log" 2>&1 || status=1
  say "afold_qkv test: $(tail -n 1 "$OUT/afold_qkv_test.log")"
  for model in ${GPU_SUITE_AFOLD_MODELS:-qwen3-4b llama-3.1-8b}; do
    # A 16,384-token KV pool per runner: with the default 65,536 a third 8B runner finds no room on
    # an 80 GB card. 4x512 (2,048-token graphs) on the 4B shape alone.
    batches=(); [ "$model" = qwen3-4b ] && batches=(--prefill-batches 4x512)
    lora_step_rows "$model" "$OUT/afold_qkv.md" "$OUT/afold_qkv.log" "" --lora none,lora,lora-no-afold-qkv,lora-afold-qkv \
      --tokens ${GPU_SUITE_AFOLD_TOKENS:-128,512} "${batches[@]}" --decode-bs 64 --decode-adapters 8 --rounds 2 --max-total-tokens 16384
  done
  say "afold_qkv: $(( $(date +%s) - start ))s"
fi

if [[ " $PARTS " == *" many_steps "* ]]; then
  # Issue 18's bound: the decode step of a 64-slot server (z64-64's shape: 64 running requests on
  # many distinct adapters), Qwen3-4B, csgmv, graphs: 8, 32 and 64 distinct adapters in a batch of
  # 64, the fold rule's choice (auto: at 64 slots qkv and gate_up unfold, o and down stay folded),
  # that with the norms apart (lora-unfused; the default fuses them, unfolded modules too), and every module folded
  # (on), with the base beside them (~3 min), and a prefill of 16 requests x 512 tokens on 16
  # adapters (a serving wave's prefill batch: z64-64's TTFT was 1.46x the base's in the eleventh
  # session while its ITL was 1.16x), beside lora-prefill-unfold (SGLANG_LORA_PREFILL_UNFOLD=1:
  # o_proj / down_proj, folded at 64 slots with 1,024 extra columns, run apart at prefill). The
  # top kernels and per-launch times say where the per-adapter cost grows.
  say "== many-slot decode steps (64 slots)"
  : >"$OUT/many_steps.md"
  # GPU_SUITE_MANY_VARIANTS picks the fold=auto variants; GPU_SUITE_MANY_FOLD_ON=0 skips fold=on.
  lora_step_rows qwen3-4b "$OUT/many_steps.md" "$OUT/many_steps.log" "fold=auto " \
    --adapters 64 --lora-fold auto --lora "${GPU_SUITE_MANY_VARIANTS:-none,lora,lora-unfused,lora-prefill-unfold}" \
    --tokens "" --prefill-batches 16x512 --decode-bs 64 --decode-adapters 8,32,64 --rounds 2
  if [[ "${GPU_SUITE_MANY_FOLD_ON:-1}" != 0 ]]; then
    lora_step_rows qwen3-4b "$OUT/many_steps.md" "$OUT/many_steps.log" "fold=on " \
      --adapters 64 --lora-fold on --lora none,lora --tokens "" --prefill-batches 16x512 \
      --decode-bs 64 --decode-adapters 8,32,64 --rounds 2
  fi
fi

if [[ " $PARTS " == *" blas_env "* ]]; then
  # Issue 21: cuBLAS picks split-K GEMMs at decode (o_proj and down_proj at batch 1: 72 extra
  # `splitKreduce_kernel` launches per Qwen3-4B step). Without a workspace it cannot split K that
  # way; whether the GEMMs it picks instead cost less than the reductions they save is measured
  # here: base decode 1 / 8 / 64 and prefill 128 under graphs, one process per setting (cuBLAS reads
  # the variables when its handle is made), both shapes (~1 min per process).
  say "== decode without a cuBLAS workspace (split-K reductions) vs the default"
  : >"$OUT/blas_env.md"
  for model in ${GPU_SUITE_BLAS_MODELS:-qwen3-4b llama-3.1-8b}; do
    for setting in default no-workspace; do
      start=$(date +%s)
      rm -f /tmp/blas_env.md
      case $setting in
        default) envs=() ;;
        no-workspace) envs=(CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0) ;;
      esac
      env "${envs[@]}" $PY benchmark/profile_forward.py --model "$model" --lora none --paths graph --no-hf-anchor \
        --tokens 128 --tc-modes "" --decode-bs 1,8,64 --rounds 3 --out /tmp/blas_env.md >>"$OUT/blas_env.log" 2>&1 || status=1
      { echo "#### $model, $setting"; cat /tmp/blas_env.md; } >>"$OUT/blas_env.md" 2>/dev/null
      say "$model $setting: $(( $(date +%s) - start ))s"
      grep -E "^\| $model \| none \|" /tmp/blas_env.md 2>/dev/null | cut -d'|' -f4-9 | sed "s/^/$model $setting /" | tee -a "$SUMMARY"
    done
  done
fi

if [[ " $PARTS " == *" scheduler "* ]]; then
  # The scheduler's host time per decode turn outside the forward (benchmark/profile_scheduler.py):
  # Qwen3-4B shape, dummy weights, graphs, 8 and 64 greedy streaming requests, in-process on real
  # pipes (~1.5 min), ordinary and with --enable-overlap-schedule (where the turn should come
  # down to the GPU's step). Without the overlap schedule all of it is GPU idle time in every step.
  say "== scheduler host time per decode turn"
  start=$(date +%s)
  $PY benchmark/profile_scheduler.py --model qwen3-4b --bs 8 64 --overlap --out "$OUT/scheduler.md" >"$OUT/scheduler.log" 2>&1 || status=1
  say "scheduler: $(( $(date +%s) - start ))s"
  grep -E "^\| [0-9]+ \|" "$OUT/scheduler.md" 2>/dev/null | tee -a "$SUMMARY"
  grep -E "^- overlap" "$OUT/scheduler.md" 2>/dev/null | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" host "* ]]; then
  # The host side of decode steps (issues 16, 21): each phase of a step's host time and cProfile's
  # top functions, base and LoRA (8 adapters, csgmv), the batch repeating and changing every step,
  # in a process never profiled (benchmark/profile_host.py; ~1 min per shape).
  # GPU_SUITE_HOST_MODELS picks shapes.
  say "== host time of decode steps"
  : >"$OUT/host.md"
  for model in ${GPU_SUITE_HOST_MODELS:-qwen3-4b llama-3.1-8b}; do
    start=$(date +%s)
    $PY benchmark/profile_host.py --model "$model" --bs 1 64 --adapters 8 --out "/tmp/host_$model.md" \
      >>"$OUT/host.log" 2>&1 || status=1
    cat "/tmp/host_$model.md" >>"$OUT/host.md" 2>/dev/null
    say "$model host: $(( $(date +%s) - start ))s"
    grep -E "^- bs " "/tmp/host_$model.md" 2>/dev/null | sed "s/^- /- $model /" >>"$SUMMARY"
  done
fi

if [[ " $PARTS " == *" lora_decode "* ]]; then
  # Issue 16's measurements: the LoRA kernels at serving shapes (decode batch x distinct adapters x
  # rank, prefill 4x512 / 8x256 on 8 adapters) against the base GEMMs, then whole steps with
  # profile_forward (8 rank-16 adapters in 8 slots, csgmv, graphs): LoRA step / base step and the
  # LoRA kernels' GPU time. One process per shape; GPU_SUITE_DECODE_MODELS picks shapes (default
  # both), GPU_SUITE_KERNEL_TUNINGS adds fold variants with other kernel knobs (e.g. "k256 k256w8"),
  # GPU_SUITE_KERNEL_ARGS more bench_lora_kernels arguments (e.g. "--ranks 16 --decode-bs 64
  # --slots 9 65 --slot-sweep-prefill 16x512": the fold crossover at a serving wave's prefill).
  say "== LoRA decode at serving shapes"
  : >"$OUT/lora_kernels.md"
  : >"$OUT/lora_steps.md"
  for model in ${GPU_SUITE_DECODE_MODELS:-qwen3-4b llama-3.1-8b}; do
    start=$(date +%s)
    $PY benchmark/lora/bench_lora_kernels.py --models "$model" ${GPU_SUITE_KERNEL_TUNINGS:+--tunings $GPU_SUITE_KERNEL_TUNINGS} \
      ${GPU_SUITE_KERNEL_ARGS:-} --out "/tmp/lora_kernels_$model.md" >>"$OUT/lora_decode.log" 2>&1 || status=1
    cat "/tmp/lora_kernels_$model.md" >>"$OUT/lora_kernels.md" 2>/dev/null
    say "$model kernels: $(( $(date +%s) - start ))s"
    lora_step_rows "$model" "$OUT/lora_steps.md" "$OUT/lora_decode.log" "" --lora none,lora \
      --prefill-batches 4x512,8x256 --decode-bs 1,8,32,64,128 --decode-adapters 1,4,8
  done
fi

if [[ " $PARTS " == *" serving "* ]]; then
  say "== bench_serving (Qwen3-4B shape, dummy weights, triton attention)"
  ckpt=/tmp/sglang-ckpt-qwen3-4b
  [ -f "$ckpt/config.json" ] || $PY -m sglang.srt.tools.make_checkpoint --arch qwen3 --preset qwen3-4b --no-weights --out "$ckpt" >/dev/null 2>&1
  SERVE_LOG=$OUT/serving.log
  $PY -m sglang.launch_server --model-path "$ckpt" --load-format dummy --port 31000 \
    --attention-backend triton >"$SERVE_LOG" 2>&1 &
  spid=$!
  for _ in $(seq 1 300); do
    $PY -c "import requests,sys; sys.exit(requests.get('http://127.0.0.1:31000/health',timeout=2).status_code!=200)" \
      >/dev/null 2>&1 && break
    kill -0 $spid 2>/dev/null || break
    sleep 1
  done
  $PY -m sglang.bench_serving --base-url http://127.0.0.1:31000 --num-prompts 256 \
    --random-input-len 512 --random-output-len 128 --max-concurrency 64 >>"$SERVE_LOG" 2>&1 || status=1
  grep -E "TTFT|ITL|E2E|throughput|^\{" "$SERVE_LOG" | tail -n 12 | tee -a "$SUMMARY"
  kill $spid 2>/dev/null; wait $spid 2>/dev/null
fi

if [[ " $PARTS " == *" lora_serving "* ]]; then
  # The LoRA serving table in one call: bench_serving with the same load (256 x 512 -> 128,
  # concurrency 64, rank-16 adapters on all seven modules) against a server without LoRA and the
  # LoRA servers (csgmv / triton on 8 slots, uniform and zipf picks; 16 adapters on 16 slots; 8
  # rank-64 adapters; a second base server last, for the spread). ~6 minutes on an H200, mostly
  # server start-ups (graph capture);
  # GPU_SUITE_LORA_CONFIGS picks others (bench_lora_serving.py lists them), and
  # GPU_SUITE_DRY_RUN=1 runs it on a CPU at tiny shapes (plumbing only).
  say "== lora_serving (Qwen3-4B shape, dummy weights, triton attention, graphs on)"
  start=$(date +%s)
  $PY benchmark/lora/bench_lora_serving.py --out "$OUT/lora_serving.md" --log-dir "$OUT/lora_serving" \
    ${GPU_SUITE_LORA_CONFIGS:+--configs "$GPU_SUITE_LORA_CONFIGS"} ${GPU_SUITE_DRY_RUN:+--dry-run} \
    >"$OUT/lora_serving.log" 2>&1 || status=1
  say "lora_serving: $(( $(date +%s) - start ))s"
  grep -E "^\[lora_serving\]" "$OUT/lora_serving.log" | tee -a "$SUMMARY"
  cat "$OUT/lora_serving.md" 2>/dev/null | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" adapter_reads "* ]]; then
  # Issue 18's start-up: 16 Qwen3-4B rank-16 adapters read every way the engine can, at 1 and 8
  # threads, and short CUDA calls (a capture's pattern) alone and beside a pure-Python thread and
  # beside adapter readers (benchmark/lora/bench_adapter_reads.py, ~1.5 min).
  say "== adapter reads"
  start=$(date +%s)
  $PY benchmark/lora/bench_adapter_reads.py --out "$OUT/adapter_reads.md" >"$OUT/adapter_reads.log" 2>&1 || status=1
  say "adapter_reads: $(( $(date +%s) - start ))s"
  cat "$OUT/adapter_reads.md" 2>/dev/null | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" many_adapters "* ]]; then
  # More adapters than slots (issue 18's table): the same load against the base server and csgmv
  # servers with 64 adapters (zipf alpha 1) on 64 slots (auto fold, and --lora-fold on: the fold
  # crossover) and on 16 slots, 8 adapters (uniform) on 4 slots, a 64-slot LoRA server with no adapter at start (its start-up against z64-64's is what
  # loading 64 adapters costs) and z64-64 with its adapters read beside the capture, not before it
  # (z64-64-overlap, listed first: the first LoRA server also compiles the Triton kernels, so the
  # two compared start-ups come after it); GPU_SUITE_MANY_CONFIGS=base,z256-64 runs the 256-adapter server (its own call: 256
  # adapters to load at start). Reports per-adapter p99 TTFT against the base's and start-up times.
  say "== many_adapters (Qwen3-4B shape, dummy weights, triton attention, graphs on)"
  start=$(date +%s)
  $PY benchmark/lora/bench_lora_serving.py --out "$OUT/many_adapters.md" --log-dir "$OUT/many_adapters" \
    --configs "${GPU_SUITE_MANY_CONFIGS:-base,z64-64-overlap,lora0-64,z64-64,z64-64-fold,z64-16,u8-4}" ${GPU_SUITE_DRY_RUN:+--dry-run} \
    >"$OUT/many_adapters.log" 2>&1 || status=1
  say "many_adapters: $(( $(date +%s) - start ))s"
  grep -E "^\[lora_serving\]" "$OUT/many_adapters.log" | tee -a "$SUMMARY"
  cat "$OUT/many_adapters.md" 2>/dev/null | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" soak "* ]]; then
  # Not in the default parts: GPU_SUITE_PARTS=soak. About 3 minutes of load (SGLANG_SOAK_SECONDS)
  # against the Qwen3-4B shape (dummy weights, triton attention, graphs on, csgmv LoRA); the report
  # JSON and the server's log land in $OUT.
  say "== soak (Qwen3-4B shape, dummy weights, csgmv LoRA, CUDA graphs on)"
  start=$(date +%s)
  SGLANG_SOAK_GPU=1 SGLANG_SOAK_SECONDS=${SGLANG_SOAK_SECONDS:-180} SGLANG_SOAK_REPORT=$OUT/soak_report.json \
    SGLANG_SOAK_LOG_DIR=$OUT/soak_server \
    $PY -m pytest -q -s -m gpu -p no:cacheprovider -o addopts="" -rfE -k test_soak_gpu \
    test/registered/reliability/test_soak.py >"$OUT/soak.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  say "$(tail -n 1 "$OUT/soak.log") (rc=$rc, $(( $(date +%s) - start ))s)"
  grep -E "^\[soak\]|^(FAILED|ERROR)" "$OUT/soak.log" | head -20 | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" prefix_cache "* ]]; then
  # Issue 12's measurement, in one call (~4 min): prefix cache on vs off, base and 8 adapters,
  # Qwen3-4B shape (dummy weights), generated-shared-prefix workload (16 groups x 16 requests,
  # 2,048-token system prompts). Writes $OUT/prefix_cache.md and the two servers' logs.
  say "== prefix cache on vs off (Qwen3-4B shape, dummy weights, 8 adapters)"
  start=$(date +%s)
  $PY benchmark/prefix_cache/bench_prefix_cache.py --out "$OUT/prefix_cache.md" >"$OUT/prefix_cache.log" 2>&1 \
    || status=1
  say "prefix_cache: $(( $(date +%s) - start ))s"
  cat "$OUT/prefix_cache.md" 2>/dev/null | tee -a "$SUMMARY"
fi

if [[ " $PARTS " == *" tp "* ]]; then
  # Issue 13 on two GPUs (skipped with fewer), NVLink multicast off everywhere:
  # the tp GPU tests (bf16 tp 2 tracks tp 1; graphs == eager at tp 2 with LoRA; the sharded
  # layers' all-reduces inside graphs), test_bcg_with_lora.py at --tp-size 2, then bench_tp.py
  # (8B shape tp 1 vs tp 2; a 70B-shaped LoRA server on 2 GPUs: decode at batch 1 vs its floor,
  # bench_serving with adapters). GPU_SUITE_TP_BENCH_PARTS picks bench_tp parts ("forward serve70b").
  say "== tensor parallelism (2 GPUs)"
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  start=$(date +%s)
  $PY -m pytest -q -s -m gpu -p no:cacheprovider -o addopts="" -rfE test/registered/distributed/test_tp_gpu.py \
    test/registered/distributed/test_tp_nccl_gpu.py >"$OUT/tp_tests.log" 2>&1
  rc=$?
  $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts="" -rfE -k tp2 \
    test/registered/cuda_graph/breakable/test_bcg_with_lora.py >>"$OUT/tp_tests.log" 2>&1
  rc2=$?
  [ $rc -ne 0 ] || [ $rc2 -ne 0 ] && status=1
  say "tp tests: rc=$rc/$rc2, $(( $(date +%s) - start ))s"
  grep -E "passed|failed|skipped|^(FAILED|ERROR)" "$OUT/tp_tests.log" | head -20 | tee -a "$SUMMARY"
  start=$(date +%s)
  $PY benchmark/bench_tp.py --parts ${GPU_SUITE_TP_BENCH_PARTS:-forward serve70b} --out "$OUT/tp.md" \
    --log-dir "$OUT/tp_bench" >"$OUT/tp_bench.log" 2>&1 || status=1
  say "bench_tp: $(( $(date +%s) - start ))s"
  cat "$OUT/tp.md" 2>/dev/null | tee -a "$SUMMARY"
fi

# At most 8 files come back from a device call: keep the summary and the tables, pack the rest.
extra=$(cd "$OUT" && find . -type f ! -name summary.txt ! -name '*.md' ! -name logs.tar.gz | sort)
if [ -n "$extra" ]; then
  (cd "$OUT" && echo "$extra" | tar czf logs.tar.gz -T - && echo "$extra" | xargs rm -f && find . -type d -empty -delete)
fi
say "== done (status=$status)"
exit $status
