#!/usr/bin/env bash
# session 19 call 2: the cp.async loader on more workloads; phase profiles of both loaders
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TILEC_CACHE_DIR=$PWD/.tilec-cache
L=$OUT/logs; mkdir -p $L
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee $L/smi.txt
timeout 150 python benchmarks/lab/variants_ab.py 'tma=' 'cpa4=TILEC_LAB_CPASYNC_LOADER=4' 'cpa3=TILEC_LAB_CPASYNC_LOADER=3' --rounds 5 2>&1 | grep -v DEBUG | tail -8 > $L/ab1b.log; cat $L/ab1b.log
timeout 100 python benchmarks/profile_step.py --model llama-3.2-1b --context 1024 --out $L/trace_tma.json 2>&1 | grep -v DEBUG | tail -14 > $L/prof_tma.log; head -14 $L/prof_tma.log
TILEC_NVCC_FLAGS="-DTILEC_LAB_CPASYNC_LOADER=4" timeout 100 python benchmarks/profile_step.py --model llama-3.2-1b --context 1024 --out $L/trace_cpa4.json 2>&1 | grep -v DEBUG | tail -14 > $L/prof_cpa4.log; head -14 $L/prof_cpa4.log
timeout 200 python benchmarks/lab/variants_ab.py 'tma=' 'cpa4=TILEC_LAB_CPASYNC_LOADER=4' --model llama-3.1-8b --rounds 3 --iters 20 2>&1 | grep -v DEBUG | tail -4 > $L/ab8b.log; cat $L/ab8b.log
timeout 120 python benchmarks/lab/variants_ab.py 'tma=' 'cpa4=TILEC_LAB_CPASYNC_LOADER=4' --batch 16 --rounds 3 --iters 20 2>&1 | grep -v DEBUG | tail -4 > $L/ab16.log; cat $L/ab16.log
timeout 150 python benchmarks/lab/glm5_variants_ab.py 'tma=' 'cpa4=TILEC_LAB_CPASYNC_LOADER=4' --rounds 3 2>&1 | grep -v DEBUG | tail -25 > $L/abglm.log; cat $L/abglm.log
tar czf $OUT/logs.tgz -C $OUT logs
