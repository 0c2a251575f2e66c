python3 bin/bench.py --store bf16 --store nvfp4 --num-tokens 1000000 --disk-probe-gb 1 --results-dir /tmp/r54/bench
