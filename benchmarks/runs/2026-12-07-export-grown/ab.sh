#!/bin/bash
# alternating: whole (78a9b6d) and grown (new), 3 rounds, fresh processes, load beside each
cd /tmp
for r in 1 2 3; do
  for v in whole grown; do
    if [ $v = whole ]; then PP=/tmp/oldtree; else PP=/work/main; fi
    l=$(cut -d' ' -f1 /proc/loadavg)
    /usr/bin/time -f "$v round$r wall %e user %U sys %S maxrss_kb %M load_before $l" -a -o /tmp/smolexp/ab/times.txt \
      env PYTHONPATH=$PP /work/main/.venv/bin/python -m attnres_compile.cli rewrite /tmp/smolexp/ckpt -o /tmp/smolexp/ab/$v.onnx --with-past --force > /tmp/smolexp/ab/$v-$r.txt 2>&1
  done
done
echo done >> /tmp/smolexp/ab/times.txt
