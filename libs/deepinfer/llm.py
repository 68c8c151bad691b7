"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))`` and ``.chat(messages)``.

Images (a model that takes them, docs/deepseek_v41.md ("Images")): a ``generate`` prompt dict may carry
``multi_modal_data={"image": ...}`` (one image per image placeholder token of its prompt, in order), a chat message
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` content parts; ``image_inputs`` says
which sources are accepted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from deepinfer import envs
from deepinfer.chat import encode_messages
from deepinfer.engine.data_parallel import DataParallelScheduler
from deepinfer.engine.engine import LLMEngine, RequestOutput
from deepinfer.engine.factory import build_scheduler
from deepinfer.engine.image_cache import FeatureCache
from deepinfer.engine.model_api import ImageEncoder
from deepinfer.engine.multimodal import MultiModalInput, prepare_images
from deepinfer.engine.structured import LocalConstraints
from deepinfer.image_inputs import chat_images, prompt_images
from deepinfer.parallel.launch import RankProcesses, start_worker
from deepinfer.parallel.layout import layout_of
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import load_tokenizer


class LLM:
    """One model in this process. ``model`` is a directory or a hub id (default: the env registry's)."""

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        num_pages: int | None = None,
        page_size: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        quant_sim: bool | None = None,
        accelerator: str | None = None,
        batch_invariant: bool | None = None,
        enable_prefix_caching: bool | None = None,
        async_scheduling: bool | None = None,
        allowed_local_media_path: str | Path | None = None,
        num_speculative_tokens: int | None = None,
        ep: int | None = None,
        dp_attention: int | None = None,
        tp: int | None = None,
        cp: int | None = None,
    ) -> None:
        """``ep`` (default ``DEEPINFER_EP``): the ranks of the worker (one process per device, this one rank 0:
        ``parallel``), the MoE layers' experts shared among them. ``tp`` (default ``DEEPINFER_TP``): ranks per
        tensor-parallel group, which run the same sequences with the attention's heads split among them (``ep``
        defaults to it). ``cp`` (default ``DEEPINFER_CP``): ranks per context-parallel group, which run the same
        sequences with each step's tokens split among them. ``dp_attention``: the groups, each attending over its own
        sequences (``ep / tp`` or ``ep / cp``)."""
        pick = {"ep": ep, "tp": tp, "cp": cp}
        ep, tp, cp = (getattr(envs, f"DEEPINFER_{k.upper()}") if v is None else v for k, v in pick.items())
        self.layout = layout = layout_of(ep, dp_attention, tp, cp)
        self._ranks: RankProcesses | None = None
        parts, self._ranks = start_worker(
            layout, accelerator, model=model, dtype=dtype, max_model_len=max_model_len, num_pages=num_pages,
            page_size=page_size, quant_sim=quant_sim, batch_invariant=batch_invariant,
            num_speculative_tokens=num_speculative_tokens,
        )  # fmt: skip
        self.determinism = parts.determinism  # what repeats, and what that depends on (docs/determinism.md)
        self.config, self.model_path, self.dtype, self.model = parts.config, parts.path, parts.dtype, parts.model
        self.tokenizer = load_tokenizer(parts.path)
        sched = build_scheduler(
            parts.config, parts.num_pages, parts.page_size, parts.max_model_len, max_num_seqs, max_num_batched_tokens,
            parts.fingerprint, enable_prefix_caching, parts.runner.remote is not None,
            parts.runner.spec.max_drafts if parts.runner.spec is not None else 0,
        )  # fmt: skip
        if async_scheduling is None:
            async_scheduling = envs.DEEPINFER_ASYNC_SCHEDULING
        if layout.dp > 1:  # one scheduler per data-parallel rank, rank 0 driving the others (docs/parallelism.md)
            sched = DataParallelScheduler(sched.config, parts.num_pages, layout.dp)
        self.engine = LLMEngine(sched, parts.runner, self.tokenizer, parts.config.vocab_size, async_scheduling)
        self.constraints = LocalConstraints(parts.path, self.tokenizer)
        self.family = parts.family
        # images may be read from files under this folder only (None: no local files)
        self.local_media = None if allowed_local_media_path is None else Path(allowed_local_media_path)
        self._image_encoder = None  # the family's built-in encoder, made on the first image

    def close(self) -> None:
        """Stop the other ranks of a worker of several (``ep``); nothing to do for one. Idempotent."""
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            ranks.close(self.engine.runner)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def image_encoder(self) -> ImageEncoder:
        """The encoder of this model's images (its own vision tower, behind a cache of features by image digest:
        ``DEEPINFER_IMAGE_FEATURE_CACHE_BYTES``); ValueError for a model without image input."""
        if self._image_encoder is None:
            encoder = self.family.image_encoder(self.model)
            self._image_encoder = FeatureCache(encoder, envs.DEEPINFER_IMAGE_FEATURE_CACHE_BYTES)
        return self._image_encoder

    def _encode(self, prompt: Any, where: str) -> tuple[list[int], str | None, MultiModalInput | None]:
        ids, text = self._tokenize(prompt)
        images = prompt_images(prompt, where, self.local_media)
        if images is None:
            return ids, text, None
        if self.layout.group > 1:  # (this process alone holds the features; its group's other ranks need them)
            raise ValueError(f"{where}: images are not served by a worker of tensor- or context-parallel groups")
        ids, mm = prepare_images(self.family, self.config, self.image_encoder(), ids, images)
        return ids, text, mm

    def _tokenize(self, prompt: Any) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False).ids, prompt
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple):
                raise ValueError("prompt_token_ids must be a list of ints")
            return list(ids), None
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        _tools: tuple[list[dict] | None, Any, str, bool] = (None, None, "chat", True),
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a dict with ``prompt`` or ``prompt_token_ids``, and optionally
        ``multi_modal_data={"image": [...]}`` and ``cache_salt``); outputs in input order.

        Every prompt is validated, and every ``so_args`` grammar compiled, before any is queued: a bad one
        raises ValueError and none runs."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if not isinstance(prompts, list | tuple):
            raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompts).__name__}")
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError("sampling_params: one per prompt, or a single one for all")
        encoded = [self._encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        for ids, _, _ in encoded:
            self._validate(ids)
        for p in plist:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be a SamplingParams, got {type(p).__name__}")
        constraints = [self.constraints.for_request(p.so_args, ids, *_tools) for (ids, *_), p in zip(encoded, plist)]
        order: dict[str, int] = {}
        try:
            for i, ((ids, text, mm), p, raw, c) in enumerate(zip(encoded, plist, prompts, constraints)):
                rid = self.engine.new_request_id()
                salt = raw.get("cache_salt") if isinstance(raw, dict) else None
                if salt is not None and not isinstance(salt, str):
                    raise ValueError(f"cache_salt must be a string, got {type(salt).__name__}")
                self.engine.add_request(rid, ids, p, prompt=text, cache_salt=salt, constraint=c, mm=mm)
                order[rid] = i
        except Exception:
            # a later prompt or params failed the engine's checks: withdraw the ones already queued
            self.engine.abort_request(list(order))
            raise
        return self._drain(order, use_tqdm)

    def reset_prefix_cache(self) -> None:
        """Evict every device resume point (their pages return to the pool; with a kvstore they move there)."""
        idle = not self.engine.has_unfinished_requests()
        if idle:
            self.engine.step()  # snapshots still to be taken are taken first (so they can move to a kvstore)
        self.engine.scheduler.reset_prefix_cache()
        if idle:
            self.engine.step()  # the drop / offload orders travel with a plan (else with the next step)

    def _validate(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt: empty prompt (at least one token is required)")
        limit = self.engine.scheduler.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt: {len(ids)} tokens, the model's limit is {limit} including generated tokens")

    def _drain(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        while any(r is None for r in results):
            if not self.engine.has_unfinished_requests():
                raise RuntimeError("engine went idle with requests unanswered")
            for out in self.engine.step():
                if out.request_id in order:
                    results[order[out.request_id]] = out
                    bar.update(1)
        while self.engine.has_unfinished_requests() and not self.engine.scheduler.has_unfinished():
            self.engine.step()  # a step launched ahead of the last tokens (async scheduling): collected, pages back
        bar.close()
        return [r for r in results if r is not None]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        thinking_mode: str = "chat",
        reasoning_effort: str | None = None,
        tools: list[dict] | None = None,
        use_tqdm: bool = False,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Apply DeepSeek-V4's chat encoding to each conversation, then generate. With ``tools``,
        ``tool_choice`` ("auto" by default, "none", "required" or ``{"type": "function", "function": {"name":
        …}}``) constrains the output so that tool calls are well-formed DSML whose arguments follow the
        tools' JSON schemas; ``deepinfer.chat.parse_completion`` turns the text (decoded with special
        tokens) into OpenAI-style tool calls; ``parallel_tool_calls=False`` allows one call at most. An
        ``image_url`` content part becomes the model's image placeholder in the text, its image goes with it."""
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for m in convs:
            m, images = self._chat_images(m)
            text = encode_messages(m, thinking_mode=thinking_mode, reasoning_effort=reasoning_effort, tools=tools)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        choice = tool_choice if tool_choice is not None else ("auto" if tools else None)
        return self.generate(
            prompts, sampling_params, use_tqdm=use_tqdm, _tools=(tools, choice, thinking_mode, parallel_tool_calls)
        )

    def _chat_images(self, messages: list[dict]) -> tuple[list[dict], list[bytes]]:
        if not isinstance(messages, list) or not any(
            isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages
        ):
            return messages, []
        image_id = getattr(self.config, "image_token_id", None)
        placeholder = None if image_id is None else self.tokenizer.id_to_token(image_id)
        out, images = chat_images(messages, placeholder or "", self.local_media)
        if images and not placeholder:
            self.image_encoder()  # refuses: the model takes no images
        return out, images
