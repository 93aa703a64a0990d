set -u
export PYTHONUNBUFFERED=1
source tests/gpu/env.sh > $OUT/env.txt 2>&1
P=/tmp/pipenv/bin/python; [ -x $P ] || P=python3
PYTHONPATH=/tmp/pkgs $P -m pip install -q --no-index --find-links .wheels --no-deps --target /tmp/pkgs pytest-timeout hypothesis sortedcontainers >> $OUT/env.txt 2>&1
cp $OUT/machine.txt $OUT/machine.txt 2>/dev/null
export CONVGPU_GPU_LOG=$OUT/gpu-results.jsonl CONVGPU_REQUIRE_SYSTEM=1
timeout ${T:-540} python3 -m pytest -m gpu -p no:cacheprovider -p timeout --timeout=${PT:-150} -v -rA --tb=short "$@" > $OUT/pytest-gpu.txt 2>&1
echo "pytest rc=$?"; grep -E "PASSED|FAILED|ERROR|SKIPPED|XPASS|XFAIL" $OUT/pytest-gpu.txt | grep "::" | tail -40; tail -3 $OUT/pytest-gpu.txt
