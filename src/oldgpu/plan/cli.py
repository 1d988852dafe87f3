"""``oldgpu plan``'s command line: the inputs from flags, detection or the profile."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from oldgpu import detect, profile, subcommand, verl_release
from oldgpu.output import EngineError, Result
from oldgpu.plan import recipes
from oldgpu.plan.explain import largest_payload, largest_text, payload, text
from oldgpu.plan.inputs import PPO_MINI_BATCHES, Inputs
from oldgpu.plan.model import FAMILIES, SHAPES, load_model_dir
from oldgpu.plan.search import (
    CAP_FRACTION,
    CAP_MARGIN_MIB,
    MAX_OFFLOAD,
    does_not_fit,
    largest,
    plan,
)
from oldgpu.plan.spelling import PLAN

DEFAULT_FAMILY = "qwen2.5"


def _profile_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any]]:
    """The profile and the GPUs whose memory the plan is for: detected (or read from
    --nvidia-smi-file), also under a forced profile unless --gpu-mib gives the memory."""
    forced = None
    if args.profile:
        arch, _, cc = args.profile.partition("-")
        forced = profile.profile_for_arch(arch, cc or None)
    elif args.arch:
        forced = profile.profile_for_arch(args.arch)
    elif args.cc:
        forced = profile.profile_for_cc(args.cc)
    if forced is not None:
        if forced["device"] == "cpu" or args.gpu_mib is not None:
            return forced, []
        gpus = detect.detect_from_args(args)["gpus"]
        return forced, gpus
    gpus = detect.detect_from_args(args)["gpus"]
    if not gpus:
        # A controller has no GPU: planning for its CPU would be a silent wrong answer.
        raise EngineError(
            "plan-no-gpu",
            "no NVIDIA GPU detected here (nvidia-smi"
            + (f" file {args.nvidia_smi_file}" if args.nvidia_smi_file else "")
            + "); to plan for a GPU host pass --profile NAME (or --arch/--cc) with --gpu-mib N, "
            "or --nvidia-smi-file FILE recorded on it; to plan for this CPU pass --profile cpu",
        )
    return profile.profile_for_gpus(gpus), gpus


def _host_available_mib() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _recipe_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe's Inputs fields; the algorithm decides the critic unless --critic says."""
    modules: tuple[str, ...] = ()
    if args.lora_target_modules is not None:
        modules = tuple(m.strip() for m in args.lora_target_modules.split(",") if m.strip())
        if not modules:
            raise EngineError("plan-bad-input", "--lora-target-modules names no module")
    if args.algorithm is not None:
        # The job's rules, from the same function: a plan a job would refuse is refused.
        values = {
            "algorithm": args.algorithm,
            "rollout_n": args.rollout_n,
            "lora_rank": args.lora_rank,
            "lora_alpha": args.lora_alpha,
            "lora_target_modules": modules,
            "base_dtype": args.base_dtype,
        }
        for problem in recipes.setting_problems(values, PLAN):
            unknown = args.algorithm not in recipes.ALGORITHMS
            raise EngineError("plan-algorithm-unknown" if unknown else "plan-bad-input", problem)
    critic = args.critic
    if args.algorithm is not None and critic is None:
        critic = recipes.uses_critic(args.algorithm)
    return {
        "algorithm": args.algorithm,
        "critic": True if critic is None else critic,
        "rollout_n": args.rollout_n,
        "lora_rank": args.lora_rank,
        "lora_alpha": args.lora_alpha,
        "lora_target_modules": modules,
        "base_dtype": args.base_dtype,  # auto: the search's (fp32 without LoRA)
    }


def _gpu_count(given: str, prof: dict[str, Any], gpus: list[Any]) -> int:
    """``--gpus``: N, or ``all`` (a job's default): the detected cards of the profile, one
    when none was detected (``--gpu-mib`` names one card's memory) or on the cpu profile."""
    if given != "all":
        try:
            return int(given)
        except ValueError:
            raise EngineError(
                "plan-bad-input", f"--gpus must be a positive integer or all, not {given!r}"
            ) from None
    if prof["device"] == "cpu":
        return 1
    return max(1, len([g for g in gpus if g.get("architecture") in prof["architectures"]]))


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    if args.largest and (args.model or args.model_shape):
        raise EngineError(
            "plan-bad-input", "--largest plans every shape of --family; drop --model/--model-shape"
        )
    if args.family and not args.largest:
        raise EngineError("plan-bad-input", "--family only goes with --largest")
    recipe = _recipe_from_args(args)
    prof, gpus = _profile_from_args(args)
    # the profile's cards (a mixed host's others are not the job's: oldgpu.devices)
    gpus = [g for g in gpus if g.get("architecture") in prof["architectures"]] or gpus
    version = args.verl_version or verl_release.default()
    if version not in verl_release.releases():
        raise EngineError(
            "verl-version-unknown",
            f"--verl-version {version!r} is not one of {', '.join(verl_release.releases())}",
        )
    verl_release.check_job(version, prof, "")  # what a job of that release would refuse
    recipe["base_dtype"] = verl_release.plan_base_dtype(version, recipe["base_dtype"])
    device = prof["device"]
    if device == "cpu":
        memory = args.host_mib or _host_available_mib()
        if not memory:
            raise EngineError("plan-memory-unknown", "the cpu profile needs --host-mib N")
    else:
        memory = args.gpu_mib
        if memory is None:
            sizes = [g.get("memory_mib") for g in gpus]
            if not sizes or not all(sizes):
                where = f"in {args.nvidia_smi_file}" if args.nvidia_smi_file else "detected"
                raise EngineError(
                    "plan-memory-unknown",
                    f"cannot tell the GPU's memory (no GPU with a memory size {where}); pass "
                    "--gpu-mib N (the smallest GPU's) or --nvidia-smi-file FILE",
                )
            memory = min(sizes)
    if args.model:
        shape, name = load_model_dir(args.model), str(args.model)
    else:
        name = args.model_shape or "qwen2.5-0.5b"
        shape = SHAPES[name]
    return Inputs(
        memory_mib=int(memory),
        gpus=_gpu_count(args.gpus, prof, gpus),
        shape=shape,
        prompt_length=args.prompt_length,
        response_length=args.response_length,
        compute_dtype=prof["compute_dtype"],
        rollout=prof["rollout"],
        device=device,
        ref=args.ref,
        headroom_mib=args.headroom_mib,
        target_train_batch=args.target_train_batch,
        max_offload=args.max_offload,
        ppo_mini_batches=args.ppo_mini_batches,
        model_name=name,
        profile_name=prof["name"],
        **verl_release.plan_fields(version),
        **recipe,
    )


