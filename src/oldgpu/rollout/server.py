"""The Ray actor verl's agent loop calls: ``generate`` -> ``TokenOutput``.

It answers the calls verl 0.9.0 makes on a rollout server (read in
``llm_server.py``, ``replica.py``, ``checkpoint_engine/base.py`` and the vLLM/TRT-LLM
servers): ``generate`` from the agent loop; ``wake_up``/``sleep``/``clear_kv_cache``/
``release_kv_cache``/``resume_kv_cache``/``abort_all_requests``/``resume_generation``/
``start_profile``/``stop_profile`` through the replica; ``set_global_steps`` and the
weights from our adapter. There is no HTTP endpoint: nothing on verl's token-in-token-out
path needs one, and the address is only the load balancer's key.

Where it generates, in a colocated (hybrid) job (engine setting ``weights``):

- ``trainer`` (the default): in the replica's trainer worker, from the parameters it
  trains (``colocated.py``); this actor holds no model and never touches the device: it
  batches the requests and forwards each batch. Requests that arrive while it sleeps
  (the trainer's turn) wait for ``wake_up``, up to ``sleep_wait_s``.
- ``copy``: its own copy of the policy in the profile's compute dtype, which the adapter
  fills each step; ``sleep`` moves it to host memory while the trainer runs and
  ``wake_up(["weights"])`` brings it back before the weights are copied in.

HF keeps no KV cache between calls, so the ``kv_cache`` tags only empty the allocator's
cache.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import ray
import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import get_device_name, get_torch_device, get_visible_devices_keyword
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, TokenOutput
from verl.workers.rollout.utils import get_max_position_embeddings

from oldgpu.rollout import ROLLOUT_NAME, colocated
from oldgpu.rollout import settings as rollout_settings
from oldgpu.rollout.batching import DEFAULT_MAX_WAIT_S, DEFAULT_TIMEOUT_S, DEFAULT_WINDOW_S, Batcher
from oldgpu.rollout.hf_engine import PROCESSED, HFGenerator, load_model
from oldgpu.rollout.sampling import (
    ABORTED,
    Generated,
    Limits,
    Request,
    batch_tokens,
    make_request,
)

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

# How long a request waits for the trainer to hand the card back (a step's update).
DEFAULT_SLEEP_WAIT_S = 1800.0


class RolloutAsleep(RuntimeError):
    """A request waited for ``wake_up`` longer than ``sleep_wait_s``."""


def engine_settings(config: RolloutConfig) -> dict[str, Any]:
    """Our knobs (``settings.SETTINGS``), checked: a bad one is a named
    ``RolloutSettingInvalid`` here, never a bare ValueError inside the actor."""
    return rollout_settings.from_engine_kwargs(config.engine_kwargs)


def weights_mode(config: RolloutConfig) -> str:
    """Where the server generates from (``WEIGHTS_TRAINER`` or ``WEIGHTS_COPY``)."""
    return engine_settings(config).get("weights", rollout_settings.WEIGHTS_TRAINER)


def profile_dtype_and_attention() -> tuple[torch.dtype, str]:
    """The card's compute dtype and attention, as the patched verl tree's compat module
    says (``OLDGPU_COMPUTE_DTYPE``/``OLDGPU_ATTN_IMPLEMENTATION`` switch them); fp32 and
    sdpa, what every card runs, in an unpatched tree."""
    try:
        from verl.utils import oldgpu_compat  # type: ignore[attr-defined]
    except ImportError:
        return torch.float32, "sdpa"
    return oldgpu_compat.compute_dtype(), oldgpu_compat.attn_implementation()


def eos_token_ids(model_config: HFModelConfig) -> list[int]:
    """Where a response ends: the generation config's EOS ids (Qwen's list its chat end
    and its base EOS), the model's, and the tokenizer's."""
    found: list[int] = []
    sources = (
        getattr(model_config.generation_config, "eos_token_id", None),
        getattr(model_config.hf_config, "eos_token_id", None),
        getattr(model_config.tokenizer, "eos_token_id", None),
    )
    for ids in sources:
        for tok in ids if isinstance(ids, list | tuple) else [ids]:
            if tok is not None and int(tok) not in found:
                found.append(int(tok))
    if not found:
        raise ValueError(f"{model_config.path}: no EOS token id in its configs or tokenizer")
    return found


def pad_token_id(model_config: HFModelConfig, eos: list[int]) -> int:
    for source in (model_config.tokenizer, model_config.hf_config):
        tok = getattr(source, "pad_token_id", None)
        if tok is not None:
            return int(tok)
    return eos[0]


class HFRolloutServer:
    """One replica's server (wrapped with ``ray.remote`` by the replica)."""

    def __init__(
        self,
        config: RolloutConfig,
        model_config: Any,
        rollout_mode: RolloutMode,
        replica_rank: int,
        node_rank: int = 0,
        visible_devices: str | None = None,
        trainer: Any = None,
    ) -> None:
        # Before anything touches the device: the trainer worker's card, as vLLM's server
        # does (the replica starts us with Ray's NOSET variables, so Ray leaves it alone).
        if visible_devices:
            os.environ[get_visible_devices_keyword()] = visible_devices
        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(
            model_config, dataclass_type=HFModelConfig
        )
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.global_steps: int | None = None
        self.device = torch.device(get_device_name())  # the platform's: cuda, or cpu
        max_len = self.config.max_model_len or get_max_position_embeddings(
            self.model_config.hf_config
        )
        self.limits = Limits(
            prompt_length=self.config.prompt_length,
            response_length=self.config.response_length,
            max_model_len=int(max_len),
        )
        settings = engine_settings(self.config)
        # Rows at once: vLLM's own cap on running sequences (max_num_seqs) unless set.
        self.max_batch_size = settings.get("max_batch_size", int(self.config.max_num_seqs))
        # Tokens at once (rows x (prompt + response), padded): the planner sets it from its
        # memory model. Unset: every row the agent loop can send at full length, i.e. one
        # pass per rollout as 0.5.0's HF rollout, with the OOM split as the backstop.
        # (rollout.max_num_batched_tokens is vLLM's per-step scheduling budget, not its KV
        # cache: it would cap a batch at a few rows.)
        self.max_batch_tokens = settings.get(
            "max_batch_tokens",
            self.max_batch_size * (self.config.prompt_length + self.config.response_length),
        )
        self.window_s = settings.get("batch_window_ms", DEFAULT_WINDOW_S * 1000) / 1000
        self.max_wait_s = settings.get("batch_max_wait_ms", DEFAULT_MAX_WAIT_S * 1000) / 1000
        self.timeout_s = settings.get("request_timeout_s", DEFAULT_TIMEOUT_S)
        self.sleep_wait_s = settings.get("sleep_wait_s", DEFAULT_SLEEP_WAIT_S)
        # In the trainer's process: a colocated job's trainer worker, unless weights=copy.
        self.trainer = trainer
        self.in_trainer = rollout_mode == RolloutMode.HYBRID and (
            weights_mode(self.config) == rollout_settings.WEIGHTS_TRAINER
        )
        if self.in_trainer and trainer is None:
            raise rollout_settings.RolloutSettingInvalid(
                f"{ROLLOUT_NAME}: weights=trainer needs the replica's trainer worker"
            )
        self._woken = asyncio.Event()
        self._woken.set()
        self.generator: HFGenerator | None = None
        self.batcher: Batcher[Request, Generated] | None = None
        self._awake = True
        self._logged = (0, 0)  # requests and batches already logged
        self._address = (
            f"{ray.util.get_node_ip_address()}/{ROLLOUT_NAME}/{replica_rank}/{node_rank}"
        )

    # -- start -----------------------------------------------------------------------

    def _batcher(self, run: Any) -> Batcher[Request, Generated]:
        # The same batching wherever the batch runs (the trainer's process or our copy).
        return Batcher(
            run,
            lambda r: Generated(token_ids=[], stop_reason=ABORTED),
            max_batch_tokens=self.max_batch_tokens,
            cost=batch_tokens,
            max_rows=self.max_batch_size,
            window_s=self.window_s,
            max_wait_s=self.max_wait_s,
            timeout_s=self.timeout_s,
        )

    async def launch_server(self) -> None:
        """Load the model and open for requests (the replica awaits this)."""
        if self.in_trainer:
            self.batcher = self._batcher(self._run_in_trainer)
            logger.info(
                "%s server %d: generates in its trainer worker from the trainer's weights, "
                "batches of <= %d rows, %d tokens",
                ROLLOUT_NAME,
                self.replica_rank,
                self.max_batch_size,
                self.max_batch_tokens,
            )
            return
        dtype, attn = profile_dtype_and_attention()
        # Outside a colocated job nothing syncs weights before the first request.
        dummy = self.config.load_format == "dummy" and self.rollout_mode == RolloutMode.HYBRID
        model = load_model(
            local_path=self.model_config.local_path,
            hf_config=self.model_config.hf_config,
            dummy=dummy,
            dtype=dtype,
            attn_implementation=attn,
            device=self.device,
            trust_remote_code=self.model_config.trust_remote_code,
        )
        eos = eos_token_ids(self.model_config)
        self.generator = HFGenerator(
            model,
            pad_token_id=pad_token_id(self.model_config, eos),
            eos_token_ids=eos,
            device=self.device,
            logprobs_mode=self.config.logprobs_mode or PROCESSED,
            max_batch_tokens=self.max_batch_tokens,
        )
        self.batcher = self._batcher(self.generator.generate)
        logger.info(
            "%s server %d: %s, %s, %s attention, weights %s, batches of <= %d rows, %d tokens",
            ROLLOUT_NAME,
            self.replica_rank,
            self.device,
            dtype,
            attn,
            "dummy (first sync fills them)" if dummy else "from " + self.model_config.local_path,
            self.max_batch_size,
            self.max_batch_tokens,
        )

    def get_server_address(self) -> str:
        return self._address

    def _run_in_trainer(self, requests: Any, should_stop: Any) -> list[Generated]:
        # In the batcher's thread: the trainer worker generates; a running batch is not
        # stopped by abort (its queue is), the trainer's process has no flag of ours.
        ref = self.trainer.__ray_call__.remote(
            colocated.run_batch, self.replica_rank, list(requests)
        )
        return ray.get(ref)

    # -- generation --------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """Token ids in, token ids (and their log-probs when asked) out."""
        if image_data or video_data or audio_data:
            raise NotImplementedError(f"{ROLLOUT_NAME} serves text-only models")
        assert self.batcher is not None, "launch_server() first"
        if self.config.full_determinism:  # as vLLM's server: one seed per replica
            sampling_params = dict(sampling_params)
            sampling_params.setdefault("seed", self.replica_rank + self.config.seed)
        if not self._woken.is_set():
            # The trainer's turn: its weights are changing under it; wait for wake_up.
            try:
                await asyncio.wait_for(self._woken.wait(), self.sleep_wait_s)
            except TimeoutError:
                raise RolloutAsleep(
                    f"{ROLLOUT_NAME} server {self.replica_rank}: request {request_id} waited "
                    f"{self.sleep_wait_s:.0f} s (sleep_wait_s) for wake_up"
                ) from None
        request = make_request(
            prompt_ids,
            sampling_params,
            self.limits,
            request_id=request_id,
            default_repetition_penalty=self.config.repetition_penalty,
            default_ignore_eos=self.config.ignore_eos,
        )
        result = await self.batcher.submit(request)
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs if request.logprobs else None,
            stop_reason=result.stop_reason,
            extra_fields={"global_steps": self.global_steps},
        )

    async def abort_all_requests(self, reset_prefix_cache: bool = True) -> dict[str, Any]:
        assert self.batcher is not None
        queued = await self.batcher.abort()
        return {"aborted_count": queued, "request_ids": []}

    async def resume_generation(self) -> None:
        assert self.batcher is not None
        self.batcher.resume()

    async def wait_for_requests_to_drain(self) -> None:
        if self.batcher is not None:
            await self.batcher.drain()

    # -- memory ------------------------------------------------------------------------

    def _empty_cache(self) -> None:
        if self.device.type != "cpu" and not self.in_trainer:
            get_torch_device().empty_cache()

    async def sleep(self) -> None:
        """The trainer's turn: the weights go to host memory (colocated jobs only)."""
        if not self.config.free_cache_engine or self.rollout_mode != RolloutMode.HYBRID:
            return
        await self.wait_for_requests_to_drain()
        self._woken.clear()
        self._log_batching()
        if self.in_trainer:
            await self.trainer.__ray_call__.remote(colocated.release, self.replica_rank)
        if self.generator is not None and self.device.type != "cpu" and self._awake:
            self.generator.to("cpu")
            self._empty_cache()
        self._awake = False

    def _log_batching(self) -> None:
        # Once per rollout phase (the trainer sleeps us after each): how it batched.
        b = self.batcher
        if b is None:
            return
        done = (b.requests_run, b.batches_run)
        requests, batches = (d - s for d, s in zip(done, self._logged, strict=True))
        self._logged = done
        if batches:
            logger.info(
                "%s server %d: %d requests in %d batches (largest so far %d)",
                ROLLOUT_NAME,
                self.replica_rank,
                requests,
                batches,
                b.largest_batch,
            )

    async def wake_up(self, tags: list[str] | None = None) -> None:
        wants_weights = tags is None or "weights" in tags
        if tags is None or "kv_cache" in tags:
            # verl's last resume of a weight update (weights, sync, then kv_cache): from
            # here requests see the step's weights.
            self._woken.set()
        if self.generator is not None and not self._awake and wants_weights:
            self.generator.to(self.device)
            self._awake = True

    async def clear_kv_cache(self) -> None:
        self._empty_cache()

    async def release_kv_cache(self) -> None:
        self._empty_cache()

    async def resume_kv_cache(self) -> None:
        return None

    # -- weights -----------------------------------------------------------------------

    async def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """A bucket of (HF name, tensor) from the adapter; returns how many were copied."""
        assert self.generator is not None
        report = self.generator.load_weights(bucket)
        if report.unknown:
            raise KeyError(
                f"{ROLLOUT_NAME}: the trainer sent tensors the rollout's model does not have: "
                f"{report.unknown[:5]}{' ...' if len(report.unknown) > 5 else ''}"
            )
        return report.loaded

    async def end_weight_update(self, global_steps: int | None = None) -> list[str]:
        """After the last bucket: refuse a partial update (a dummy-loaded model would
        serve random weights where none arrived) and stamp the weights' version."""
        assert self.generator is not None
        missing = self.generator.end_weight_update()
        if missing:
            raise RuntimeError(
                f"{ROLLOUT_NAME}: the weight update left {len(missing)} parameter(s) "
                f"untouched, e.g. {missing[:5]}"
            )
        if global_steps is not None:
            self.global_steps = global_steps
        self._empty_cache()
        return missing

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # -- profiling: nothing of ours to profile beyond verl's own timers ------------------

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def stats(self) -> dict[str, Any]:
        """For tests and logs: how the requests were batched."""
        b = self.batcher
        return {
            "batches_run": b.batches_run if b else 0,
            "requests_run": b.requests_run if b else 0,
            "largest_batch": b.largest_batch if b else 0,
            "max_batch_size": self.max_batch_size,
            "max_batch_tokens": self.max_batch_tokens,
            "largest_batch_tokens": b.largest_batch_tokens if b else 0,
            "oom_splits": self.generator.oom_splits if self.generator else 0,
            "device": str(self.device),
            "in_trainer": self.in_trainer,
            "global_steps": self.global_steps,
        }
