#!/usr/bin/env bash
# The GPU machine's check, one stage per call (device time is short; each stage fits one 10-minute command):
#   bash .whl/gpu.sh bash benchmarks/gpu_run.sh STAGE
# Logs and results go to $OUT (default ./out): logs as *.log, benchmark JSON/PNG packed into results.tgz.
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" benchmarks/results
export PYTHONUNBUFFERED=1
stage=${1:?stage: one1 | one2 | one3 | two}
log() { echo "=== $(date -u +%T) $*" | tee -a "$OUT/stages.log"; }
case $stage in
  one1)  # 1 GPU: report, op build, GPU tests of the kernels, gather + kernel benchmarks, main job with megatron-core
    nvidia-smi -L | tee "$OUT/nvidia-smi.log"
    log report; python -m dsx.cli report --io /tmp --io-mb 1024 > "$OUT/report-gpu.txt" 2>&1
    log build-ops; timeout 240 python -m dsx.cli build-ops > "$OUT/build-ops.log" 2>&1
    log gpu-tests; timeout 240 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_unified.py \
      tests/test_rgnn_kernels.py tests/test_gpt_job.py > "$OUT/gpu-tests.log" 2>&1
    log bench-gather; timeout 180 python benchmarks/bench_gather.py --out benchmarks/results > "$OUT/bench-gather.log" 2>&1
    log bench-rgnn-kernels; timeout 150 python benchmarks/bench_rgnn_kernels.py --out benchmarks/results > "$OUT/bench-rgnn-kernels.log" 2>&1
    log main-job; timeout 150 deepspeed --num_gpus 1 examples/gpt/train.py --deepspeed_config configs/gpt_megatron_bf16.json \
      --model megatron --layers 8 --hidden 1024 --heads 16 --seq-len 1024 --steps 100 --no-progress \
      --log-json benchmarks/results/main_job_megatron_1gpu.json > "$OUT/main-job-1gpu.log" 2>&1
    ;;
  one2)  # 1 GPU: every gpu test, gather and GraphSAGE end-to-end benchmarks
    log build-ops; timeout 150 python -m dsx.cli build-ops > "$OUT/build-ops.log" 2>&1
    log gpu-tests; timeout 240 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/ > "$OUT/gpu-tests.log" 2>&1
    log bench-gather; timeout 120 python benchmarks/bench_gather.py --out benchmarks/results > "$OUT/bench-gather.log" 2>&1
    log bench-sage; timeout 200 python benchmarks/bench_sage.py --out benchmarks/results --pyg-workers 0,8 > "$OUT/bench-sage.log" 2>&1
    ;;
  one3)  # 1 GPU: relational GNN layers against PyG, activation offload strategies, report
    log report; python -m dsx.cli report --io /tmp --io-mb 1024 > "$OUT/report-gpu.txt" 2>&1
    log sampler-tests; timeout 60 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_sampler.py > "$OUT/gpu-tests-sampler.log" 2>&1
    log bench-sage; timeout 110 python benchmarks/bench_sage.py --out benchmarks/results --pyg-workers 8 --pyg-batches 20 --batches 60 > "$OUT/bench-sage.log" 2>&1
    log bench-rgnn; timeout 170 python benchmarks/bench_rgnn.py --datasets aifb mutag bgs fb15k-237 biokg am \
      --out benchmarks/results > "$OUT/bench-rgnn.log" 2>&1
    log bench-offload; timeout 200 python benchmarks/bench_offload.py --out benchmarks/results > "$OUT/bench-offload.log" 2>&1
    ;;
  offload)  # 1 GPU: the activation offload benchmark alone
    log bench-offload; timeout 420 python benchmarks/bench_offload.py --out benchmarks/results > "$OUT/bench-offload.log" 2>&1
    ;;
  offload3)  # 1 GPU: every strategy at hidden 2048, each in its own process; auto at 1x and 1.5x recompute's peak
    log bench-offload; timeout 580 python benchmarks/bench_offload.py --configs none recompute megatron_selective \
      save_on_cpu dsx_host dsx_host_sel dsx_auto_budget dsx_auto_budget_sel dsx_auto_hide_sel --budget-scales 1 1.5 \
      --out benchmarks/results > "$OUT/bench-offload.log" 2>&1
    ;;
  offload4)  # 1 GPU: offload GPU tests, then the strategies at hidden 4096 (micro-batch 4)
    log offload-gpu-tests; timeout 120 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-h4096; timeout 450 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 \
      --configs none recompute megatron_selective save_on_cpu dsx_host_sel dsx_auto_budget_sel dsx_auto_hide_sel \
      --name bench_offload_h4096 --out benchmarks/results > "$OUT/bench-offload-h4096.log" 2>&1
    ;;
  offload2)  # 1 GPU: dsx's own offload configs in a fresh process (no engines left over from the baselines)
    log bench-offload-dsx; timeout 300 python benchmarks/bench_offload.py --configs dsx_host dsx_ssd dsx_auto_hide \
      --pool-gb 24 --name bench_offload_dsx --out benchmarks/results > "$OUT/bench-offload-dsx.log" 2>&1
    ;;
  rgnn)  # 1 GPU (~7 min): fused-kernel bandwidth, all 8 relational-GNN presets at dims 64/128 against PyG, rgnn GPU tests
    log bench-rgnn-kernels; timeout 60 python benchmarks/bench_rgnn_kernels.py --repeats 5 --out benchmarks/results \
      > "$OUT/bench-rgnn-kernels.log" 2>&1; cp benchmarks/results/bench_rgnn_kernels.json "$OUT/"
    log bench-rgnn; timeout 215 python benchmarks/bench_rgnn.py --pyg-budget-s 165 --profile --out benchmarks/results \
      > "$OUT/bench-rgnn.log" 2>&1; cp benchmarks/results/bench_rgnn.json benchmarks/results/bench_rgnn.png "$OUT/"
    log rgnn-gpu-tests; timeout 130 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_rgnn_kernels.py \
      tests/test_rgnn_layers_gpu.py > "$OUT/gpu-tests-rgnn.log" 2>&1
    ;;
  offload5)  # 1 GPU: every strategy at hidden 2048 (fresh process each, short), then micro-batch 16 (OOM without dsx)
    log bench-offload-probe; timeout 300 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 32 \
      --configs none recompute megatron_selective save_on_cpu ds_cpu_ckpt dsx_host dsx_host_sel dsx_ssd_sel \
      dsx_auto_budget_sel dsx_auto_hide_sel --name bench_offload_probe --out benchmarks/results > "$OUT/bench-offload-probe.log" 2>&1
    log bench-offload-mb16; timeout 130 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 32 --micro-batch 16 \
      --configs none recompute dsx_auto_budget_sel --name bench_offload_probe_mb16 --out benchmarks/results \
      > "$OUT/bench-offload-probe-mb16.log" 2>&1
    ;;
  offload6)  # 1 GPU: the committed run: strategies at hidden 2048 (auto at 1x and 1.25x recompute's peak), then micro-batch 16
    log bench-offload; timeout 345 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 --child-timeout 60 \
      --configs none recompute dsx_auto_budget_sel dsx_auto_hide_sel save_on_cpu ds_cpu_ckpt dsx_host_sel megatron_selective \
      --budget-scales 1 1.25 --out benchmarks/results > "$OUT/bench-offload.log" 2>&1
    log bench-offload-mb16; timeout 100 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 --child-timeout 50 \
      --micro-batch 16 --configs none recompute dsx_auto_budget_sel --name bench_offload_mb16 --out benchmarks/results \
      > "$OUT/bench-offload-mb16.log" 2>&1
    ;;
  offload7)  # 1 GPU: the committed run at hidden 2048 (auto at recompute's peak and at 0.95x, i.e. under save_on_cpu's)
    nvidia-smi -L | tee "$OUT/nvidia-smi.log"
    log bench-offload; timeout 560 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 --child-timeout 75 \
      --configs none recompute dsx_auto_budget_sel dsx_auto_hide dsx_auto_hide_sel save_on_cpu ds_cpu_ckpt dsx_host_sel \
      dsx_ssd_sel megatron_selective --budget-scales 1 0.95 --out benchmarks/results > "$OUT/bench-offload.log" 2>&1
    ;;
  offload8)  # 1 GPU: hidden 4096 (micro-batch 4), then the offload GPU tests
    log bench-offload-h4096; timeout 430 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 \
      --warmup 2 --steps 3 --pool-gb 20 --child-timeout 75 --configs none recompute dsx_auto_budget_sel dsx_auto_hide_sel \
      save_on_cpu ds_cpu_ckpt dsx_host_sel dsx_ssd_sel --budget-scales 1 \
      --name bench_offload_h4096 --out benchmarks/results > "$OUT/bench-offload-h4096.log" 2>&1
    cp benchmarks/results/bench_offload_h4096.* "$OUT/"
    log offload-gpu-tests; timeout 140 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    ;;
  offload9)  # 1 GPU: ZeRO-2 + optimizer offload to CPU: the largest micro-batch with and without dsx
    log bench-offload-zero-cpu; timeout 570 python benchmarks/bench_offload.py --offload-optimizer --warmup 2 --steps 3 \
      --pool-gb 20 --child-timeout 150 --configs none recompute --micro-batches none=14,15,16 recompute=32,48 \
      --name bench_offload_zero_cpu --out benchmarks/results > "$OUT/bench-offload-zero-cpu.log" 2>&1
    ;;
  sage1)  # 1 GPU (H100): unified/sampler GPU tests, gather benchmark, GraphSAGE end to end + a feature table beyond GPU memory
    nvidia-smi -L | tee "$OUT/nvidia-smi.log"
    log build-ops; timeout 120 python -m dsx.cli build-ops > "$OUT/build-ops.log" 2>&1
    log gpu-tests; timeout 90 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_unified.py tests/test_sampler.py \
      > "$OUT/gpu-tests-unified-sampler.log" 2>&1
    log bench-gather; timeout 100 python benchmarks/bench_gather.py --out benchmarks/results > "$OUT/bench-gather.log" 2>&1
    tar czf "$OUT/results.tgz" benchmarks/results/bench_gather*  # what is done comes back even if time runs out
    log bench-sage; timeout 230 python benchmarks/bench_sage.py --out benchmarks/results --pyg-workers 4,8,12 \
      --pyg-batches 20 --batches 60 --feature-table-gb 90 > "$OUT/bench-sage.log" 2>&1
    free -g >> "$OUT/bench-sage.log"
    ;;
  sage2)  # 2 GPUs: multi-GPU unified tests, GraphSAGE on 1 and 2 ranks over the same graph (one shared feature copy),
          # then bench_sage on one GPU (PyG vs dsx in one run) with the time left (the stage keeps within 255 s)
    end=$((SECONDS + 255))
    nvidia-smi -L | tee "$OUT/nvidia-smi.log"
    log build-ops; timeout 90 python -m dsx.cli build-ops > "$OUT/build-ops.log" 2>&1
    log multigpu-tests; timeout 50 python -m pytest -q -rs -m multigpu -p no:cacheprovider tests/test_unified.py \
      > "$OUT/multigpu-tests-unified.log" 2>&1
    for n in 1 2; do
      log sage-${n}gpu; timeout 60 deepspeed --num_gpus $n examples/gnn/train_sage.py --deepspeed_config configs/gnn_sage.json \
        --nodes 2400000 --edges 62000000 --features 128 --classes 47 --train-fraction 0.08 --epochs 3 --no-progress \
        --log-json benchmarks/results/gnn_sage_${n}gpu.json > "$OUT/gnn-sage-${n}gpu.log" 2>&1
      ls -la /dev/shm >> "$OUT/gnn-sage-${n}gpu.log" 2>&1
      tar czf "$OUT/results.tgz" benchmarks/results/gnn_sage_*
    done
    left=$((end - SECONDS)); log "bench-sage (${left}s left)"
    [ $left -gt 30 ] && timeout $left python benchmarks/bench_sage.py --out benchmarks/results --name bench_sage_h200 \
      --models full,trim --pyg-workers 4,8,12 --pyg-batches 15 --batches 40 > "$OUT/bench-sage-h200.log" 2>&1
    tar czf "$OUT/results.tgz" benchmarks/results/gnn_sage_* benchmarks/results/bench_sage_h200*
    ;;
  sage3)  # 1 GPU (H100): GraphSAGE end to end only: PyG (workers 4/8/12, full model) and dsx (gpu/unified, full + trim) in one run
    log bench-sage; timeout 300 python benchmarks/bench_sage.py --out benchmarks/results --models full,trim \
      --pyg-workers 4,8,12 --pyg-batches 20 --batches 60 > "$OUT/bench-sage.log" 2>&1
    ;;
  two)  # 2 GPUs: ZeRO-3 + optimizer offload to NVMe, multi-GPU tests
    nvidia-smi -L | tee "$OUT/nvidia-smi.log"
    mkdir -p /tmp/nvme
    log main-job-2gpu; timeout 300 deepspeed --num_gpus 2 examples/gpt/train.py \
      --deepspeed_config configs/gpt_megatron_zero3_nvme.json --model megatron --layers 8 --hidden 1024 --heads 16 \
      --seq-len 1024 --steps 40 --no-progress --log-json benchmarks/results/main_job_megatron_zero3_nvme_2gpu.json \
      > "$OUT/main-job-2gpu.log" 2>&1
    log multigpu-tests; timeout 200 python -m pytest -q -rs -m multigpu -p no:cacheprovider tests/ > "$OUT/multigpu-tests.log" 2>&1
    ;;
  offload10)  # 1 GPU: hide-only plans with the partial layer (hidden 2048), auto at recompute's peak again (hidden 4096)
    log bench-offload-hide; timeout 230 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 --child-timeout 70 \
      --configs none dsx_auto_hide dsx_auto_hide_sel --name bench_offload_hide --out benchmarks/results > "$OUT/bench-offload-hide.log" 2>&1
    log bench-offload-h4096-budget; timeout 300 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 \
      --warmup 2 --steps 3 --pool-gb 20 --child-timeout 75 --configs none recompute dsx_auto_budget_sel dsx_auto_hide_sel \
      --name bench_offload_h4096_rerun --out benchmarks/results > "$OUT/bench-offload-h4096-rerun.log" 2>&1
    cp benchmarks/results/bench_offload_hide.* benchmarks/results/bench_offload_h4096_rerun.* "$OUT/"
    ;;
  offload11)  # 1 GPU: hide-only plans filling the bound with several partial layers (hidden 2048 and 4096)
    log bench-offload-hide; timeout 230 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 --child-timeout 70 \
      --configs none dsx_auto_hide dsx_auto_hide_sel --name bench_offload_hide --out benchmarks/results > "$OUT/bench-offload-hide.log" 2>&1
    log bench-offload-hide-h4096; timeout 200 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 \
      --warmup 2 --steps 3 --pool-gb 20 --child-timeout 75 --configs none dsx_auto_hide_sel \
      --name bench_offload_hide_h4096 --out benchmarks/results > "$OUT/bench-offload-hide-h4096.log" 2>&1
    cp benchmarks/results/bench_offload_hide* "$OUT/"
    ;;
  two2)  # 2 GPUs: ZeRO-3 + optimizer offload to NVMe + activation offload to SSD (same drive), the main job
    nvidia-smi -L | tee "$OUT/nvidia-smi.log"
    mkdir -p /tmp/dsx_act
    log main-job-2gpu-actssd; timeout 420 deepspeed --num_gpus 2 examples/gpt/train.py \
      --deepspeed_config configs/gpt_megatron_zero3_nvme_actssd.json --model megatron --layers 8 --hidden 1024 --heads 16 \
      --seq-len 1024 --steps 20 --no-progress --log-json benchmarks/results/main_job_megatron_zero3_nvme_actssd_2gpu.json \
      > "$OUT/main-job-2gpu-actssd.log" 2>&1
    ls -la /tmp/dsx_act >> "$OUT/main-job-2gpu-actssd.log" 2>&1
    cp benchmarks/results/main_job_megatron_zero3_nvme_actssd_2gpu.json "$OUT/" 2>/dev/null
    ;;
  offload12)  # 1 GPU: ZeRO-2 + optimizer offload to CPU at hidden 4096 (CPU Adam is a larger share of the step)
    log bench-offload-zero-cpu-h4096; timeout 560 python benchmarks/bench_offload.py --offload-optimizer --hidden 4096 \
      --heads 32 --warmup 2 --steps 3 --pool-gb 20 --child-timeout 150 \
      --micro-batches none=6,7 recompute=16,20 dsx_auto_budget_sel=16,20 --auto-budget-gb 66 \
      --configs none recompute dsx_auto_budget_sel --name bench_offload_zero_cpu_h4096 --out benchmarks/results \
      > "$OUT/bench-offload-zero-cpu-h4096.log" 2>&1
    cp benchmarks/results/bench_offload_zero_cpu_h4096.* "$OUT/"
    ;;
  offload13)  # 1 GPU: offload GPU tests (profile under recompute), then hidden 2048 at recompute's and save_on_cpu's
              # peak (recompute+host can go under recompute's)
    log offload-gpu-tests; timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-equal-memory; timeout 420 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 75 --configs none recompute save_on_cpu dsx_auto_budget_sel --budget-scales 1 0.95 \
      --name bench_offload_equal_memory --out benchmarks/results > "$OUT/bench-offload-equal-memory.log" 2>&1
    cp benchmarks/results/bench_offload_equal_memory.* "$OUT/"
    ;;
  offload14)  # 1 GPU: offload12 again now that plans fit the host pool (offload12's dsx plans moved 20-30 GiB
              # into a 20 GiB pool, the rest stayed on the device and ran out of memory); a larger pool
    log bench-offload-zero-cpu-h4096; timeout 560 python benchmarks/bench_offload.py --offload-optimizer --hidden 4096 \
      --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 150 \
      --micro-batches none=7,8 recompute=20 dsx_auto_budget_sel=20,24 --auto-budget-gb 62 \
      --configs none recompute dsx_auto_budget_sel --name bench_offload_zero_cpu_h4096 --out benchmarks/results \
      > "$OUT/bench-offload-zero-cpu-h4096.log" 2>&1
    cp benchmarks/results/bench_offload_zero_cpu_h4096.* "$OUT/"
    ;;
  offload15)  # 1 GPU: where auto's plans at hidden 4096 + ZeRO-2 CPU offload overshoot (offload14: mb20 ran out of
              # memory at a plan predicted 53.4 GiB of activations): a lower budget, two micro-batches
    log bench-offload-zero-cpu-h4096-auto; timeout 400 python benchmarks/bench_offload.py --offload-optimizer \
      --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 150 \
      --micro-batches dsx_auto_budget_sel=16,20 --auto-budget-gb 52 --configs dsx_auto_budget_sel \
      --name bench_offload_zero_cpu_h4096_auto --out benchmarks/results > "$OUT/bench-offload-zero-cpu-h4096-auto.log" 2>&1
    cp benchmarks/results/bench_offload_zero_cpu_h4096_auto.* "$OUT/"
    ;;
  offload16)  # 1 GPU: what is live at the peak of a plan that moves bytes (predicted 36.8 GB, measured 39.9 at
              # hidden 2048 with +sel): the allocator's history over one measured step
    log bench-offload-memory-trace; timeout 200 python benchmarks/bench_offload.py --warmup 1 --steps 1 --pool-gb 20 \
      --child-timeout 120 --configs dsx_auto_hide_sel --memory-history "$OUT/memory" \
      --name bench_offload_memory_trace --out benchmarks/results > "$OUT/bench-offload-memory-trace.log" 2>&1
    cp benchmarks/results/bench_offload_memory_trace.* "$OUT/"
    ;;
  offload17)  # 1 GPU: does the write barrier hold auto's plans to their predicted peak? The GPU offload tests with the
              # barrier, offload16's trace again (before the barrier: predicted 36.78 GB, measured 39.87), then what
              # is live at the floor: recompute, save_on_cpu and auto at recompute's peak and 0.95x it, traced
    log offload-gpu-tests; timeout 120 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-memory-trace-barrier; timeout 150 python benchmarks/bench_offload.py --warmup 1 --steps 2 \
      --pool-gb 20 --child-timeout 120 --configs dsx_auto_hide_sel --memory-history "$OUT/memory" \
      --name bench_offload_memory_trace_barrier --out benchmarks/results > "$OUT/bench-offload-memory-trace-barrier.log" 2>&1
    log bench-offload-memory-trace-floor; timeout 270 python benchmarks/bench_offload.py --warmup 1 --steps 2 \
      --pool-gb 20 --child-timeout 120 --configs recompute save_on_cpu dsx_auto_budget_sel --budget-scales 1.0 0.95 \
      --memory-history "$OUT/memory" --name bench_offload_memory_trace_floor --out benchmarks/results \
      > "$OUT/bench-offload-memory-trace-floor.log" 2>&1
    cp benchmarks/results/bench_offload_memory_trace_barrier.* benchmarks/results/bench_offload_memory_trace_floor.* "$OUT/"
    ;;
  offload18)  # 1 GPU: offload14's hidden-4096 ZeRO-2 sweep with the write barrier, where auto ran out of memory at
              # micro-batches 20 and 24 (no offload at 7 for the ratio)
    log bench-offload-zero-cpu-h4096-barrier; timeout 540 python benchmarks/bench_offload.py --offload-optimizer \
      --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 150 \
      --micro-batches none=7 dsx_auto_budget_sel=20,24 --auto-budget-gb 62 --configs none dsx_auto_budget_sel \
      --name bench_offload_zero_cpu_h4096_barrier --out benchmarks/results \
      > "$OUT/bench-offload-zero-cpu-h4096-barrier.log" 2>&1
    cp benchmarks/results/bench_offload_zero_cpu_h4096_barrier.* "$OUT/"
    ;;
  offload19)  # 1 GPU: the barrier's cost untraced (offload17's traced hide-only step took 457 ms against 255 before
              # the barrier; recording every allocation's stack slows the host, which the barrier then waits out),
              # and the floor's traces again, packed (offload17's were lost: $OUT keeps only a few files)
    log bench-offload-hide-barrier; timeout 260 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --configs none dsx_auto_hide_sel dsx_auto_hide --name bench_offload_hide_barrier \
      --out benchmarks/results > "$OUT/bench-offload-hide-barrier.log" 2>&1
    log bench-offload-memory-trace-floor; timeout 200 python benchmarks/bench_offload.py --warmup 1 --steps 1 \
      --pool-gb 20 --child-timeout 90 --configs recompute save_on_cpu --memory-history "$OUT/memory" \
      --name bench_offload_memory_trace_floor2 --out benchmarks/results > "$OUT/bench-offload-memory-trace-floor2.log" 2>&1
    tar czf "$OUT/memory.tgz" -C "$OUT" memory && rm -rf "$OUT/memory"
    cp benchmarks/results/bench_offload_hide_barrier.* "$OUT/"
    ;;
  offload20)  # 1 GPU: hide-only plans with the write barrier off ("auto" now sets it only under a budget; offload19:
              # 271 ms with it against 259 without), and at hidden 4096 + ZeRO-2 CPU offload, micro-batch 20, auto
              # (barrier on) beside full recompute in one run, with what each step waited for (stall_by)
    log bench-offload-hide2; timeout 200 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --configs none dsx_auto_hide_sel dsx_auto_hide --name bench_offload_hide2 \
      --out benchmarks/results > "$OUT/bench-offload-hide2.log" 2>&1
    log bench-offload-zero-cpu-h4096-mb20; timeout 330 python benchmarks/bench_offload.py --offload-optimizer \
      --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 150 \
      --micro-batches recompute=20 dsx_auto_budget_sel=20 --auto-budget-gb 62 --configs recompute dsx_auto_budget_sel \
      --name bench_offload_zero_cpu_h4096_mb20 --out benchmarks/results > "$OUT/bench-offload-zero-cpu-h4096-mb20.log" 2>&1
    cp benchmarks/results/bench_offload_hide2.* benchmarks/results/bench_offload_zero_cpu_h4096_mb20.* "$OUT/"
    ;;
  offload21)  # 1 GPU: where auto's step goes at hidden 4096 + ZeRO-2 CPU offload, micro-batch 20 (offload20: 2772 ms
              # against full recompute's 2721, predicted 235 ms faster; 0.37 s of host waits at the write barrier
              # and 0.14 s at unpack per step): the scheduler's timeline of the measured steps
    log bench-offload-zero-cpu-h4096-trace; timeout 250 python benchmarks/bench_offload.py --offload-optimizer \
      --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 200 \
      --micro-batches dsx_auto_budget_sel=20 --auto-budget-gb 62 --configs dsx_auto_budget_sel --trace "$OUT" \
      --name bench_offload_zero_cpu_h4096_trace --out benchmarks/results > "$OUT/bench-offload-zero-cpu-h4096-trace.log" 2>&1
    cp benchmarks/results/bench_offload_zero_cpu_h4096_trace.json "$OUT/"
    ;;
  offload22)  # 1 GPU: with the inputs every layer is given (the attention mask) kept on the device (offload21's trace:
              # moved with layer 0, the mask made later layers' backward wait ~130 ms a step behind the bulk reads):
              # hidden 4096 + ZeRO-2 CPU offload at micro-batch 20, auto beside recompute, traced; and hidden 2048 at
              # recompute's peak against save_on_cpu
    log bench-offload-zero-cpu-h4096-mask; timeout 300 python benchmarks/bench_offload.py --offload-optimizer \
      --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 150 \
      --micro-batches recompute=20 dsx_auto_budget_sel=20 --auto-budget-gb 62 --configs recompute dsx_auto_budget_sel \
      --trace "$OUT" --name bench_offload_zero_cpu_h4096_mask --out benchmarks/results \
      > "$OUT/bench-offload-zero-cpu-h4096-mask.log" 2>&1
    log bench-offload-equal-memory; timeout 200 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --configs recompute save_on_cpu dsx_auto_budget_sel --name bench_offload_equal_memory2 \
      --out benchmarks/results > "$OUT/bench-offload-equal-memory2.log" 2>&1
    cp benchmarks/results/bench_offload_zero_cpu_h4096_mask.* benchmarks/results/bench_offload_equal_memory2.* "$OUT/"
    ;;
  offload23)  # 1 GPU: offload22's hidden-4096 pair again with expandable segments (auto ran out of memory there with
              # 20.6 GiB reserved but unallocated: 10 GiB softmax blocks fragment the caching allocator)
    log bench-offload-zero-cpu-h4096-expandable; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 300 \
      python benchmarks/bench_offload.py --offload-optimizer --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 \
      --child-timeout 150 --micro-batches recompute=20 dsx_auto_budget_sel=20 --auto-budget-gb 62 \
      --configs recompute dsx_auto_budget_sel --trace "$OUT" --name bench_offload_zero_cpu_h4096_expandable \
      --out benchmarks/results > "$OUT/bench-offload-zero-cpu-h4096-expandable.log" 2>&1
    cp benchmarks/results/bench_offload_zero_cpu_h4096_expandable.* "$OUT/"
    ;;
  offload24)  # 1 GPU: hide-only plans at hidden 2048 with the mask kept on the device (offload20's hide_sel waited
              # 63-69 ms a step at unpack)
    log bench-offload-hide3; timeout 200 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --configs none dsx_auto_hide_sel dsx_auto_hide --name bench_offload_hide3 \
      --out benchmarks/results > "$OUT/bench-offload-hide3.log" 2>&1
    cp benchmarks/results/bench_offload_hide3.* "$OUT/"
    ;;
  offload25)  # 1 GPU: read buffers from the compute stream's allocator pool (before: the prefetch stream's own pool,
              # which the blocks freed by forward's moves cannot serve), with the allocator's retries and the compute
              # stream's own waits for reads timed: GPU offload tests, then hidden 2048 at recompute's peak, both pools
    log offload-gpu-tests; timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-pool; timeout 260 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --configs recompute save_on_cpu dsx_auto_budget_sel --name bench_offload_pool \
      --out benchmarks/results > "$OUT/bench-offload-pool.log" 2>&1
    budget=$(python -c "import json; d = json.load(open('benchmarks/results/bench_offload_pool.json')); \
print(next(r['activation_peak_gb'] for r in d['results'] if r['config'] == 'recompute'))")
    log bench-offload-pool-prefetch budget "$budget"; timeout 120 python benchmarks/bench_offload.py --warmup 2 \
      --steps 3 --pool-gb 20 --child-timeout 80 --configs dsx_auto_budget_sel --auto-budget-gb "$budget" \
      --read-pool prefetch --name bench_offload_pool_prefetch --out benchmarks/results \
      > "$OUT/bench-offload-pool-prefetch.log" 2>&1
    ;;
  offload26)  # 1 GPU: hidden 4096 + ZeRO-2 CPU offload, micro-batch 20: auto (compute-stream pool) beside full
              # recompute, with and without expandable segments (before: 0.94x recompute with them, out of memory
              # without them, 20.6 GiB reserved but unallocated)
    for alloc in default expandable; do
      unset PYTORCH_CUDA_ALLOC_CONF; [ "$alloc" = expandable ] && export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
      configs="dsx_auto_budget_sel"; [ "$alloc" = default ] && configs="recompute dsx_auto_budget_sel"
      log bench-offload-pool-h4096-$alloc; timeout 330 python benchmarks/bench_offload.py \
        --offload-optimizer --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 150 \
        --micro-batches recompute=20 dsx_auto_budget_sel=20 --auto-budget-gb 62 --configs $configs \
        --name bench_offload_pool_h4096_$alloc --out benchmarks/results > "$OUT/bench-offload-pool-h4096-$alloc.log" 2>&1
    done
    ;;
  offload27)  # 1 GPU: what the memory buys with auto (offload26: auto at micro-batch 20 ran 1.05x full recompute
              # without expandable segments, where it had run out of memory with the prefetch stream's pool): the
              # largest micro-batch without dsx (7) beside recompute and auto at 20, one run; the GPU's idle time
              # at the write barrier timed
    log bench-offload-zero-cpu-h4096-pool; timeout 560 python benchmarks/bench_offload.py --offload-optimizer \
      --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 170 \
      --micro-batches none=7 recompute=20 dsx_auto_budget_sel=20 --auto-budget-gb 62 \
      --configs none recompute dsx_auto_budget_sel --name ${NAME:-bench_offload_zero_cpu_h4096_pool} --out benchmarks/results \
      > "$OUT/bench-offload-zero-cpu-h4096-pool.log" 2>&1
    ;;
  offload28)  # 1 GPU: hidden 4096, micro-batch 4, auto at full recompute's peak with the write barrier and the
              # compute-stream pool (before the barrier: 1.09x recompute but 2.2 GB over its budget, then a fall-back
              # to recompute), beside no offload, recompute, save_on_cpu and the hide-only plan, one run
    log bench-offload-h4096-s14; timeout 480 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 \
      --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 \
      --configs none recompute save_on_cpu dsx_auto_budget_sel dsx_auto_hide_sel \
      --name bench_offload_h4096_s14 --out benchmarks/results > "$OUT/bench-offload-h4096-s14.log" 2>&1
    ;;
  offload29)  # 1 GPU: reads issued at the backward start of the layer prefetch_depth above, kept layers included
              # (offload28: the hide-only plan host x3, keep x5 ran 0.72x no offload once the reads' copies waited
              # for the compute stream: they started only at each moved layer's first unpack); GPU offload tests
              # and hidden 4096 micro-batch 4 again
    log offload-gpu-tests; timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-h4096-s14b; timeout 400 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 \
      --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 --configs none recompute dsx_auto_budget_sel dsx_auto_hide_sel \
      --name bench_offload_h4096_s14b --out benchmarks/results > "$OUT/bench-offload-h4096-s14b.log" 2>&1
    ;;
  offload30)  # 1 GPU: read buffers allocated and ordered on the issuing thread (offload29: recorded from an I/O
              # thread, the ordering event waited for room in the compute stream's queue while the host ran ahead,
              # and the hide-only plan still ran 0.76x); GPU offload tests and hidden 4096 micro-batch 4 again
    log offload-gpu-tests; timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-h4096-s14c; timeout 400 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 \
      --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 --configs none recompute dsx_auto_budget_sel dsx_auto_hide_sel \
      --name bench_offload_h4096_s14c --out benchmarks/results > "$OUT/bench-offload-h4096-s14c.log" 2>&1
    ;;
  offload31)  # 1 GPU: the hide-only plan at hidden 4096 with read buffers from either pool, one run (offload30:
              # 0.89x no offload with the compute stream's, 0.99x before the session with the prefetch stream's);
              # then what the memory buys at hidden 4096 + ZeRO-2 CPU with this session's code
    log bench-offload-hide-h4096-pools; timeout 200 python benchmarks/bench_offload.py --hidden 4096 --heads 32 \
      --micro-batch 4 --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 --configs none dsx_auto_hide_sel \
      --name bench_offload_hide_h4096_compute --out benchmarks/results > "$OUT/bench-offload-hide-h4096-compute.log" 2>&1
    timeout 100 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 --warmup 2 --steps 3 \
      --pool-gb 20 --child-timeout 90 --configs dsx_auto_hide_sel --read-pool prefetch \
      --name bench_offload_hide_h4096_prefetch --out benchmarks/results > "$OUT/bench-offload-hide-h4096-prefetch.log" 2>&1
    NAME=bench_offload_zero_cpu_h4096_s14 bash "$0" offload27
    ;;
  offload32)  # 1 GPU: the closing run, part 1, on the final code of stop 14: the offload GPU tests (not re-run after
              # the read_pool key was wired), then every strategy of issue 3 at hidden 2048, micro-batch 8
    nvidia-smi -L | tee "$OUT/nvidia-smi.log"
    log offload-gpu-tests; timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-final-h2048; timeout 430 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --configs none recompute save_on_cpu ds_cpu_ckpt megatron_selective dsx_host_sel \
      dsx_auto_budget_sel dsx_auto_hide_sel --name bench_offload_final_h2048 --out benchmarks/results \
      > "$OUT/bench-offload-final-h2048.log" 2>&1
    ;;
  offload33)  # 1 GPU: the closing run, part 2: every strategy at hidden 4096, micro-batch 4, the SSD tier included
    log bench-offload-final-h4096; timeout 570 python benchmarks/bench_offload.py --hidden 4096 --heads 32 \
      --micro-batch 4 --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 --configs none recompute save_on_cpu \
      ds_cpu_ckpt megatron_selective dsx_host_sel dsx_ssd_sel dsx_auto_budget_sel dsx_auto_hide_sel \
      --name bench_offload_final_h4096 --out benchmarks/results > "$OUT/bench-offload-final-h4096.log" 2>&1
    ;;
  offload34)  # 1 GPU: the closing run, part 3: the SSD tier at hidden 2048 (it ran past 75 s before: ~8 GiB a step
              # each way over the virtio disk), then micro-batch 16, which runs out of memory without dsx
    log bench-offload-final-h2048-ssd; timeout 300 python benchmarks/bench_offload.py --warmup 1 --steps 2 \
      --pool-gb 20 --child-timeout 280 --configs dsx_ssd_sel --name bench_offload_final_h2048_ssd \
      --out benchmarks/results > "$OUT/bench-offload-final-h2048-ssd.log" 2>&1
    log bench-offload-final-mb16; timeout 200 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --micro-batch 16 --configs none recompute dsx_auto_budget_sel \
      --name bench_offload_final_mb16 --out benchmarks/results > "$OUT/bench-offload-final-mb16.log" 2>&1
    ;;
  offload35)  # 1 GPU: expandable segments under a budget (offload27 on the final code: auto at micro-batch 20 ran
              # out of memory with 25.9 GiB reserved but unallocated, where three runs of the same plan had fit):
              # GPU offload tests, what the memory buys again, then hidden 4096 mb 4 and hidden 2048 mb 8 at
              # full recompute's peak
    log offload-gpu-tests; timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    NAME=bench_offload_zero_cpu_h4096_expandable_auto bash "$0" offload27
    log bench-offload-final-h4096-budget; timeout 200 python benchmarks/bench_offload.py --hidden 4096 --heads 32 \
      --micro-batch 4 --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 --configs recompute dsx_auto_budget_sel \
      --name bench_offload_final_h4096_budget --out benchmarks/results > "$OUT/bench-offload-final-h4096-budget.log" 2>&1
    ;;
  offload36)  # 1 GPU: offload35 again with the setting read back on torch 2.11 (no _accelerator_getAllocatorSettings:
              # the allocator's snapshot): GPU offload tests, then auto at hidden 4096 + ZeRO-2 CPU, micro-batch 20
    python -c "import torch; print('getter', hasattr(torch._C, '_accelerator_getAllocatorSettings'), 'setter', \
hasattr(torch._C, '_accelerator_setAllocatorSettings')); torch.zeros(1, device='cuda'); \
print(torch.cuda.memory._snapshot().get('allocator_settings'))" > "$OUT/allocator-api.log" 2>&1
    log offload-gpu-tests; timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-zero-cpu-h4096-expandable-auto; timeout 250 python benchmarks/bench_offload.py --offload-optimizer \
      --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 170 \
      --micro-batches dsx_auto_budget_sel=20 --auto-budget-gb 62 --configs dsx_auto_budget_sel \
      --name bench_offload_zero_cpu_h4096_expandable_auto2 --out benchmarks/results \
      > "$OUT/bench-offload-zero-cpu-h4096-expandable-auto2.log" 2>&1
    ;;
  offload37)  # 1 GPU: what expandable segments cost at full recompute's peak (offload35: hidden 4096 mb 4, 435.1 ms
              # with them against 426.8 without in offload33): auto with them (the default under a budget) and
              # without (PYTORCH_CUDA_ALLOC_CONF set: auto leaves it), one run; hidden 2048 mb 8 with them
    log bench-offload-h4096-budget-expandable; timeout 150 python benchmarks/bench_offload.py --hidden 4096 --heads 32 \
      --micro-batch 4 --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 --configs recompute dsx_auto_budget_sel \
      --name bench_offload_h4096_budget_expandable --out benchmarks/results > "$OUT/bench-offload-h4096-budget-expandable.log" 2>&1
    budget=$(python -c "import json; d = json.load(open('benchmarks/results/bench_offload_h4096_budget_expandable.json')); \
print(next(r['activation_peak_gb'] for r in d['results'] if r['config'] == 'recompute'))")
    log bench-offload-h4096-budget-fixed budget "$budget"; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False timeout 100 \
      python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 90 --configs dsx_auto_budget_sel --auto-budget-gb "$budget" --name bench_offload_h4096_budget_fixed \
      --out benchmarks/results > "$OUT/bench-offload-h4096-budget-fixed.log" 2>&1
    log bench-offload-h2048-budget-expandable; timeout 150 python benchmarks/bench_offload.py --warmup 2 --steps 3 \
      --pool-gb 20 --child-timeout 80 --configs recompute dsx_auto_budget_sel --name bench_offload_h2048_budget_expandable \
      --out benchmarks/results > "$OUT/bench-offload-h2048-budget-expandable.log" 2>&1
    ;;
  offload38)  # 1 GPU: after the memory base moved to the model's forward start (profiler and calibration): the budget
              # GPU tests again, then auto at full recompute's peak at both shapes beside recompute
    log offload-gpu-tests-budget; timeout 100 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      -k "budget or calibration" > "$OUT/gpu-tests-offload-budget.log" 2>&1
    for h in 2048 4096; do
      heads=$((h / 128)); mb=$((h == 2048 ? 8 : 4))
      log bench-offload-budget-base-h$h; timeout 150 python benchmarks/bench_offload.py --hidden $h --heads $heads \
        --micro-batch $mb --warmup 2 --steps 3 --pool-gb 20 --child-timeout 80 --configs recompute dsx_auto_budget_sel \
        --name bench_offload_budget_base_h$h --out benchmarks/results > "$OUT/bench-offload-budget-base-h$h.log" 2>&1
    done
    ;;
  offload39)  # 1 GPU: the printed prediction now adds the profiled step's time outside the layers: the offload GPU
              # tests, then hidden 2048 (auto at recompute's peak and with no budget, each beside its measured step),
              # with no offload at micro-batches 2, 4 and 8 (what a smaller micro-batch gives at recompute's memory)
    log offload-gpu-tests; timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-predict-h2048; timeout 400 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --micro-batches none=2,4,8 --configs none recompute dsx_auto_budget_sel dsx_auto_hide_sel \
      --name bench_offload_predict_h2048 --out benchmarks/results > "$OUT/bench-offload-predict-h2048.log" 2>&1
    ;;
  offload40)  # 1 GPU: the prediction where it missed most (1838-1864 ms predicted, 2451-2472 measured): hidden 4096 +
              # ZeRO-2 CPU offload, auto at micro-batch 20
    log bench-offload-predict-zero-cpu-h4096; timeout 300 python benchmarks/bench_offload.py --offload-optimizer \
      --hidden 4096 --heads 32 --warmup 2 --steps 3 --pool-gb 40 --child-timeout 200 \
      --micro-batches dsx_auto_budget_sel=20 --auto-budget-gb 62 --configs dsx_auto_budget_sel \
      --name bench_offload_predict_zero_cpu_h4096 --out benchmarks/results \
      > "$OUT/bench-offload-predict-zero-cpu-h4096.log" 2>&1
    ;;
  offload41)  # 1 GPU: offload39's hide-only plan (host x6 partial, depth 1) ran 0.763x no offload with no waits on the host
              # or the GPU: the same configs again, each with one more step under torch.profiler (where the step's time
              # goes: compute stream busy or idle, copies, host blocked in CUDA calls), twice
    for run in a b; do
      log bench-offload-hide-ktrace-$run; timeout 280 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
        --child-timeout 80 --configs none dsx_auto_hide_sel dsx_auto_hide --kernel-trace "$OUT/ktrace_$run" \
        --name bench_offload_hide_ktrace_$run --out benchmarks/results > "$OUT/bench-offload-hide-ktrace-$run.log" 2>&1
    done
    ;;
  offload42)  # 1 GPU: offload41 found every kernel of the hide-only steps slower (GEMMs 1.3x, with or without a copy in
              # flight), not waits: GPU clocks? no offload and the hide-only plan alternated, three times each, with the
              # SM clock, power, temperature and throttle reasons sampled every 100 ms beside them
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
      --format=csv,noheader -lms 100 > "$OUT/gpu-clocks.csv" 2>&1 & smi=$!
    nvidia-smi --query-gpu=timestamp,clocks_throttle_reasons.active --format=csv,noheader -lms 100 \
      > "$OUT/gpu-throttle.csv" 2>&1 & smi2=$!
    for i in 1 2 3; do
      for c in none dsx_auto_hide_sel; do
        log clocks-$c-$i; timeout 100 python benchmarks/bench_offload.py --warmup 2 --steps 5 --pool-gb 20 \
          --child-timeout 80 --configs $c --name bench_offload_clocks_${c}_$i --out benchmarks/results \
          > "$OUT/clocks-$c-$i.log" 2>&1
      done
    done
    kill $smi $smi2 || true
    ;;
  offload43)  # 1 GPU: offload41 again (its hide-only steps had every kernel slower; offload42, on another machine, saw
              # max clocks and 0.977-0.989x) with the clocks sampled beside it and the power limits logged
    nvidia-smi -q -d POWER,CLOCK > "$OUT/gpu-power.log" 2>&1
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
      --format=csv,noheader -lms 100 > "$OUT/gpu-clocks.csv" 2>&1 & smi=$!
    for run in a b; do
      log bench-offload-hide-ktrace-clocks-$run; timeout 280 python benchmarks/bench_offload.py --warmup 2 --steps 3 \
        --pool-gb 20 --child-timeout 80 --configs none dsx_auto_hide_sel dsx_auto_hide --kernel-trace /tmp/ktrace_$run \
        --name bench_offload_hide_ktrace_clocks_$run --out benchmarks/results > "$OUT/bench-offload-hide-ktrace-clocks-$run.log" 2>&1
    done
    kill $smi || true
    ;;
  offload44)  # 1 GPU: partial layers planned at what their storages move (measured 0.79-0.85 of the bound before, the
              # caps falling between storage sizes): the offload GPU tests, then no offload and the hide-only plans
    log offload-gpu-tests; timeout 150 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-hide-movable; timeout 280 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --configs none dsx_auto_hide_sel dsx_auto_hide --name bench_offload_hide_movable \
      --out benchmarks/results > "$OUT/bench-offload-hide-movable.log" 2>&1
    ;;
  offload45)  # 1 GPU: offload44's hide-only comparison again after partial moves under a MiB were dropped (offload44's
              # plans listed layers moving a few KiB as "0Mi of 4096Mi")
    log bench-offload-hide-movable2; timeout 280 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --configs none dsx_auto_hide_sel dsx_auto_hide --name bench_offload_hide_movable2 \
      --out benchmarks/results > "$OUT/bench-offload-hide-movable2.log" 2>&1
    ;;
  offload46)  # 1 GPU: after the review fixes of stop 17 (kept layers beside moved ones record what they save; dedup by
              # version; handles released by the GC; agreed profiles; the planner's fill, bound and floor): the offload
              # GPU tests, then no offload against the hide-only plans
    log offload-gpu-tests; timeout 170 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-hide-s17; timeout 330 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 100 --configs none dsx_auto_hide_sel dsx_auto_hide --name bench_offload_hide_s17 \
      --out benchmarks/results > "$OUT/bench-offload-hide-s17.log" 2>&1
    ;;
  offload47)  # 1 GPU: the same code at full recompute's peak: recompute against auto with the budget, and save_on_cpu
    log bench-offload-budget-s17; timeout 420 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 120 --configs recompute save_on_cpu dsx_auto_budget dsx_auto_budget_sel \
      --name bench_offload_budget_s17 --out benchmarks/results > "$OUT/bench-offload-budget-s17.log" 2>&1
    ;;
  offload48)  # 1 GPU: offload46's hide-only runs again, alternating (its +sel plan ran 0.931x): no offload and auto,
              # then no offload and auto +sel, twice each (logs bench-offload-hide-h100-s17b/c, -hide-sel-h100-s17-1/2)
    for i in 1 2; do
      log bench-offload-hide-s17-$i; timeout 250 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
        --child-timeout 100 --configs none dsx_auto_hide --name bench_offload_hide_s17_$i --out benchmarks/results \
        > "$OUT/bench-offload-hide-s17-$i.log" 2>&1
    done
    for i in 1 2; do
      log bench-offload-hide-sel-s17-$i; timeout 250 python benchmarks/bench_offload.py --warmup 2 --steps 3 \
        --pool-gb 20 --child-timeout 100 --configs none dsx_auto_hide_sel --name bench_offload_hide_sel_s17_$i \
        --out benchmarks/results > "$OUT/bench-offload-hide-sel-s17-$i.log" 2>&1
    done
    ;;
  offload49)  # 1 GPU: the final code of stop 17 (handle releases queued and run at safe points, the backward's end
              # included): the offload GPU tests, the hide-only plans and the budget comparison in one command
    log offload-gpu-tests; timeout 170 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-hide-s17final; timeout 200 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 100 --configs none dsx_auto_hide dsx_auto_hide_sel --name bench_offload_hide_s17final \
      --out benchmarks/results > "$OUT/bench-offload-hide-s17final.log" 2>&1
    log bench-offload-budget-s17final; timeout 200 python benchmarks/bench_offload.py --warmup 2 --steps 3 \
      --pool-gb 20 --child-timeout 100 --configs recompute save_on_cpu dsx_auto_budget \
      --name bench_offload_budget_s17final --out benchmarks/results > "$OUT/bench-offload-budget-s17final.log" 2>&1
    ;;
  offload50)  # 1 GPU: offload49's hide-only plan ran 0.655x: no offload and that config twice more on the same machine,
              # each with one step under torch.profiler (bench_offload_hide_ktrace_s17.json)
    log bench-offload-hide-ktrace-s17; timeout 400 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 120 --configs none dsx_auto_hide dsx_auto_hide --kernel-trace /tmp/kt \
      --name bench_offload_hide_ktrace_s17 --out benchmarks/results > "$OUT/bench-offload-hide-ktrace-s17.log" 2>&1
    ;;
  offload51)  # 1 GPU: the hide-only plan ran 0.655-1.02x no offload across runs (stop 17) with no GPU waits for reads;
              # no offload and auto with no budget alternated four times, 8 measured steps each, every run with its
              # per-step times, Python's collections, a host-CPU speed probe and one profiled step, beside the
              # SM clock, power, temperature and throttle reasons sampled every 100 ms
    nvidia-smi -q -d POWER,CLOCK,PERFORMANCE > "$OUT/gpu-power.log" 2>&1; lscpu > "$OUT/lscpu.log" 2>&1
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_throttle_reasons.active \
      --format=csv,noheader -lms 100 > "$OUT/gpu-clocks.csv" 2>&1 & smi=$!
    for i in 1 2 3 4; do
      log bench-offload-hide-s18-$i; timeout 130 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
        --child-timeout 60 --configs none dsx_auto_hide --kernel-trace /tmp/kt$i --name bench_offload_hide_s18_$i \
        --out benchmarks/results > "$OUT/bench-offload-hide-s18-$i.log" 2>&1
    done
    kill $smi || true
    ;;
  offload52)  # 1 GPU: host-tier reads without verify queued on the fetching thread, ordered after their writes by an
              # event (offload51: hide-only 0.970-0.983x, the GPU idle 20-40 ms more a step while the host waited at
              # unpack for reads queued behind the writes' completions): the offload GPU tests, then no offload and
              # hide-only alternated three times (logs bench-offload-hide-s18b-*)
    log offload-gpu-tests; timeout 200 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    for i in 1 2 3; do
      log bench-offload-hide-s18b-$i; timeout 130 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
        --child-timeout 60 --configs none dsx_auto_hide --kernel-trace /tmp/kt$i --name bench_offload_hide_s18b_$i \
        --out benchmarks/results > "$OUT/bench-offload-hide-s18b-$i.log" 2>&1
    done
    ;;
  offload53)  # 1 GPU: the same code at full recompute's peak: recompute, save_on_cpu and auto with the budget
    log bench-offload-budget-s18; timeout 300 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 120 --configs recompute save_on_cpu dsx_auto_budget --name bench_offload_budget_s18 \
      --out benchmarks/results > "$OUT/bench-offload-budget-s18.log" 2>&1
    ;;
  offload54)  # 1 GPU: the offload GPU tests (host reads queued inline). Run once with the write events made blocking
              # (cudaEventBlockingSync): the new test failed, the forward's host time had grown to the sleep queued on
              # the offload stream (docs/logs/s18-blocking-events-diag.log): blocking events were dropped
    log offload-gpu-tests; timeout 240 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_offload_gpu.py \
      > "$OUT/gpu-tests-offload.log" 2>&1
    ;;
  offload55)  # 1 GPU: A/B on one machine of the hide-only plan, three rounds of: no offload; dsx trees in .ab/<v>/dsx
              # (git-ignored, carried: earlier commits' dsx packages) and this checkout's, each in its own process
    for i in 1 2 3; do
      [ $SECONDS -gt 400 ] && break  # a round takes ~170 s: stop before the command's 600 s
      log ab-none-$i; timeout 90 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
        --child-timeout 80 --configs none --name bench_offload_ab_s18_none_$i --out benchmarks/results \
        > "$OUT/ab-none-$i.log" 2>&1
      for v in $(ls .ab 2>/dev/null) tree; do
        pp=$PYTHONPATH; [ "$v" = tree ] || pp=$PWD/.ab/$v:$PYTHONPATH
        log ab-$v-$i; PYTHONPATH=$pp timeout 100 python benchmarks/bench_offload.py --warmup 2 --steps 8 \
          --pool-gb 20 --child-timeout 90 --configs dsx_auto_hide --name bench_offload_ab_s18_${v}_$i \
          --out benchmarks/results > "$OUT/ab-$v-$i.log" 2>&1
      done
    done
    ;;
  offload56)  # 1 GPU: where the hide-only step's extra compute-stream idle comes from: no offload and hide-only, twice,
              # each with one profiled step whose gaps are split into host-late (by thread and top-level op) and
              # queued-early (kernel_trace.gap_causes)
    for i in 1 2; do
      log bench-offload-gaps-s18-$i; timeout 200 python benchmarks/bench_offload.py --warmup 2 --steps 5 --pool-gb 20 \
        --child-timeout 90 --configs none dsx_auto_hide --kernel-trace /tmp/kt$i --name bench_offload_gaps_s18_$i \
        --out benchmarks/results > "$OUT/bench-offload-gaps-s18-$i.log" 2>&1
    done
    ;;
  offload57)  # 1 GPU: the final code of stop 18 (layer pre-hooks walk their own parameters): no offload, hide-only,
              # full recompute and auto at its peak, in one invocation
    log bench-offload-final-s18; timeout 400 python benchmarks/bench_offload.py --warmup 2 --steps 5 --pool-gb 20 \
      --child-timeout 100 --configs none dsx_auto_hide recompute dsx_auto_budget --name bench_offload_final_s18 \
      --out benchmarks/results > "$OUT/bench-offload-final-s18.log" 2>&1
    ;;
  offload58)  # 1 GPU: how the I/O threads' host waits for copies (scheduler.event_wait) affect the thread queueing the
              # GPU's work (benchmarks/diag_event_wait.py), then the events and offload GPU tests. Ran in stop 19 with
              # a third mode, signal (cuLaunchHostFunc posting a semaphore), since removed: dsx/runtime/events.py
    lscpu > "$OUT/lscpu.log" 2>&1
    log diag-event-wait; timeout 120 python benchmarks/diag_event_wait.py --out benchmarks/results > "$OUT/diag-event-wait.log" 2>&1
    log gpu-tests; timeout 300 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    ;;
  offload59|offload60)  # 1 GPU: A/B of scheduler.event_wait on the hide-only plan: no offload, then auto with no
              # budget under each mode, each in its own process, rounds interleaved (logs packed in logs.tgz). offload59
              # ran spin, signal (since removed) and poll; offload60 runs the diagnostic first, then spin and poll
    mkdir -p "$OUT/l"
    waits="spin poll"; [ $stage = offload59 ] && waits="spin signal poll"
    [ $stage = offload60 ] && { log diag-event-wait; timeout 60 python benchmarks/diag_event_wait.py \
      --out benchmarks/results > "$OUT/diag-event-wait.log" 2>&1; }
    for i in 1 2 3 4; do
      [ $SECONDS -gt 420 ] && break  # a round of 3 takes ~150 s, of 4 ~190 s: stop before the command's 600 s
      log ab-none-$i; timeout 90 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
        --child-timeout 80 --configs none --name bench_offload_wait_${stage}_none_$i --out benchmarks/results \
        > "$OUT/l/ab-none-$i.log" 2>&1
      for w in $waits; do
        log ab-$w-$i; timeout 100 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
          --child-timeout 90 --configs dsx_auto_hide --event-wait $w --name bench_offload_wait_${stage}_${w}_$i \
          --out benchmarks/results > "$OUT/l/ab-$w-$i.log" 2>&1
      done
    done
    tar czf "$OUT/logs.tgz" -C "$OUT/l" . && rm -rf "$OUT/l"
    ;;
  offload61)  # 1 GPU: the diagnostic with chained waits (one I/O thread spinning at a time), the events and offload
              # GPU tests
    log diag-event-wait; timeout 90 python benchmarks/diag_event_wait.py --out benchmarks/results > "$OUT/diag-event-wait.log" 2>&1
    log gpu-tests; timeout 300 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    ;;
  offload63)  # 1 GPU: the final code of stop 19: the events and offload GPU tests, then no offload and hide-only with
              # one profiled step each (gap_causes now counts driver-API launches: cuBLASLt's, Triton's)
    log gpu-tests; timeout 300 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-gaps-s19; timeout 240 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
      --child-timeout 110 --configs none dsx_auto_hide --kernel-trace /tmp/kt --name bench_offload_gaps_s19 \
      --out benchmarks/results > "$OUT/bench-offload-gaps-s19.log" 2>&1
    ;;
  offload62|offload64|offload66|offload69|offload70)  # 1 GPU: A/B of the hide-only plan: no offload, the dsx trees in
              # .ab/<v>/dsx (git-ignored, carried: here stop 18's final code, four I/O threads spinning at once and a
              # wait per read) and this checkout's, each in its own process, rounds interleaved (logs in logs.tgz).
              # offload62: this checkout with chained waits (one thread spinning at a time; since removed);
              # offload64: one device-side wait covering every earlier read of the prefetch stream, with the events
              # and offload GPU tests first and a profiled hide-only step last (gap_causes); offload66: the final code
              # of stop 19; offload69: host writes without I/O threads against stop 19's final code as .ab/head,
              # tests first and a profiled step last as in offload64; offload70: stop 20's final code alone (.ab
              # empty), two rounds
    mkdir -p "$OUT/l"
    case $stage in offload64|offload69) log gpu-tests; timeout 200 python -m pytest -q -rs -m gpu -p no:cacheprovider \
      tests/test_events.py tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1;; esac
    for i in 1 2 3; do
      [ $SECONDS -gt 360 ] || { case $stage in offload66|offload70) [ $i -gt 2 ];; *) false;; esac; } && break
      log ab-none-$i; timeout 90 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
        --child-timeout 80 --configs none --name bench_offload_ab_${stage}_none_$i --out benchmarks/results \
        > "$OUT/l/ab-none-$i.log" 2>&1
      for v in $(ls .ab 2>/dev/null) tree; do
        pp=$PYTHONPATH; [ "$v" = tree ] || pp=$PWD/.ab/$v:$PYTHONPATH
        log ab-$v-$i; PYTHONPATH=$pp timeout 100 python benchmarks/bench_offload.py --warmup 2 --steps 8 \
          --pool-gb 20 --child-timeout 90 --configs dsx_auto_hide --name bench_offload_ab_${stage}_${v}_$i \
          --out benchmarks/results > "$OUT/l/ab-$v-$i.log" 2>&1
      done
    done
    gaps=bench_offload_gaps_s19b; [ $stage = offload69 ] && gaps=bench_offload_gaps_s20
    case $stage in offload64|offload69) [ $SECONDS -lt 480 ] && { log gaps-tree; timeout 100 python \
      benchmarks/bench_offload.py --warmup 2 --steps 5 --pool-gb 20 --child-timeout 90 --configs dsx_auto_hide \
      --kernel-trace /tmp/kt --name $gaps --out benchmarks/results > "$OUT/l/gaps-tree.log" 2>&1; };; esac
    tar czf "$OUT/logs.tgz" -C "$OUT/l" . && rm -rf "$OUT/l"
    ;;
  offload65)  # 1 GPU: the events and offload GPU tests on the final code of stop 19 (unread buffers dropped without a
              # host wait)
    log gpu-tests; timeout 300 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    ;;
  offload67|offload68)  # 1 GPU: what moving the hide-only plan's bytes costs without dsx: no offload, the hide-only
              # plan, and no offload with as many bytes copied on side streams (none_copies, bench_offload's
              # _BackgroundCopies), each in its own process, rounds interleaved (logs packed in logs.tgz);
              # offload67 runs the events and offload GPU tests first (stop 19's last commits were not run on the GPU);
              # its none_copies ran before the copier hooked after DeepSpeed's synchronizing pre-hook (kept in
              # docs/logs/s20-offload67/, not in benchmarks/results)
    mkdir -p "$OUT/l"
    [ $stage = offload67 ] && { log gpu-tests; timeout 240 python -m pytest -q -rs -m gpu -p no:cacheprovider \
      tests/test_events.py tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1; }
    for i in 1 2 3 4; do
      [ $SECONDS -gt 400 ] && break  # a round takes ~150 s: stop before the command's 600 s
      log ab-none-$i; timeout 90 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
        --child-timeout 80 --configs none --name bench_offload_copies_${stage}_none_$i --out benchmarks/results \
        > "$OUT/l/ab-none-$i.log" 2>&1
      log ab-hide-$i; timeout 100 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
        --child-timeout 90 --configs dsx_auto_hide --name bench_offload_copies_${stage}_hide_$i \
        --out benchmarks/results > "$OUT/l/ab-hide-$i.log" 2>&1
      # the bytes the hide-only run just moved a step (its median), copied without dsx
      gb=$(python -c "import json, statistics as s; r = json.load(open('benchmarks/results/bench_offload_copies_${stage}_hide_$i.json'))['results'][0]; print(s.median(r['telemetry']['written_gb_per_measured_step']))" 2>/dev/null || echo 4.8)
      log ab-copies-$i $gb GB; timeout 90 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
        --child-timeout 80 --configs none_copies --copy-gb $gb --name bench_offload_copies_${stage}_copies_$i \
        --out benchmarks/results > "$OUT/l/ab-copies-$i.log" 2>&1
    done
    tar czf "$OUT/logs.tgz" -C "$OUT/l" . && rm -rf "$OUT/l"
    ;;
  offload71)  # 1 GPU: stop 21: the events and offload GPU tests on stop 20's final code (its last commit was not run on
              # the GPU), then no offload, the hide-only plan, and the hide-only plan with the write barrier on (what
              # the barrier costs now that host writes are polled, and what it saves), rounds interleaved
    mkdir -p "$OUT/l"
    log gpu-tests; timeout 200 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    for i in 1 2 3; do
      [ $SECONDS -gt 430 ] && break  # a round takes ~140 s: stop before the command's 600 s
      for c in none hide barrier; do
        cfg=dsx_auto_hide; wb=auto; [ $c = none ] && cfg=none; [ $c = barrier ] && wb=on
        log ab-$c-$i; timeout 100 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
          --child-timeout 90 --configs $cfg --write-barrier $wb --name bench_offload_barrier_s21_${c}_$i \
          --out benchmarks/results > "$OUT/l/ab-$c-$i.log" 2>&1
      done
    done
    tar czf "$OUT/logs.tgz" -C "$OUT/l" . && rm -rf "$OUT/l"
    ;;
  offload72)  # 1 GPU: stop 21's closing run, part 1, on the final code: every strategy of issue 3 at hidden 2048,
              # micro-batch 8, in one invocation (the stop 15 closing run predates stops 16-20's changes)
    nvidia-smi -L | tee "$OUT/nvidia-smi.log"
    log bench-offload-final-h2048-s21; timeout 570 python benchmarks/bench_offload.py --warmup 2 --steps 3 \
      --pool-gb 20 --child-timeout 80 --configs none recompute save_on_cpu ds_cpu_ckpt megatron_selective \
      dsx_host_sel dsx_auto_budget_sel dsx_auto_hide_sel dsx_auto_hide --name bench_offload_final_h2048_s21 \
      --out benchmarks/results > "$OUT/bench-offload-final-h2048-s21.log" 2>&1
    ;;
  offload73)  # 1 GPU: stop 21's closing run, part 2: every strategy at hidden 4096, micro-batch 4, the SSD tier included
    log bench-offload-final-h4096-s21; timeout 575 python benchmarks/bench_offload.py --hidden 4096 --heads 32 \
      --micro-batch 4 --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 --configs none recompute save_on_cpu \
      ds_cpu_ckpt megatron_selective dsx_host_sel dsx_ssd_sel dsx_auto_budget_sel dsx_auto_hide_sel \
      --name bench_offload_final_h4096_s21 --out benchmarks/results > "$OUT/bench-offload-final-h4096-s21.log" 2>&1
    ;;
  offload74)  # 1 GPU: stop 21's closing run, part 3: the SSD tier at hidden 2048 (~8 GiB a step each way over the
              # virtio disk: its own invocation, 280 s allowed), then micro-batch 16, which runs out of memory without dsx
    log bench-offload-final-h2048-ssd-s21; timeout 300 python benchmarks/bench_offload.py --warmup 1 --steps 2 \
      --pool-gb 20 --child-timeout 280 --configs dsx_ssd_sel --name bench_offload_final_h2048_ssd_s21 \
      --out benchmarks/results > "$OUT/bench-offload-final-h2048-ssd-s21.log" 2>&1
    log bench-offload-final-mb16-s21; timeout 200 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
      --child-timeout 80 --micro-batch 16 --configs none recompute dsx_auto_budget_sel \
      --name bench_offload_final_mb16_s21 --out benchmarks/results > "$OUT/bench-offload-final-mb16-s21.log" 2>&1
    ;;
  offload75)  # 1 GPU: the write barrier on by default (hide-only plans, and offload_all's fixed rule): the events and
              # offload GPU tests; offload_all +sel at hidden 2048 with the barrier (now the default) and without
              # (its peak rose from 11.8 to 17.9 GB in offload72: the host queued backward under the copies);
              # no offload and hide-only +sel at hidden 4096 (barrier now on); auto at hidden 4096 at 1.00 and 1.01x
              # recompute's peak with the allocator's history (offload73's mixed plan overshot by one 64 MiB block)
    mkdir -p "$OUT/l"
    log gpu-tests; timeout 200 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    for wb in auto off; do
      log host-sel-barrier-$wb; timeout 100 python benchmarks/bench_offload.py --warmup 2 --steps 3 --pool-gb 20 \
        --child-timeout 90 --configs dsx_host_sel --write-barrier $wb --name bench_offload_fixed_barrier_s21_$wb \
        --out benchmarks/results > "$OUT/l/host-sel-barrier-$wb.log" 2>&1
    done
    log h4096-hide; timeout 130 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 \
      --warmup 2 --steps 5 --pool-gb 20 --child-timeout 90 --configs none dsx_auto_hide_sel \
      --name bench_offload_hide_h4096_s21 --out benchmarks/results > "$OUT/l/h4096-hide.log" 2>&1
    [ $SECONDS -lt 400 ] && { log h4096-budget-trace; timeout 180 python benchmarks/bench_offload.py --hidden 4096 \
      --heads 32 --micro-batch 4 --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 \
      --configs recompute dsx_auto_budget_sel --budget-scales 1 1.01 --memory-history benchmarks/results \
      --name bench_offload_budget_h4096_s21 --out benchmarks/results > "$OUT/l/h4096-budget-trace.log" 2>&1; }
    tar czf "$OUT/logs.tgz" -C "$OUT/l" . && rm -rf "$OUT/l"
    ;;
  offload76)  # 1 GPU: the final code of stop 21 (write barrier back off for hide-only plans, on for offload_all; a
              # backward-start hook below each moved layer releases its read buffers before the recomputed layers'
              # backward): the events and offload GPU tests, auto at hidden 4096 at recompute's peak (offload73/75:
              # one 64 MiB read buffer over, so recompute_all), then micro-batch 16 (OOM without dsx) again
    log gpu-tests; timeout 220 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    log h4096-budget; timeout 180 python benchmarks/bench_offload.py --hidden 4096 --heads 32 --micro-batch 4 \
      --warmup 2 --steps 3 --pool-gb 20 --child-timeout 90 --configs recompute dsx_auto_budget_sel \
      --name bench_offload_budget_h4096_s21_final --out benchmarks/results > "$OUT/h4096-budget.log" 2>&1
    [ $SECONDS -lt 420 ] && { log mb16; timeout 150 python benchmarks/bench_offload.py --warmup 2 --steps 3 \
      --pool-gb 20 --child-timeout 80 --micro-batch 16 --configs none recompute dsx_auto_budget_sel \
      --name bench_offload_final_mb16_s21_final --out benchmarks/results > "$OUT/mb16.log" 2>&1; }
    ;;
  offload77)  # 1 GPU: stop 22: the events and offload GPU tests on stop 21's final code (its last two commits, the
              # release hook's condition and a test, were not run on the GPU), then the SSD tier at hidden 2048 again
              # (offload74's row ran before offload_all held the write barrier), then micro-batch 16 on the final code
    log gpu-tests; timeout 220 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-final-h2048-ssd-s22; timeout 300 python benchmarks/bench_offload.py --warmup 1 --steps 2 \
      --pool-gb 20 --child-timeout 280 --configs dsx_ssd_sel --name bench_offload_final_h2048_ssd_s22 \
      --out benchmarks/results > "$OUT/bench-offload-final-h2048-ssd-s22.log" 2>&1
    [ $SECONDS -lt 440 ] && { log mb16; timeout 150 python benchmarks/bench_offload.py --warmup 2 --steps 3 \
      --pool-gb 20 --child-timeout 80 --micro-batch 16 --configs none recompute dsx_auto_budget_sel \
      --name bench_offload_final_mb16_s22 --out benchmarks/results > "$OUT/mb16.log" 2>&1; }
    ;;
  offload78)  # 1 GPU: SSD writes give their device bytes back when the copy ends (the compute thread's poll), not
              # when an I/O thread reaches them (offload77: the write barrier waited 3.6 s a step on the drive):
              # the events and offload GPU tests, then the SSD tier at hidden 2048 as in offload77
    log gpu-tests; timeout 220 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    log bench-offload-final-h2048-ssd-s22b; timeout 300 python benchmarks/bench_offload.py --warmup 1 --steps 2 \
      --pool-gb 20 --child-timeout 280 --configs dsx_ssd_sel --name bench_offload_final_h2048_ssd_s22b \
      --out benchmarks/results > "$OUT/bench-offload-final-h2048-ssd-s22b.log" 2>&1
    ;;
  offload79)  # 1 GPU: stop 22's final code: the events and offload GPU tests; then the two new SSD-release tests
              # on a copy of this tree with the transfer.py of before the fix (.ab/transfer_886c0fb.py, git-ignored,
              # carried): both must fail there (the barrier variant after its 20 s watchdog)
    log gpu-tests; timeout 260 python -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_events.py \
      tests/test_offload_gpu.py > "$OUT/gpu-tests-offload.log" 2>&1
    log old-transfer; rm -rf /tmp/oldtree && mkdir /tmp/oldtree && cp -r dsx tests pyproject.toml /tmp/oldtree/ \
      && cp .ab/transfer_886c0fb.py /tmp/oldtree/dsx/offload/transfer.py \
      && (cd /tmp/oldtree && PYTHONPATH=/tmp/site:/tmp/oldtree timeout 120 python -m pytest -q -rs -m gpu \
        -p no:cacheprovider tests/test_offload_gpu.py -k ssd_writes > "$OUT/gpu-tests-old-transfer.log" 2>&1)
    ;;
  offload80)  # 1 GPU: stop 22's final code, the no-budget target again: no offload, the hide-only plan and the
              # hide-only plan with the attention's recompute allowed (+sel), each in its own process, rounds
              # interleaved until ~470 s (logs in logs.tgz; ab_summary.py reads the JSONs)
    mkdir -p "$OUT/l"
    for i in 1 2 3 4 5; do
      [ $SECONDS -gt 440 ] && break
      for v in none hide sel; do
        cfg=dsx_auto_hide; [ $v = none ] && cfg=none; [ $v = sel ] && cfg=dsx_auto_hide_sel
        log ab-$v-$i; timeout 100 python benchmarks/bench_offload.py --warmup 2 --steps 8 --pool-gb 20 \
          --child-timeout 90 --configs $cfg --name bench_offload_ab_offload80_${v}_$i \
          --out benchmarks/results > "$OUT/l/ab-$v-$i.log" 2>&1
      done
    done
    tar czf "$OUT/logs.tgz" -C "$OUT/l" . && rm -rf "$OUT/l"
    ;;
  *) echo "unknown stage $stage" >&2; exit 2;;
esac
log done
tar czf "$OUT/results.tgz" benchmarks/results