def run(args: argparse.Namespace) -> Result:
    inp = inputs_from_args(args)
    if args.largest:
        family = args.family or DEFAULT_FAMILY
        result = largest(inp, family)
        if result.best is None:
            name, _ = result.tried[0]
            smallest = replace(inp, shape=SHAPES[name], model_name=name)
            raise EngineError(
                "plan-does-not-fit",
                f"no {family} shape fits. The smallest: {does_not_fit(smallest)}",
            )
        doc = largest_payload(result)
        return Result(payload=doc, text=largest_text(doc))
    doc = payload(plan(inp))
    return Result(payload=doc, text=text(doc))


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> None:
    summary = "batch sizes, micro batches, checkpointing and offload that fit the GPU"
    doc = sys.modules[__package__].__doc__
    parser = subcommand.add(subparsers, common, "plan", run, doc, help=summary)
    mem = parser.add_argument_group("memory")
    mem.add_argument("--gpu-mib", type=int, metavar="N", help="one GPU's memory (default: detect)")
    mem.add_argument("--host-mib", type=int, metavar="N", help="host memory budget (cpu profile)")
    mem.add_argument(
        "--gpus",
        default="all",
        metavar="N",
        help="GPUs per node: N, or all (default, as a job's gpus: the detected cards of the "
        "profile; 1 when none is detected)",
    )
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
    # A job's defaults (plan/recipes.py holds both).
    parser.add_argument(
        "--prompt-length",
        type=int,
        default=recipes.DEFAULT_PROMPT_LENGTH,
        metavar="N",
        help=f"data.max_prompt_length (default {recipes.DEFAULT_PROMPT_LENGTH}, as a job's)",
    )
    parser.add_argument(
        "--response-length",
        type=int,
        default=recipes.DEFAULT_RESPONSE_LENGTH,
        metavar="N",
        help=f"data.max_response_length (default {recipes.DEFAULT_RESPONSE_LENGTH})",
    )
    parser.add_argument(
        "--verl-version",
        metavar="V",
        help="the verl release the job runs, as a job's verl_version: "
        f"{', '.join(verl_release.releases())} (default {verl_release.default()})",
    )
    prof = parser.add_mutually_exclusive_group()
    prof.add_argument("--profile", metavar="NAME", help="a profile name: pascal, pascal-6.1, cpu")
    prof.add_argument("--arch", choices=sorted(profile.PROFILES))
    prof.add_argument("--cc", metavar="X.Y")
    parser.add_argument(
        "--critic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a critic (default: on, or what --algorithm needs: GAE one, GRPO none)",
    )
    parser.add_argument(
        "--ref",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a reference model (KL loss or KL in reward)",
    )
    recipe = parser.add_argument_group("recipe")
    recipe.add_argument(
        "--algorithm",
        metavar="NAME",
        help="verl's algorithm.adv_estimator, as a job's algorithm: "
        + ", ".join(recipes.ALGORITHMS),
    )
    recipe.add_argument(
        "--rollout-n",
        type=int,
        default=recipes.DEFAULT_ROLLOUT_N,
        metavar="N",
        help=f"responses per prompt (default {recipes.DEFAULT_ROLLOUT_N}; "
        + ", ".join(a.name for a in recipes.ALGORITHMS.values() if a.min_rollout_n > 1)
        + ": at least 2)",
    )
    recipe.add_argument(
        "--lora-rank", type=int, default=0, metavar="R", help="LoRA on the actor (0: off)"
    )
    recipe.add_argument(
        "--lora-alpha", type=int, default=0, metavar="A", help="LoRA alpha (0: twice the rank)"
    )
    recipe.add_argument(
        "--base-dtype",
        choices=recipes.BASE_DTYPES,
        default=recipes.DEFAULT_BASE_DTYPE,
        help="how LoRA stores the frozen base: computed in fp32 either way (default auto: "
        "fp32 if it fits, else bf16)",
    )
    recipe.add_argument(
        "--lora-target-modules",
        metavar="LIST",
        help=f"{recipes.ALL_LINEAR} (default) or names, comma-separated: q_proj,v_proj",
    )
    query = parser.add_argument_group("query")
    query.add_argument(
        "--largest",
        action="store_true",
        help="the largest built-in shape of --family that fits this card and recipe",
    )
    query.add_argument(
        "--family",
        metavar="NAME",
        help=f"with --largest: {', '.join(FAMILIES)} (default {DEFAULT_FAMILY})",
    )
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
