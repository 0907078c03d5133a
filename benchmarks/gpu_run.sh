#!/usr/bin/env bash
# dsx's checks on a GPU machine, as named suites; each fits one 10-minute command on one H100.
#   bash benchmarks/gpu_run.sh SUITE     SUITE: tests | build-ops | gather | gnn | rgnn | hetero | hetero-scale | hetero-large |
#                                         offload | offload-hide | offload-8b | offload-8b-peers |
#                                         offload-8b-sweep [1|2|3] | offload-8b-megatron |
#                                         offload-8b-capacity [1-6|3 LEN|7 ROUND SIDE|8 LEN] | offload-8b-pool ROUND |
#                                         offload-8b-pool-capacity host|ssd LEN |
#                                         offload-8b-2gpu | offload-long |
#                                         offload-ssd | ssd-threads | pinning | main | wheel
# Logs go to $OUT (default ./out); each benchmark writes benchmarks/results/<benchmark>.{json,png}, a section of
# it per shape (the sections docs/performance.md cites; a suite replaces or adds to its own and keeps the others),
# and a copy to $OUT/results/. docs/performance.md, "GPU suites", says what each runs.
set -uo pipefail
OUT=$(realpath -m "${OUT:-$PWD/out}")
RES=benchmarks/results && mkdir -p "$OUT/results" "$RES" && export PYTHONUNBUFFERED=1
suite=${1:?usage: gpu_run.sh tests|build-ops|gather|gnn|rgnn|hetero [MODELS]|hetero-scale [MODEL]|hetero-large [MODEL]|offload|offload-hide|offload-8b|offload-8b-peers|offload-8b-sweep [1|2|3]|offload-8b-megatron|offload-8b-capacity [1-6|3 LEN|7 ROUND SIDE|8 LEN]|offload-8b-pool ROUND|offload-8b-pool-capacity host|ssd LEN|offload-8b-2gpu|offload-long|offload-ssd|ssd-threads|pinning|main|wheel}
end=$((SECONDS + 570))  # what a suite may use of the command's 600 s
ngpu=$(nvidia-smi -L 2>/dev/null | tee "$OUT/nvidia-smi.log" | wc -l)
failed=0  # the script's exit status: 1 if any step failed or had no time left
log() { echo "=== $(date -u +%T) $*" | tee -a "$OUT/suites.log"; }
run() {  # run NAME SECONDS CMD...: CMD's output to $OUT/NAME.log, its exit status to suites.log
  local name=$1 limit=$2 rc; shift 2
  [ $((end - SECONDS)) -lt "$limit" ] && limit=$((end - SECONDS))
  [ "$limit" -le 0 ] && { log "$name skipped: no time left"; failed=1; return; }
  log "$name (limit ${limit}s)"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; rc=$?
  log "$name rc=$rc"; [ "$rc" -eq 0 ] || failed=1
}
# a benchmark's whole file comes back, every section as this checkout had it beside the suite's own: bring it
# back into the checkout before a suite runs on another machine, or that machine's copy drops this suite's section
keep() { for n in "$@"; do cp "$RES/$n.json" "$RES/$n.png" "$OUT/results/" 2>/dev/null; done; }
# the Llama-3-8B layer's shape and step settings, the same in every suite that merges into its sections
LLAMA_8B=(--model llama --hidden 4096 --layers 8 --heads 32 --kv-heads 8 --ffn-hidden 14336 --seq-len 8192
  --micro-batch 2 --warmup 2 --steps 4 --repeats 3 --pool-gb 40 --adam fused --child-timeout 120)
