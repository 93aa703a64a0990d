source tests/gpu/env.sh > $OUT/env.txt 2>&1; export PYTHONUNBUFFERED=1
mkfifo /tmp/fifo_a /tmp/fifo_b; (sleep 60 > /tmp/fifo_a &) ; (sleep 60 > /tmp/fifo_b &)
R=/tmp/resv; mkdir -p $R; CG=/sys/fs/cgroup/resv; mkdir -p $CG/a $CG/b
python3 -m convgpu.cli.main enforce --gpu-memory 40GiB --default-limit 20GiB --run-dir $R --state-dir $R 2> $OUT/enf.txt &
sleep 12
W='import torch,sys; c=[torch.empty(1<<30,dtype=torch.uint8,device="cuda") for i in range(4)]; print("ok",flush=True); sys.stdin.readline()'
SHIM=$(python3 -m convgpu.cli.main shim --print-env --run-dir $R)
( sh -c "echo \$\$ > $CG/a/cgroup.procs; exec env $SHIM python3 -c '$W'" < /tmp/fifo_a > $OUT/a.txt 2>&1 & )
( sh -c "echo \$\$ > $CG/b/cgroup.procs; exec python3 -c '$W'" < /tmp/fifo_b > $OUT/b.txt 2>&1 & ) 
sleep 25; cat $OUT/a.txt $OUT/b.txt | tail -5
python3 -m convgpu.cli.main status --json --run-dir $R | python3 -c 'import json,sys; s=json.load(sys.stdin); [print(c["name"], {k:c["gpus"]["0"][k] for k in ("used","reserved","context_overhead","waiting")}) for c in s["containers"]]'
grep -v 'INFO convgpu.probes' $OUT/enf.txt | tail -12 | cut -c1-220
