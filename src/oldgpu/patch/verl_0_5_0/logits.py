"""The logits patch set for verl 0.5.0, every profile: the actor's and ref's logits of the
response only, and their log-probs and entropy 256 tokens at a time.

verl 0.5.0's padded path (the one a card without flash-attn takes: remove-padding needs
its helpers) asks the model for the logits of every position and keeps the response's;
on a P40 that is fp32 lm_head FLOPs over the prompt thrown away, and its three
micro x sequence x vocab copies in the update (the lm_head output, the slice's gradient
scattered back, the log-probs' gradient) are what cap the actor's micro batch. The fp16
path (verl_0_5_0/fp16.py) showed the cure; it is the same for every dtype:

- ``entropy-by-rows``: ``verl_F.entropy_from_logits`` (the log-prob phase's metric, and
  under ``entropy_checkpointing``) -> ``oldgpu_compat.entropy_by_rows``: the same
  formula in fp32, 256 tokens at a time over views of verl's response slice.
- ``response-logits``: the padded path's model call gets
  ``**oldgpu_compat.response_logits_only(self, response_length)`` (HF's
  ``logits_to_keep``: the last response + 1 positions, which verl's own slice then cuts
  to the response), and ``logprobs_from_logits(logits, ...)`` ->
  ``oldgpu_compat.logprobs_by_rows`` (256 tokens at a time, the softmax recomputed in
  the backward).

The helpers live in ``compat_logits.py``; they fall back to verl's own code where the
model's forward has no ``logits_to_keep``, under verl's fused kernels, and when
``OLDGPU_RESPONSE_LOGITS=off`` (the bench's baseline). The remove-padding path is
verl's own.
"""

from __future__ import annotations

import ast

from oldgpu.patch.compat_module import COMPAT_ALIAS
from oldgpu.patch.options import Options
from oldgpu.patch.sitepatch import Change, Patch, Site, SiteNotFound, VerifyFailed
from oldgpu.patch.source import Edit, SourceFile, dotted, is_call_to
from oldgpu.patch.verl_0_5_0.base import DP_ACTOR, VERSIONS


def _c(function: str) -> str:
    return f"{COMPAT_ALIAS}.{function}"


class EntropyByRows(Patch):
    name = "entropy-by-rows"
    description = (
        "the actor's entropy (a log-prob metric) is computed in fp32 256 tokens at a time, "
        "so its softmax, logsumexp and product are a chunk long, not a micro batch's"
    )
    versions = VERSIONS
    files = (DP_ACTOR,)
    scope = "DataParallelPPOActor._forward_micro_batch"
    VERL = "verl_F.entropy_from_logits"
    OURS = _c("entropy_by_rows")

    def _uses(self, src: SourceFile, name: str) -> list[ast.Attribute]:
        return [a for a in src.in_scope(self.scope, ast.Attribute) if dotted(a) == name]

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        # verl 0.5.0's padded path: `verl_F.entropy_from_logits(logits)`, and the same
        # function handed to torch.utils.checkpoint under entropy_checkpointing.
        uses = self._uses(src, self.VERL)
        if not uses:
            raise SiteNotFound(f"{self.scope}: no {self.VERL}")
        changes = []
        for use in uses:
            start, end = src.span(use)
            site = Site(src.rel, self.scope, use.lineno, f"{self.VERL} -> {self.OURS}")
            changes.append(Change(site, (Edit(start, end, self.OURS),)))
        return changes

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        if self._uses(src, self.VERL):
            raise VerifyFailed(f"{self.scope}: {self.VERL} is still used")
        if len(self._uses(src, self.OURS)) != len(changes):
            raise VerifyFailed(f"{self.scope}: {self.OURS} is not at every site")


class ResponseLogits(Patch):
    name = "response-logits"
    description = (
        "the actor's padded path computes the logits of the response only "
        "(logits_to_keep) and its log-probs 256 tokens at a time, with the softmax "
        "recomputed in the backward"
    )
    versions = VERSIONS
    files = (DP_ACTOR,)
    scope = "DataParallelPPOActor._forward_micro_batch"
    KEEP = _c("response_logits_only")
    VERL = "logprobs_from_logits"
    OURS = _c("logprobs_by_rows")

    def _model_calls(self, src: SourceFile) -> list[ast.Call]:
        """The padded path's ``self.actor_module(input_ids=input_ids,
        attention_mask=attention_mask, ...)`` (remove-padding passes attention_mask=None)."""
        return [
            c
            for c in src.in_scope(self.scope, ast.Call)
            if dotted(c.func) == "self.actor_module"
            and any(
                k.arg == "attention_mask" and dotted(k.value) == "attention_mask"
                for k in c.keywords
            )
        ]

    def _logprobs(self, src: SourceFile, name: str) -> list[ast.Call]:
        """``<name>(logits, ...)``: the padded path's (remove-padding passes keywords)."""
        return [
            c
            for c in src.in_scope(self.scope, ast.Call)
            if dotted(c.func) == name and c.args and dotted(c.args[0]) == "logits"
        ]

    def _keeps(self, call: ast.Call) -> list[ast.keyword]:
        return [
            k
            for k in call.keywords
            if k.arg is None and is_call_to(k.value, self.KEEP, "self", "response_length")
        ]

    def plan(self, src: SourceFile, options: Options) -> list[Change]:
        calls = self._model_calls(src)
        uses = self._logprobs(src, self.VERL)
        if len(calls) != 1 or len(uses) != 1:
            raise SiteNotFound(
                f"{self.scope}: expected one padded-path `self.actor_module(..., "
                f"attention_mask=attention_mask, ...)` and one `{self.VERL}(logits, ...)`, "
                f"found {len(calls)} and {len(uses)}"
            )
        call, use = calls[0], uses[0]
        last = (call.args + [k.value for k in call.keywords])[-1]
        _, end = src.span(last)
        keep = f"**{self.KEEP}(self, response_length)"
        start, stop = src.span(use.func)
        return [
            Change(
                Site(src.rel, self.scope, call.lineno, f"the model call gets {keep}"),
                (Edit(end, end, f", {keep}"),),
            ),
            Change(
                Site(src.rel, self.scope, use.lineno, f"{self.VERL}(logits, ...) -> {self.OURS}"),
                (Edit(start, stop, self.OURS),),
            ),
        ]

    def verify(self, src: SourceFile, options: Options, changes: list[Change]) -> None:
        calls = self._model_calls(src)
        if len(calls) != 1 or len(self._keeps(calls[0])) != 1:
            raise VerifyFailed(f"{self.scope}: the padded model call does not keep logits")
        if self._logprobs(src, self.VERL) or len(self._logprobs(src, self.OURS)) != 1:
            raise VerifyFailed(f"{self.scope}: the padded log-probs are not by rows")


PATCHES: tuple[Patch, ...] = (
    EntropyByRows(),
    ResponseLogits(),
)
