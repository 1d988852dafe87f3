"""The logits patch set for verl 0.9.0, every profile: the model engine computes the
logits of the response only, and their log-probs and entropy 256 tokens at a time.

verl 0.9.0's padded path (``use_remove_padding=False``, the one a card without
flash-attn takes) pads a micro batch's sequences on the right, asks the model for the
logits of every position, copies all of them into one packed tensor and computes
log-probs (and the entropy) over every token, prompt included, of which its callers
read the response's (``no_padding_2_padding``). On a P40 that is fp32 lm_head FLOPs and
several micro x sequence x vocab copies for nothing; they cap the micro batch. The cure
is 0.5.0's (verl_0_5_0/logits.py), at the engine's two calls in
``FSDPEngineWithLMHead.forward_step``:

- ``response-logits``: ``self.prepare_model_inputs(micro_batch=micro_batch)`` is handed
  to ``oldgpu_compat.response_inputs(self, micro_batch, ...)``, which lays the rows out
  with the prompts left-padded (the responses in the same columns) and asks for the last
  max-response positions (HF's ``logits_to_keep``); ``self.prepare_model_outputs(...)``
  -> ``oldgpu_compat.response_outputs(self, ...)``: the log-probs and entropy of those
  positions 256 tokens at a time (``logprobs_by_rows``, ``entropy_by_rows``), placed
  where verl's own output has them.

The helpers live in ``runtime/compat_logits.py``; they leave verl's own code to run for
remove-padding, fused kernels, distillation, ``calculate_sum_pi_squared``, multi-modal
inputs, the value head (which inherits ``forward_step``), a model without
``logits_to_keep``, and when ``OLDGPU_RESPONSE_LOGITS=off`` (the bench's baseline).
"""

from __future__ import annotations

import ast

from oldgpu.patch.compat_module import COMPAT_ALIAS
from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import Change, Patch, Site, SiteNotFound, VerifyFailed
from oldgpu.patch.source import Edit, SourceFile, dotted
from oldgpu.patch.verl_0_9_0.base import FSDP_ENGINE, VERSIONS


class EngineResponseLogits(Patch):
    name = "response-logits"
    description = (
        "the model engine's padded path computes the logits of the response only "
        "(prompts left-padded, logits_to_keep) and their log-probs and entropy 256 tokens "
        "at a time, with the softmax recomputed in the backward"
    )
    versions = VERSIONS
    files = (FSDP_ENGINE,)
    scope = "FSDPEngineWithLMHead.forward_step"
    INPUTS = "self.prepare_model_inputs"
    OUTPUTS = "self.prepare_model_outputs"
    OUR_INPUTS = f"{COMPAT_ALIAS}.response_inputs"
    OUR_OUTPUTS = f"{COMPAT_ALIAS}.response_outputs"

    def _calls(self, src: SourceFile, name: str) -> list[ast.Call]:
        return [c for c in src.in_scope(self.scope, ast.Call) if dotted(c.func) == name]

    def _one(self, src: SourceFile, name: str, error: type[Exception]) -> ast.Call:
        calls = self._calls(src, name)
        if len(calls) != 1:
            raise error(f"{self.scope}: expected one `{name}(...)`, found {len(calls)}")
        return calls[0]

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        if not src.has_scope(self.scope):
            raise SiteNotFound(f"no {self.scope}")
        inputs = self._one(src, self.INPUTS, SiteNotFound)
        outputs = self._one(src, self.OUTPUTS, SiteNotFound)
        # `self.prepare_model_inputs(micro_batch=micro_batch)`: the micro batch it reads
        given = inputs.args + [k.value for k in inputs.keywords]
        if len(given) != 1 or [k.arg for k in inputs.keywords] not in ([], ["micro_batch"]):
            raise SiteNotFound(f"{self.scope}: `{self.INPUTS}` is not called with the micro batch")
        batch = src.text(given[0])
        # `self.prepare_model_outputs(output=..., ...)`: keywords only
        if outputs.args or not outputs.keywords:
            raise SiteNotFound(f"{self.scope}: `{self.OUTPUTS}` is not called with keywords")
        start, end = src.span(inputs)
        first = src.offset(outputs.keywords[0].lineno, outputs.keywords[0].col_offset)
        fstart, fend = src.span(outputs.func)
        wrap = f"{self.OUR_INPUTS}(self, {batch}, "
        return [
            Change(
                Site(src.rel, self.scope, inputs.lineno, f"{self.INPUTS}(...) -> {wrap}...)"),
                (Edit(start, start, wrap), Edit(end, end, ")")),
            ),
            Change(
                Site(src.rel, self.scope, outputs.lineno, f"{self.OUTPUTS} -> {self.OUR_OUTPUTS}"),
                (Edit(fstart, fend, self.OUR_OUTPUTS), Edit(first, first, "self, ")),
            ),
        ]

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        ours = self._one(src, self.OUR_INPUTS, VerifyFailed)
        inputs = self._one(src, self.INPUTS, VerifyFailed)
        if len(ours.args) != 3 or dotted(ours.args[0]) != "self" or ours.args[2] is not inputs:
            raise VerifyFailed(f"{self.scope}: `{self.INPUTS}` is not handed to {self.OUR_INPUTS}")
        outputs = self._one(src, self.OUR_OUTPUTS, VerifyFailed)
        if self._calls(src, self.OUTPUTS) or [dotted(a) for a in outputs.args] != ["self"]:
            raise VerifyFailed(f"{self.scope}: the outputs are not {self.OUR_OUTPUTS}'s")


PATCHES: tuple[Patch, ...] = (EngineResponseLogits(),)
