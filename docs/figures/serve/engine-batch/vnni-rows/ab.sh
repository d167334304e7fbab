#!/bin/bash
# The rows path (2f959c7, the checkout) against 56203db (a worktree at /tmp/base with its own build), alternated;
# (the runs were then gathered into ab.json beside this script)
cd /work/main
D=/tmp/bd/ab2
mkdir -p $D
for i in 1 2; do
  for which in old main; do
    if [ $which = old ]; then P=/tmp/base; else P=/work/main; fi
    for model in smollm2-135m qwen2.5-coder-0.5b; do
      PYTHONPATH=$P .venv/bin/python benchmarks/batch_decode.py --model $model --batches 1,4,8,16 --threads 1,2 \
        --prompt-tokens 100,300 --steps 16 --repeats 3 --out $D/$model/$which-$i > $D/$model-$which-$i.log 2>&1
      PYTHONPATH=$P .venv/bin/python benchmarks/decode_speed.py --model $model --variants '' --compile file --kv float16 \
        --lengths 128 --prefill 512 --threads 1,2 --repeats 3 --no-transformers --no-llamacpp \
        --json $D/$model/$which-$i/decode_speed.json > $D/$model-$which-$i-ds.log 2>&1
    done
  done
done
echo ALLDONE
