"""One request's stream from the replicas to its caller: token events in, text deltas out.

:class:`Relay` keeps what the caller has been sent (the generated tokens, the detokenizer, the text held back
because it could still become a stop string), so the stream can continue from another replica after its replica
failed: the new replica gets the prompt plus :attr:`Relay.generated` and its events are relayed as if nothing
had happened — the caller sees one stream, no token twice or missing.
"""

from __future__ import annotations

from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import TextStream
from deepinfer.v1 import common_pb2, generation_pb2, scheduler_pb2

UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED


class Relay:
    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, tokenizer: object,
        images: list[bytes] = (),
    ) -> None:  # fmt: skip
        self.request_id, self.prompt_ids, self.images = request_id, prompt_ids, list(images)
        self.num_prompt_tokens = len(prompt_ids)
        self.text = TextStream(tokenizer, params)
        self.generated: list[int] = []  # token ids sent (they continue on another replica after a failure)
        self.started = False  # the first response (prompt tokens and prompt logprobs) was sent
        self.prompt_rows: list[scheduler_pb2.PromptLogprobEntry] = []
        self.hints: list[int] = []  # prompt positions worth a resume point (a chat's turn ends)
        # speculative decoding: drafts verified and accepted on the current replica so far (its events' counts), and
        # on the replicas before it (a moved request)
        self.drafts, self.drafts_before = (0, 0), (0, 0)
        # disaggregation: the prompt tokens the prefill replica's cache served, and its tier (the usage reports them:
        # the decode replica resumes from the exported state, which is not a prefix-cache hit)
        self.prefill_cached: tuple[int, str] | None = None

    def response(self, ev: scheduler_pb2.TokenEvent) -> generation_pb2.GenerateResponse | None:
        """The caller's message for one replica event (None: nothing to send yet). A message with ``finished``
        set is the last one."""
        if not self.started:
            self.prompt_rows.extend(ev.prompt_logprobs)  # a chunked prefill scores the prompt over several steps
            if not ev.token_ids and ev.finish_reason == UNSPECIFIED:
                return None  # the first message waits for the first token and carries the whole prompt's rows
        if ev.prompt_tokens:  # the replica's count: with images, after their placeholders are expanded
            self.num_prompt_tokens = ev.prompt_tokens
        out = generation_pb2.GenerateResponse(request_id=self.request_id)
        if not self.started:
            out.prompt_tokens = self.num_prompt_tokens
            if self.prompt_rows:
                out.prompt_logprobs.add()
                for row in self.prompt_rows:
                    out.prompt_logprobs.add().entries.extend(row.entries)
            self.started = True
        if ev.draft_tokens:
            self.drafts = (ev.draft_tokens, ev.accepted_draft_tokens)
        stop, last = None, len(ev.token_ids) - 1
        for k, t in enumerate(ev.token_ids):
            self.generated.append(t)
            out.token_ids.append(t)
            if k < len(ev.logprobs):
                out.logprobs.append(ev.logprobs[k])
            # the replica ends a request with STOP only for EOS or a stop token: that token's text is not checked
            stop = self.text.add(t, ends=k == last and ev.finish_reason == common_pb2.FINISH_REASON_STOP)
            if stop is not None:  # a stop string: the tokens after it are neither sent nor counted
                break
        done = stop is not None or ev.finish_reason != UNSPECIFIED
        out.text = self.text.delta(done)
        if done:
            self._finish(out.finished, ev, stop)
        return out

    def _finish(self, f: generation_pb2.Finished, ev: scheduler_pb2.TokenEvent, stop: str | None) -> None:
        if stop is not None:
            f.reason, f.stop_string = common_pb2.FINISH_REASON_STOP, stop
        else:
            f.reason = ev.finish_reason
            if ev.stop_token_id and ev.finish_reason == common_pb2.FINISH_REASON_STOP:
                f.stop_token_id = ev.stop_token_id
        n_in, n_out = self.num_prompt_tokens, len(self.generated)
        f.usage.prompt_tokens, f.usage.completion_tokens, f.usage.total_tokens = n_in, n_out, n_in + n_out
        cached, tier = self.prefill_cached if self.prefill_cached is not None else (ev.cached_tokens, ev.cached_tier)
        f.usage.cached_tokens = cached
        if cached and tier:
            f.usage.cached_tokens_by_tier[tier] = cached
        f.usage.draft_tokens = self.drafts_before[0] + self.drafts[0]
        f.usage.accepted_draft_tokens = self.drafts_before[1] + self.drafts[1]

    def resume_hints(self, shared: bool) -> list[int]:
        """Where the replica keeps resume points (positions of the prompt as sent, before any image expands):
        the turn ends and, ``shared`` (the first sample of ``n``), one token short of the prompt's end."""
        n = len(self.prompt_ids)
        return sorted({*self.hints, n - 1} if shared and n > 1 else set(self.hints))

    def submit(
        self, request: generation_pb2.GenerateRequest, constraint: common_pb2.Constraint | None, attempt: int,
        shared: bool = False, hand_off: bool = False, resume_position: int = 0,
    ) -> scheduler_pb2.SubmitRequest:  # fmt: skip
        """The replica's request: on a move (``attempt`` > 0) with the tokens sent so far, under a fresh id, and
        without prompt logprobs (the caller has them). ``shared``: more requests for this prompt follow, so the
        replica keeps a resume point one token short of the prompt's end (the first sample of ``n``).
        Disaggregation: ``hand_off`` to a prefill replica, ``resume_position`` (its export) to a decode replica."""
        if attempt:  # the lost replica's drafts count; the next one reports its own from 0
            self.drafts_before = (self.drafts_before[0] + self.drafts[0], self.drafts_before[1] + self.drafts[1])
            self.drafts = (0, 0)
        if attempt and not self.started:
            self.prompt_rows = []  # the failed replica's partial rows: the new one scores the prompt again
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        if attempt and self.started:
            sampling.ClearField("prompt_logprobs")
        return scheduler_pb2.SubmitRequest(
            request_id=self.request_id if not attempt else f"{self.request_id}.{attempt}",
            prompt_token_ids=self.prompt_ids,
            sampling=sampling,
            cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
            constraint=constraint,
            output_token_ids=self.generated if attempt else (),
            images=self.images,
            resume_hints=self.resume_hints(shared and not attempt),
            hand_off=hand_off,
            resume_position=resume_position,
        )
