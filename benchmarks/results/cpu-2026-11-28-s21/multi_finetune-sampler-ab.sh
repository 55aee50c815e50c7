for r in 1 2; do
for side in old new; do
  if [ $side = old ]; then d=/tmp/old; else d=/work/main; fi
  echo "== $side round $r"
  python $d/benchmarks/multi_finetune.py --model 100m --jobs 1,4 --steps 4 --arms vanilla,symbiont --executor-matmul onednn --work /tmp/mft 2>&1 | grep -A3 "tput/vanilla"
done; done
