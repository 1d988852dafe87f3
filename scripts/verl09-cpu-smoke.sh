#!/usr/bin/env bash
# verl 0.9.0's GRPO for 2 steps on the CPU, rolling out through the oldgpu-hf rollout
# (issue 27's proof of concept, before any GPU). Reproduces the run docs/newer-verl.md
# reports:
#   1. a venv (outside the repo) with verl 0.9.0's install_requires, a CPU torch, and what
#      its rollout path imports without declaring it (fastapi, uvicorn, cachetools);
#      no vllm/sglang/flash-attn/liger;
#   2. the 0.9.0 sdist unpacked and patched by the engine for the cpu profile;
#   3. the engine's tiny Qwen2 and GSM8K-shaped parquet (smoke-assets, offline);
#   4. main_ppo with the legacy trainer (trainer.use_v1=false: no TransferQueue), the
#      oldgpu-hf rollout registered through VERL_USE_EXTERNAL_MODULES and the cpu
#      platform through VERL_PLATFORM=cpu.
# Environment: VERL09_VENV (default /tmp/verl09-venv), VERL09_WORK (/tmp/verl09-cpu),
# OLDGPU_CACHE (/var/cache/oldgpu: sdists/verl-0.9.0.tar.gz), TORCH_SPEC (the torch to
# install; default the 2.13.0 CPU wheel), STEPS (2), LR (1e-5); the shape: BATCH (4
# prompts), N (2 responses each), RESPONSE (32 tokens), AGENT_WORKERS and REWARD_WORKERS
# (1 each, as the engine's jobs); more overrides as arguments.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VERL09_VENV:-/tmp/verl09-venv}
work=${VERL09_WORK:-/tmp/verl09-cpu}
cache=${OLDGPU_CACHE:-/var/cache/oldgpu}
sdist=$cache/sdists/verl-0.9.0.tar.gz
torch_spec=${TORCH_SPEC:-torch==2.13.0+cpu}
steps=${STEPS:-2}
lr=${LR:-1e-5}
batch=${BATCH:-4}
n=${N:-2}
response=${RESPONSE:-32}
agent_workers=${AGENT_WORKERS:-1}
reward_workers=${REWARD_WORKERS:-1}

if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install "$torch_spec"
  # verl 0.9.0's setup.py install_requires (no extras), and the three modules its
  # rollout path imports at module level without declaring them.
  "$venv/bin/pip" install "$torch_spec" accelerate codetiming datasets dill hydra-core \
    'numpy>=2.0.0' pandas peft 'pyarrow>=19.0.0' pybind11 pylatexenc 'ray[default]>=2.41.0' \
    torchdata 'tensordict>=0.8.0,<=0.10.0,!=0.9.0' 'transformers>=5.5.3,!=5.6.0,<5.11' \
    wandb 'packaging>=20.0' tensorboard fastapi uvicorn cachetools pytest
  "$venv/bin/pip" freeze >"$venv/freeze.txt"
fi
py=$venv/bin/python

tree=$work/verl-0.9.0
if [[ ! -f $tree/.oldgpu-patch.json ]]; then
  rm -rf "$tree" && mkdir -p "$work"
  tar -xzf "$sdist" -C "$work"
  PYTHONPATH=$root/src "$py" -m oldgpu patch "$tree" --profile cpu --json >"$work/patch.json"
fi
assets=$work/assets
if [[ ! -d $assets/model ]]; then
  PYTHONPATH=$root/src "$py" -m oldgpu smoke-assets --out "$assets" --json >"$work/assets.json"
fi

export PYTHONPATH=$tree:$root/src
export VERL_USE_EXTERNAL_MODULES=oldgpu.verl_plugin.hook
export VERL_PLATFORM=cpu
# verl registers its FSDP engines for cuda/npu only; the cpu platform runs the cuda one.
export VERL_ENGINE_DEVICE=cuda
export OLDGPU_COMPUTE_DTYPE=fp32 OLDGPU_ATTN_IMPLEMENTATION=sdpa
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HYDRA_FULL_ERROR=1 RAY_DEDUP_LOGS=0
cd "$work"
exec "$py" -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$assets/data/train.parquet" \
  data.val_files="$assets/data/test.parquet" \
  data.train_batch_size="$batch" \
  data.max_prompt_length=256 \
  data.max_response_length="$response" \
  data.dataloader_num_workers=0 \
  actor_rollout_ref.model.path="$assets/model" \
  actor_rollout_ref.model.use_remove_padding=False \
  actor_rollout_ref.actor.optim.lr="$lr" \
  actor_rollout_ref.actor.ppo_mini_batch_size="$batch" \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.fsdp_config.use_torch_compile=False \
  actor_rollout_ref.ref.fsdp_config.use_torch_compile=False \
  actor_rollout_ref.rollout.name=oldgpu-hf \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.n="$n" \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \
  actor_rollout_ref.rollout.agent.num_workers="$agent_workers" \
  critic.model.use_remove_padding=False \
  reward.num_workers="$reward_workers" \
  trainer.use_v1=False \
  trainer.device=cpu \
  trainer.n_gpus_per_node=1 \
  trainer.nnodes=1 \
  trainer.total_training_steps="$steps" \
  trainer.val_before_train=False \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  trainer.logger="['console']" \
  trainer.default_local_dir="$work/checkpoints" \
  +ray_kwargs.ray_init.num_gpus=1 \
  ray_kwargs.ray_init.num_cpus=8 \
  "$@"
