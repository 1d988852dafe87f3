"""``oldgpu plan``'s command line: the inputs from flags, detection or the profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from oldgpu import detect, profile
from oldgpu.output import EngineError, Result
from oldgpu.plan.explain import payload, text
from oldgpu.plan.inputs import PPO_MINI_BATCHES, Inputs
from oldgpu.plan.model import SHAPES, load_model_dir
from oldgpu.plan.search import CAP_FRACTION, CAP_MARGIN_MIB, MAX_OFFLOAD, plan


def _profile_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any]]:
    """The profile and, when detected, the GPUs it came from."""
    if args.profile:
        arch, _, cc = args.profile.partition("-")
        return profile.profile_for_arch(arch, cc or None), []
    if args.arch:
        return profile.profile_for_arch(args.arch), []
    if args.cc:
        return profile.profile_for_cc(args.cc), []
    gpus = detect.detect_from_args(args)["gpus"]
    return profile.profile_for_gpus(gpus), gpus


def _host_available_mib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    prof, gpus = _profile_from_args(args)
    device = prof["device"]
    if device == "cpu":
        if args.gpu_mib is not None and not (args.profile or args.arch or args.cc):
            raise EngineError(
                "plan-profile-unknown",
                "no GPU detected; pass --arch/--cc/--profile for the GPU you plan for, or "
                "--profile cpu with --host-mib",
            )
        memory = args.host_mib or _host_available_mib()
        if not memory:
            raise EngineError("plan-memory-unknown", "the cpu profile needs --host-mib N")
    else:
        memory = args.gpu_mib
        if memory is None:
            sizes = [g.get("memory_mib") for g in gpus]
            if not sizes or not all(sizes):
                raise EngineError(
                    "plan-memory-unknown",
                    "cannot tell the GPU's memory; pass --gpu-mib N (the smallest GPU's)",
                )
            memory = min(sizes)
    if args.model:
        shape, name = load_model_dir(args.model), str(args.model)
    else:
        name = args.model_shape or "qwen2.5-0.5b"
        shape = SHAPES[name]
    return Inputs(
        memory_mib=int(memory),
        gpus=args.gpus,
        shape=shape,
        prompt_length=args.prompt_length,
        response_length=args.response_length,
        compute_dtype=prof["compute_dtype"],
        rollout=prof["rollout"],
        device=device,
        critic=args.critic,
        ref=args.ref,
        rollout_n=args.rollout_n,
        headroom_mib=args.headroom_mib,
        target_train_batch=args.target_train_batch,
        max_offload=args.max_offload,
        ppo_mini_batches=args.ppo_mini_batches,
        model_name=name,
        profile_name=prof["name"],
    )


def run(args: argparse.Namespace) -> Result:
    inp = inputs_from_args(args)
    doc = payload(plan(inp))
    return Result(payload=doc, text=text(doc))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "plan",
        parents=[common],
        help="batch sizes, micro batches, checkpointing and offload that fit the GPU",
        description=(sys.modules[__package__].__doc__ or "").split("\n\n")[0] or None,
    )
    mem = parser.add_argument_group("memory")
    mem.add_argument("--gpu-mib", type=int, metavar="N", help="one GPU's memory (default: detect)")
    mem.add_argument("--host-mib", type=int, metavar="N", help="host memory budget (cpu profile)")
    mem.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs per node (default 1)")
    mem.add_argument(
        "--headroom-mib",
        type=int,
        metavar="N",
        help=f"keep the peak N MiB under the memory (default: min(memory - {CAP_MARGIN_MIB}, "
        f"{CAP_FRACTION} x memory))",
    )
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", metavar="DIR", help="a model directory with config.json")
    model.add_argument(
        "--model-shape", choices=sorted(SHAPES), help="a built-in shape (default qwen2.5-0.5b)"
    )
    parser.add_argument("--prompt-length", type=int, default=512, metavar="N")
    parser.add_argument("--response-length", type=int, default=256, metavar="N")
    prof = parser.add_mutually_exclusive_group()
    prof.add_argument("--profile", metavar="NAME", help="a profile name: pascal, pascal-6.1, cpu")
    prof.add_argument("--arch", choices=sorted(profile.PROFILES))
    prof.add_argument("--cc", metavar="X.Y")
    parser.add_argument(
        "--critic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a critic (GAE needs one; GRPO does not)",
    )
    parser.add_argument(
        "--ref",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a reference model (KL loss or KL in reward)",
    )
    parser.add_argument("--rollout-n", type=int, default=1, metavar="N", help="responses/prompt")
    parser.add_argument("--target-train-batch", type=int, metavar="N")
    parser.add_argument(
        "--max-offload",
        choices=tuple(MAX_OFFLOAD),
        default="all",
        help="the most offload the plan may use (default all)",
    )
    parser.add_argument(
        "--ppo-mini-batches",
        type=int,
        default=PPO_MINI_BATCHES,
        metavar="K",
        help=f"optimizer steps per PPO step to aim for (default {PPO_MINI_BATCHES})",
    )
    detect.add_source_args(parser)
    parser.set_defaults(func=run)
