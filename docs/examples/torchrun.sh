#!/usr/bin/env bash
# hgraph train under torchrun: one process per GPU (or per CPU rank with gloo), on one node or several.
#
# One node (all its GPUs; 4 CPU ranks on a machine without GPUs):
#     bash docs/examples/torchrun.sh
# Two nodes: the same command on each, pointing at the first node:
#     NNODES=2 MASTER_ADDR=node01 bash docs/examples/torchrun.sh          # on node01 and on node02
#
# hgraph reads WORLD_SIZE, RANK, LOCAL_RANK and LOCAL_WORLD_SIZE from torchrun, so --world-size and
# --gpus-per-node are not given (a different value would be an error naming both). Global rank 0 alone
# prints, and writes the run folder (RUN_DIR), its metrics and plots. With --checkpoint-dir, a restart
# by torchrun (--max-restarts) resumes from the newest complete checkpoint by itself.
set -euo pipefail

NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(python -c "import torch; print(torch.cuda.device_count() or 4)")}
MAX_RESTARTS=${MAX_RESTARTS:-3}
RUN_DIR=${RUN_DIR:-runs/torchrun}
DATA_ARGS=()                      # DATA=docs.jsonl: your documents; unset: the built-in long-tail documents
if [ -n "${DATA:-}" ]; then DATA_ARGS=(--data "$DATA"); fi

if [ "$NNODES" -eq 1 ]; then
    RDZV=(--standalone)
else                              # every node meets at MASTER_ADDR:MASTER_PORT (c10d rendezvous, restartable)
    RDZV=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-id "${RDZV_ID:-hgraph-$USER}"
          --rdzv-endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}")
fi

exec torchrun "${RDZV[@]}" --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS" \
    -m hgraph.tools.cli train \
    --model llama:tiny ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} --steps 60 --tokens-per-iter 8192 \
    --strategies auto --profile measure \
    --checkpoint-dir "$RUN_DIR/checkpoints" --checkpoint-every 10 --run-dir "$RUN_DIR" \
    --timeout 600 "$@"
