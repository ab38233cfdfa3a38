#!/usr/bin/env bash
# Launch perf/bench_internode_ll.py with torchrun on N nodes x 8 GPUs (run this script on every node).
#
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0's address> bash perf/launch_internode.sh [bench args...]
#   bash perf/launch_internode.sh --dry-run [bench args...]   # print the environment and the command only
#
# Environment: NNODES (1), NODE_RANK (0), MASTER_ADDR (required when NNODES > 1; 127.0.0.1 otherwise),
# MASTER_PORT (29500), GPUS_PER_NODE (8; the GPUs of this node that the bench uses, one process each),
# EXPERTS (the bench's --experts, else 256; sizes NVSHMEM_IBGDA_NUM_RC_PER_PE), PURE_RDMA (0; 1: same-node
# peers go through the NIC too, as DeepEP's published low-latency figures were taken), TORCHRUN (torchrun).
# Every NVSHMEM_* variable below keeps a value already set in the environment. Bench args go to
# perf/bench_internode_ll.py (e.g. --backend nvshmem symm, --json ll.jsonl, --nic-gbps 50, --graph).
# Exits 2 without torchrun, without enough GPUs, or with an invalid setting; otherwise torchrun's status.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
dry=0
args=()
bench_experts=
prev=
for a in "$@"; do
  case "$a" in
    -h|--help) usage; exit 0 ;;
    --dry-run) dry=1 ;;
    --experts=*) bench_experts=${a#--experts=}; args+=("$a") ;;
    *) [ "$prev" = --experts ] && bench_experts=$a; args+=("$a") ;;
  esac
  prev=$a
done
die() { echo "launch_internode.sh: error: $*" >&2; exit 2; }

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
EXPERTS=${EXPERTS:-${bench_experts:-256}}
PURE_RDMA=${PURE_RDMA:-0}
TORCHRUN=${TORCHRUN:-torchrun}
for v in NNODES NODE_RANK MASTER_PORT GPUS_PER_NODE EXPERTS; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "$v must be a non-negative integer, got '${!v}'"
done
[ "$NNODES" -ge 1 ] || die "NNODES must be >= 1"
[ "$GPUS_PER_NODE" -ge 1 ] || die "GPUS_PER_NODE must be >= 1"
[ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK ($NODE_RANK) must be < NNODES ($NNODES)"
if [ "$NNODES" -gt 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  die "MASTER_ADDR is required with NNODES=$NNODES (the address of node 0, reachable from every node)"
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
WORLD=$((NNODES * GPUS_PER_NODE))

command -v "$TORCHRUN" >/dev/null 2>&1 || die "'$TORCHRUN' not found: install PyTorch with torch.distributed (torchrun) in \
this environment, or set TORCHRUN to its path"
if [ "${CUDA_VISIBLE_DEVICES-unset}" = "" ]; then
  gpus=0
else
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
[ "$gpus" -ge 1 ] || die "no CUDA GPU found on this node (nvidia-smi lists none); the bench needs $GPUS_PER_NODE GPUs per node \
(--cpu-smoke of perf/bench_internode_ll.py runs without GPUs)"
[ "$gpus" -ge "$GPUS_PER_NODE" ] || die "this node has $gpus GPU(s), GPUS_PER_NODE=$GPUS_PER_NODE: set GPUS_PER_NODE=$gpus \
(every node the same)"

# ---- NVSHMEM: the GPU-initiated InfiniBand transport (IBGDA). Names and meanings: NVIDIA NVSHMEM documentation,
# "Environment Variables" (docs.nvidia.com/nvshmem/api/gen/env.html) and its IBGDA performance notes.
# Enable IBGDA: the GPU's own threads build the work requests and post them to the NIC (no CPU proxy thread).
export NVSHMEM_IB_ENABLE_IBGDA=${NVSHMEM_IB_ENABLE_IBGDA:-1}
# Who rings the NIC's doorbell: gpu = the SMs themselves. The default (auto) silently falls back to the CPU
# when the platform cannot map the doorbell for the GPU, which would time a different path; gpu fails instead.
export NVSHMEM_IBGDA_NIC_HANDLER=${NVSHMEM_IBGDA_NIC_HANDLER:-gpu}
qps=$((EXPERTS / WORLD)); [ "$qps" -ge 1 ] || qps=1
# RC (reliable connection) queue pairs per peer PE. Blocks are spread over them (NVSHMEM_IBGDA_RC_MAP_BY, by
# CTA by default), so more QPs let more blocks post in parallel; one per local expert, as DeepEP V1 uses
# (num_qps_per_rank = experts / ranks), so both backends get the same QPs in one run.
export NVSHMEM_IBGDA_NUM_RC_PER_PE=${NVSHMEM_IBGDA_NUM_RC_PER_PE:-$qps}
# Work requests per QP: must exceed what one QP can have in flight between two completions (default 1024).
export NVSHMEM_QP_DEPTH=${NVSHMEM_QP_DEPTH:-1024}
# NVLink SHARP (NVLS) serves NVSHMEM collectives only; point-to-point puts do not use it: skip its setup.
export NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
p2p=0
if [ "$PURE_RDMA" = 1 ]; then p2p=1; args+=(--pure-rdma); fi
# Same-node peers: 0 lets NVSHMEM reach them over NVLink (P2P); 1 sends them through the NIC too (pure RDMA).
export NVSHMEM_DISABLE_P2P=${NVSHMEM_DISABLE_P2P:-$p2p}
# The symmetric heap per PE: the nvshmem backend's buffer (NvshmemBackend.get_low_latency_size_hint: 971 MB at EP128
# for DeepSeek-V3 decode, 470 MB of it staging) and DeepEP's (1.91 GB) do not fit NVSHMEM's 1 GiB default.
export NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-4G}
# Left to the cluster (set them before calling this script when they apply; kept as given):
#   NVSHMEM_ENABLE_NIC_PE_MAPPING=1 with NVSHMEM_HCA_LIST (e.g. mlx5_0:1,...) or NVSHMEM_HCA_PE_MAPPING: pin each
#     PE to a NIC; unset, a PE uses the NIC closest to its GPU (right for one NIC per GPU);
#   NVSHMEM_IB_SL: InfiniBand service level (virtual lane) of the traffic, to isolate it from other jobs;
#   NVSHMEM_IB_GID_INDEX, NVSHMEM_IB_TRAFFIC_CLASS: RoCE only (source GID index, traffic class);
#   NVSHMEM_IBGDA_NUM_REQUESTS_IN_BATCH: requests batched before the doorbell (1: submit each at once);
#   NVSHMEM_DEBUG=WARN|INFO and NVSHMEM_INFO=1: what NVSHMEM chose, printed at start-up.

cmd=("$TORCHRUN" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
     --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
     perf/bench_internode_ll.py --launcher torchrun --gpus-per-node "$GPUS_PER_NODE" ${args[@]+"${args[@]}"})
echo "# launch_internode.sh: node $NODE_RANK of $NNODES, $GPUS_PER_NODE GPUs per node ($WORLD ranks), master $MASTER_ADDR:$MASTER_PORT"
env | grep '^NVSHMEM_' | sort | sed 's/^/# /'
echo "# ${cmd[*]}"
[ "$dry" = 1 ] && exit 0
exec "${cmd[@]}"