case $suite in
  tests)  # every GPU test (multigpu ones skip with a reason on one GPU)
    run gpu-tests 570 python -m pytest -q -rs -m "gpu or multigpu" -p no:cacheprovider tests/ ;;
  build-ops)  # every op the 8B offload jobs compile at their start (DeepSpeed's CPU Adam and async_io) and dsx's
              # gather op, into the machine's extension cache: a suite run next on the same warm machine starts
              # without compiling (offload-8b-capacity 3 and 8 need their whole command for the steps)
    run build-ops 300 python -m dsx.cli build-ops --config configs/gpt_llama8b_zero2_actoffload.json
    run build-dsx-ops 120 python -m dsx.cli build-ops ;;
  gather)  # the gather op's build, what the machine supports, the gather benchmark
    run build-ops 120 python -m dsx.cli build-ops
    run report 60 python -m dsx.cli report --io /tmp --io-mb 1024
    run bench-gather 300 python benchmarks/bench_gather.py --out "$RES"; keep bench_gather ;;
  gnn)  # on 2+ GPUs: GraphSAGE on 1 and 2 ranks (one feature copy per node); then dsx against PyG
    if [ "$ngpu" -ge 2 ]; then
      for n in 1 2; do
        run sage-${n}gpu 90 deepspeed --num_gpus $n examples/gnn/train_sage.py --deepspeed_config configs/gnn_sage.json \
          --nodes 2400000 --edges 62000000 --features 128 --classes 47 --train-fraction 0.08 --epochs 3 \
          --no-progress --log-json "$OUT/gnn_sage_${n}gpu.json"
      done
    fi
    run bench-sage 540 python benchmarks/bench_sage.py --out "$RES" --name bench_sage --models full,trim \
      --pyg-workers 4,8,12 --pyg-batches 20 --batches 60 --feature-table-gb 90; keep bench_sage ;;
  rgnn)  # fused-kernel bandwidth, then the three layers against PyG on 8 graph shapes
    run bench-rgnn-kernels 120 python benchmarks/bench_rgnn_kernels.py --repeats 5 --out "$RES"
    run bench-rgnn 420 python benchmarks/bench_rgnn.py --pyg-budget-s 165 --profile --out "$RES"
    keep bench_rgnn_kernels bench_rgnn ;;
  hetero)  # mini-batch RGCN / RGAT / HGT against PyG; MODELS (default rgcn) merge into the JSON, so that each
           # model, whose PyG learning runs take minutes, has a command of its own: hetero rgat, hetero hgt
    run bench-hetero 560 python benchmarks/bench_hetero.py --out "$RES" --models "${2:-rgcn}" --merge \
      --batches 8 --warmup 2 --repeats 3 --pyg-workers 4,8,12; keep bench_hetero ;;
  hetero-scale)  # on 2+ GPUs: the mini-batch example under deepspeed on 1 and 2 GPUs, 3 interleaved repeats;
                 # MODEL (default rgcn) merges into section scale, each model a command of its own: hetero-scale
                 # rgat, hetero-scale hgt (each model's part keeps the machine it ran on)
    [ "$ngpu" -ge 2 ] || { log "hetero-scale needs 2 GPUs, found $ngpu"; exit 1; }
    run bench-hetero-scale 560 python benchmarks/bench_hetero_scale.py --out "$RES" --gpus 1,2 --repeats 3 \
      --timeout 150 --merge -- --model "${2:-rgcn}" --scale 1 --epochs 2; keep bench_hetero_scale ;;
  hetero-large)  # paper features (768-dim bf16) 1.07x this GPU's memory, in host memory; the graph built on the GPU
    scale=$(python -c "
import math, sys, torch
from dsx.data.mag import MAG_NODES
row = 768 * 2  # bytes of a 768-dim bf16 paper row
scale = math.ceil(1.07 * torch.cuda.get_device_properties(0).total_memory / (MAG_NODES['paper'] * row))
avail = int(next(l for l in open('/proc/meminfo') if l.startswith('MemAvailable')).split()[1]) * 1024
need = scale * MAG_NODES['paper'] * row
if need > 0.85 * avail:
    sys.exit(f'{need / 1e9:.0f} GB of features beyond this GPU are more than 85 % of the host memory available ({avail / 1e9:.0f} GB)')
print(scale)") || { log "hetero-large: not run: the host cannot hold features beyond this GPU's memory"; exit 1; }
    run bench-hetero-large 560 python benchmarks/bench_hetero_scale.py --out "$RES" --section large \
      --gpus 1 --repeats 1 --timeout 540 -- --model "${2:-rgcn}" --scale "$scale" --features 768 --feature-dtype bf16 \
      --graph-layout csr --split 0.01,0.001,0.001 --epochs 2 --loader-probe 20; keep bench_hetero_scale ;;
  offload)  # every strategy at hidden 2048, micro-batch 8, each in its own process; the planner's frontier on it
    run bench-offload 540 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 --child-timeout 80 \
      --configs none recompute save_on_cpu ds_cpu_ckpt megatron_selective dsx_host_sel dsx_auto_budget_sel \
      dsx_auto_hide_sel dsx_auto_hide --section h2048 --out "$RES"
    run plan-frontier 60 python benchmarks/plan_frontier.py "$RES/bench_offload.json" --section h2048 \
      --config dsx_auto_hide_sel --out "$RES"
    keep bench_offload plan_frontier ;;
  offload-hide)  # the Llama decoder's no-budget plan beside no offload, 3 interleaved runs
    run bench-offload-hide 540 python benchmarks/bench_offload.py --model llama --hidden 2048 --layers 8 --heads 16 \
      --kv-heads 4 --ffn-hidden 5632 --seq-len 4096 --micro-batch 4 --warmup 2 --steps 8 --repeats 3 --pool-gb 8 \
      --child-timeout 100 --configs none dsx_auto_hide --section hide --out "$RES"
    keep bench_offload ;;
  offload-8b)  # the Llama-3-8B layer at sequence 8192, micro-batch 2 (activations, not gradients, set the peak): no
                # offload, full recompute and dsx at recompute's peak (SwiGLU activation recomputable: _sel), 3
                # interleaved runs, section 8b anew (the sweep's parts merge into it: run them after this, on the
                # same machine); then the lower bound and the planner's frontier on that run's profiles
    run bench-offload-8b 500 python benchmarks/bench_offload.py "${LLAMA_8B[@]}" --configs none recompute \
      dsx_auto_budget_sel --section 8b --out "$RES"
    run plan-frontier-8b 60 python benchmarks/plan_frontier.py "$RES/bench_offload.json" --section 8b \
      --config dsx_auto_budget_sel --out "$RES"
    keep bench_offload plan_frontier ;;
  offload-8b-peers)  # the same shape: the peers that peak at full recompute's memory or below (DeepSpeed's
                     # cpu_checkpointing, a saved-tensor-hook offload), 3 interleaved runs, merged into section
                     # 8b beside offload-8b's rows (run that first, on the same machine), so that the frontier
                     # draws every peer and checks dsx against each; then the frontier again
    run bench-offload-8b-peers 480 python benchmarks/bench_offload.py "${LLAMA_8B[@]}" --configs ds_cpu_ckpt \
      hooks_offload --merge --section 8b --out "$RES"
    run plan-frontier-8b 60 python benchmarks/plan_frontier.py "$RES/bench_offload.json" --section 8b \
      --config dsx_auto_budget_sel --out "$RES"
    keep bench_offload plan_frontier ;;
  offload-8b-sweep)  # dsx over budgets at the 8B shape (multiples of recompute's peak), 3 interleaved runs each,
                    # merged into section 8b beside offload-8b's baselines (run that first, on the same
                    # machine: the merge warns when the file's rows come from another device): part 1 (the
                    # default) 1.15x 1.3x, part 2 1.5x 1.75x, part 3 2x and no budget; the whole command's time
                    # goes to the runs (plan_frontier.py needs no GPU: run it on the merged JSON anywhere)
    case ${2:-1} in
      1) configs=(dsx_auto_budget_sel) scales=(1.15 1.3) ;;
      2) configs=(dsx_auto_budget_sel) scales=(1.5 1.75) ;;
      3) configs=(dsx_auto_budget_sel dsx_auto_hide_sel) scales=(2) ;;
      *) log "offload-8b-sweep: part 1, 2 or 3, not ${2}"; exit 2 ;;
    esac
    run bench-offload-8b-sweep 565 python benchmarks/bench_offload.py "${LLAMA_8B[@]}" --configs "${configs[@]}" \
      --budget-scales "${scales[@]}" --merge --section 8b --out "$RES"
    keep bench_offload ;;
  offload-8b-megatron)  # megatron-core's own ways at the 8B shape, merged into section 8b as the peers
                        # are: selective recompute and fine-grained offload of the attention core, of all of
                        # attention, of every set; 3 interleaved runs; then the frontier again
    run bench-offload-8b-megatron 500 python benchmarks/bench_offload.py "${LLAMA_8B[@]}" --configs megatron_selective \
      megatron_offload_core_attn megatron_offload_attn megatron_offload_all --merge --section 8b \
      --out "$RES"
    run plan-frontier-8b 60 python benchmarks/plan_frontier.py "$RES/bench_offload.json" --section 8b \
      --config dsx_auto_budget_sel --out "$RES"
    keep bench_offload plan_frontier ;;
  offload-8b-capacity)  # the longest sequence at the 8B layer (micro-batch 1) on an H100's memory (each process
                        # capped at 85 GB on a larger card), ZeRO-2 with the optimizer on the CPU: one round per part,
                        # each config's sizes ascending (it stops at its first failure); part 1 writes
                        # section 8b_capacity, the others merge into it: 1 no offload and full recompute
                        # (their static memory sets dsx's budget), 2 and 3 dsx given the whole card (split so that
                        # each fits one command: steps take longer as the sequence grows), 4 full recompute at longer
                        # lengths, 5 DeepSpeed's cpu_checkpointing, 6 megatron's offload of every module and the
                        # saved-tensor-hook offload (its pinned copies grow with the length: host memory is its limit);
                        # part 7 ROUND SIDE (ROUND 1, 2, 3; SIDE peer, then dsx): one side of a round of the best
                        # peer and dsx at the longest the peer trained, the six commands interleaved on one machine
                        # (round 1's rows replace the parts' rows at that length); part 8 LEN: dsx
                        # profiled with the layers' inputs on the host (profile_mode "recompute+host"), at LEN
                        # (default 262,144). A config that trains
                        # its longest listed length has no limit found (limit_found in the JSON): extend it
    part=${2:-1} repeat=()
    case $part in
      1) sizes=(none=40960,49152,57344 recompute=98304,131072,163840) ;;
      2) sizes=(dsx_auto_budget_sel=98304,131072) ;;
      3) sizes=(dsx_auto_budget_sel=${3:-163840}) ;;  # one length a command (LEN, default 163,840)
      4) sizes=(recompute=229376,262144) ;;
      5) sizes=(ds_cpu_ckpt=163840,196608) ;;
      6) sizes=(megatron_offload_all=49152,57344,65536 hooks_offload=32768,40960) ;;
      7) case ${3:-1} in
           1) ;;
           2|3) repeat=(--merge-repeat) ;;
           *) log "offload-8b-capacity 7: round 1, 2 or 3, then peer or dsx"; exit 2 ;;
         esac
         # one side of a round a command: at these lengths one side can take most of a command
         # (docs/performance.md), so both do not fit. The peer side runs the best peer at its longest length
         # (parts 1-6 first); the dsx side runs at the length the peer side just trained, and refuses to run
         # where that side did not train (its row would have moved the best peer's longest)
         case ${4:-} in
           peer|dsx) ;;
           *) log "offload-8b-capacity 7 ${3:-1}: peer or dsx, not '${4:-}'"; exit 2 ;;
         esac
         at=$(python -c "
import json, sys
d = json.load(open('$RES/bench_offload.json'))['sections']['8b_capacity']
if '$4' == 'peer':
    at = d['ratios']['longest_sequence']['at_best_peer']
    print(at['peer'].split('@')[0], at['seq_len'])
    sys.exit()
last = len(d['parts']) - 1
rows = [r for r in d['results'] if r.get('part') == last]
if len(rows) != 1 or rows[0]['config'].startswith('dsx'):
    sys.exit('the last part is not a round\'s peer side: run offload-8b-capacity 7 ${3:-1} peer first')
if 'error' in rows[0]:
    sys.exit(f\"the peer side ({rows[0]['config']}) did not train: {rows[0]['error'][:200]}\")
print('dsx_auto_budget_sel', rows[0]['seq_len'])") \
           || { log "offload-8b-capacity 7 ${3:-1} $4: no round to run (see above)"; exit 1; }
         read -r cfg len <<< "$at"; sizes=("$cfg=$len") ;;
      8) sizes=(dsx_auto_budget_hp_sel=${3:-262144}) ;;  # dsx profiled with the layers' inputs on the host
      *) log "offload-8b-capacity: part 1 to 8, not $part"; exit 2 ;;
    esac
    configs=("${sizes[@]%%=*}") merge=(--merge) child=300
    [ "$part" = 1 ] && merge=()
    case $part in 3|7|8) child=520 ;; esac  # one config at one length may take the command
    # dsx's budget leaves 5 GB: the CUDA context, cuBLAS and NCCL hold memory outside torch, and a plan may
    # peak a few percent over its prediction. The SSD tier stays within the lent machine's 64 GB disk. Every
    # config runs with expandable allocator segments (dsx turns them on for itself; a peer at its best setting
    # has them too: without them a long sequence can fail on fragmentation with memory to spare).
    run bench-offload-8b-capacity 560 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/bench_offload.py --model llama --hidden 4096 --layers 8 \
      --heads 32 --kv-heads 8 --ffn-hidden 14336 --micro-batch 1 --warmup 2 --steps 3 \
      --pool-gb 48 --ssd-gb 48 --offload-optimizer --gpu-memory-gb 85 --fit-budget --fit-reserve-gb 5 --child-timeout "$child" \
      --configs "${configs[@]}" --seq-lens "${sizes[@]}" "${merge[@]}" "${repeat[@]}" --section 8b_capacity \
      --out "$RES"
    keep bench_offload ;;
  offload-8b-pool)  # the capacity suite's settings at sequence 65536 with the host pool capped at 12 GB (a rank's
                    # share when the ranks of a node share its memory) and a 48 GB SSD tier: full recompute, dsx with
                    # the host tier alone and dsx with the SSD tier beside it; ROUND (1, 2, 3): one interleaved round
                    # a command, round 1 writing section 8b_pool, the others adding their runs to it
    case ${2:-1} in
      1) merge=() ;;
      2|3) merge=(--merge --merge-repeat) ;;
      *) log "offload-8b-pool: round 1, 2 or 3"; exit 2 ;;
    esac
    run bench-offload-8b-pool 560 python benchmarks/bench_offload.py --model llama --hidden 4096 --layers 8 \
      --heads 32 --kv-heads 8 --ffn-hidden 14336 --micro-batch 1 --seq-len 65536 --warmup 2 --steps 3 \
      --pool-gb 12 --ssd-gb 48 --offload-optimizer --gpu-memory-gb 85 --fit-budget --fit-reserve-gb 5 \
      --child-timeout 150 \
      --configs recompute dsx_auto_budget_host_sel dsx_auto_budget_sel "${merge[@]}" --section 8b_pool \
      --out "$RES"
    keep bench_offload ;;
  offload-8b-pool-capacity)  # the longest sequence dsx trains with the host pool capped at 12 GB, with the host tier
                             # alone (host) or the SSD tier beside it (ssd), one config and LEN a command, merged into
                             # section 8b_pool_capacity: where the pool cannot hold what recomputed layers
                             # start from, the drive does. Both profile with the layers' inputs moved off the card
                             # (profile_mode recompute+host: past full recompute's longest sequence its profiling
                             # does not fit); the first command also measures full recompute at a short length,
                             # whose static memory sets dsx's budget
    case ${2:-} in
      host) cfg=dsx_auto_budget_host_hp_sel ;;
      ssd) cfg=dsx_auto_budget_hp_sel ;;
      *) log "offload-8b-pool-capacity host|ssd LEN, not '${2:-}'"; exit 2 ;;
    esac
    sizes=("$cfg=${3:?offload-8b-pool-capacity host|ssd LEN}")
    python -c "import json, sys; sys.exit('8b_pool_capacity' not in json.load(open('$RES/bench_offload.json'))['sections'])" \
      2>/dev/null || sizes=(recompute=16384 "${sizes[@]}")
    # (expandable allocator segments for every config, as in offload-8b-capacity)
    run bench-offload-8b-pool-capacity 560 env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/bench_offload.py --model llama --hidden 4096 --layers 8 \
      --heads 32 --kv-heads 8 --ffn-hidden 14336 --micro-batch 1 --warmup 2 --steps 3 \
      --pool-gb 12 --ssd-gb 48 --offload-optimizer --gpu-memory-gb 85 --fit-budget --fit-reserve-gb 5 --child-timeout 470 \
      --configs "${sizes[@]%%=*}" --seq-lens "${sizes[@]}" --merge --section 8b_pool_capacity --out "$RES"
    keep bench_offload ;;
  offload-8b-2gpu)  # on 2+ GPUs: the 8B layer at sequence 65536, one rank a GPU through the deepspeed launcher,
                    # ZeRO-2 with the optimizer on the CPU and dsx's budget plan over host and SSD
                    # (configs/gpt_llama8b_zero2_actoffload.json): the node's first rank logs each rank's share of the
                    # host link and of the drive, measured with every rank at once, and the share they agreed
    [ "$ngpu" -ge 2 ] || { log "offload-8b-2gpu needs 2 GPUs, found $ngpu"; exit 1; }
    mkdir -p /tmp/dsx_act
    run offload-8b-2gpu 560 deepspeed --num_gpus 2 examples/gpt/train.py \
      --deepspeed_config configs/gpt_llama8b_zero2_actoffload.json --model megatron-llama --layers 8 --hidden 4096 \
      --heads 32 --kv-heads 8 --ffn-hidden 14336 --seq-len 65536 --steps 8 --eval-batches 1 --no-progress \
      --log-json "$OUT/offload_8b_2gpu.json"
    grep -h -A12 "rank(s) share\|activation offload plan" "$OUT/offload-8b-2gpu.log" \
      > "$OUT/offload_8b_2gpu_shares.log" ;;
  offload-long)  # long context: six Llama-3-8B layers at sequence 32768 (as many as fit without offload, which the
                 # bound needs): no offload, full recompute and dsx at recompute's peak, 3 interleaved runs; the bound
    run bench-offload-long 500 python benchmarks/bench_offload.py --model llama --hidden 4096 --layers 6 --heads 32 \
      --kv-heads 8 --ffn-hidden 14336 --seq-len 32768 --micro-batch 1 --warmup 2 --steps 3 --repeats 3 --pool-gb 48 \
      --adam fused --child-timeout 150 --configs none recompute dsx_auto_budget --section long --out "$RES"
    run plan-frontier-long 60 python benchmarks/plan_frontier.py "$RES/bench_offload.json" --section long \
      --config dsx_auto_budget --out "$RES"
    keep bench_offload plan_frontier ;;
  offload-ssd)  # the SSD tier at the same shape with its default integrity check and without, 3 interleaved runs each,
               # the drive measured after each
    run bench-offload-ssd 560 python benchmarks/bench_offload_ssd.py --out "$RES"
    keep bench_offload_ssd ;;
  ssd-threads)  # the drive under 4 MiB tasks on 1, 2, 4 and 8 threads (kvikio's pool, and posix O_DIRECT) against
                # the one-request probe, 2 GiB each way, 3 rounds
    run bench-ssd-threads 200 python benchmarks/bench_ssd_threads.py --out "$RES"; keep bench_ssd_threads ;;
  pinning)  # the activation pool's pinning, pin_memory=True against in place, at 4 and 32 GiB, while the GPU
            # computes: 3 interleaved rounds, each pin in a process of its own
    run bench-pinning 400 python benchmarks/bench_pinning.py --out "$RES"; keep bench_pinning ;;
  main)  # the main job with megatron-core; on 2+ GPUs also ZeRO-3 + NVMe optimizer offload (+ SSD activations)
    run main-1gpu 200 deepspeed --num_gpus 1 examples/gpt/train.py --deepspeed_config configs/gpt_megatron_bf16.json \
      --model megatron --layers 8 --hidden 1024 --heads 16 --seq-len 1024 --steps 100 --no-progress \
      --log-json "$OUT/main_job_1gpu.json"
    if [ "$ngpu" -ge 2 ]; then
      mkdir -p /tmp/dsx_act
      for c in zero3_nvme:40 zero3_nvme_actssd:20; do
        run main-2gpu-${c%:*} 200 deepspeed --num_gpus 2 examples/gpt/train.py \
          --deepspeed_config configs/gpt_megatron_${c%:*}.json --model megatron --layers 8 --hidden 1024 --heads 16 \
          --seq-len 1024 --steps ${c#*:} --no-progress --log-json "$OUT/main_job_2gpu_${c%:*}.json"
      done
    fi ;;
  wheel)  # dsx as a user installs it: a wheel, installed apart from the checkout, its op built from its own sources
    run wheel-build 180 pip wheel --no-deps --no-build-isolation -w "$OUT/wheel" .  # no network: no isolation
    rm -rf /tmp/dsx-wheel && mkdir -p /tmp/dsx-wheel
    run wheel-install 120 pip install --no-deps --no-index --target /tmp/dsx-wheel/site "$OUT"/wheel/dsx-*.whl
    # the checkout off the path, so that only the installed dsx can be imported; a fresh extension cache, so
    # that the op is compiled from the sources the wheel ships
    PYTHONPATH=/tmp/dsx-wheel/site:$(tr ':' '\n' <<< "${PYTHONPATH:-}" | grep -vxE "$PWD/?|\.?" | paste -sd:)
    export PYTHONPATH TORCH_EXTENSIONS_DIR=/tmp/dsx-wheel/ext
    cd /tmp/dsx-wheel || exit 1
    run wheel-build-ops 240 python -m dsx.cli build-ops
    run wheel-gather 120 python -c '
import warnings, torch, dsx
warnings.filterwarnings("error", message="dsx unified gather")  # a fallback to torch indexing fails here
print("dsx", dsx.__version__, "from", dsx.__file__)
assert dsx.__file__.startswith("/tmp/dsx-wheel/"), "dsx was not imported from the wheel"
from dsx.ops.unified_gather import csrc_dir
print("kernel sources:", csrc_dir()); assert str(csrc_dir()).startswith("/tmp/dsx-wheel/")
t = torch.randn(1 << 20, 128)
idx = torch.randint(0, len(t), (1 << 16,), device="cuda")
rows = dsx.unified(t)[idx]
ok = torch.equal(rows.cpu(), t[idx.cpu()])
print("gather of", tuple(rows.shape), "on", rows.device, "matches torch indexing:", ok)
assert ok'
    for f in "$OUT"/wheel-*.log; do echo "--- $f"; cat "$f"; done ;;
  *) echo "unknown suite $suite" >&2; exit 2 ;;
esac
log "done (failed=$failed)"
exit $failed
