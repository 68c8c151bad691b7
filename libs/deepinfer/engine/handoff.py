"""Prefill/decode disaggregation, the scheduler's half (a mixin of :class:`~deepinfer.engine.scheduler.Scheduler`;
docs/routing.md has the whole design).

**On a prefill replica** (``hand_off``): the request runs until it has sampled its first token here (its
``handoff_at``-th output token), then ends with the reason ``"handoff"``. A finished request keeps a resume point
where its state ends: the prompt plus the tokens it was given, not the token it just sampled (that one was never fed
through the model). That resume point is exported to the kvstore (``OffloadOrder.export``: the worker keeps the
snapshot, so this replica's own cache still serves the prefix), and the request is reported done only once the worker
says the put completed (``StepResult.exported``), so the decode replica's fetch cannot run ahead of the put. Its
``handoff_position`` is then that position, or 0 when the export failed (the decode replica recomputes). The export
goes in a step of its own, which the worker answers once the put is done (up to ``engine.worker.EXPORT_WAIT_S``):
in a step with chunks, its completion would reach the scheduler only with that step's result, after the next prompt's
prefill. A request that ends at its first token for another reason (EOS, a stop token, ``max_tokens``) ends as usual.

**On a decode replica** (``resume_position``): the kvstore holds the state of the request's first ``P`` tokens.
The scheduler files that entry in its index of the kvstore, derived from the request's own tokens as a KV event's
would be, so the lookup at admission fetches it at once instead of waiting for the event to arrive over NATS. A
failed fetch recomputes, as every kvstore miss does: the same tokens, later.

**On a draining replica** (:meth:`hand_off_all`): every unfinished request hands off as soon as it can: a running one
after the token it has in flight (or its next one), a waiting one at once, without state; the balancer continues
each on another replica from what was exported. **Rebalancing** (:meth:`hand_off`): the requests the balancer names,
the same way.
"""

from __future__ import annotations

from deepinfer.engine.interfaces import ExportResult, OffloadOrder
from deepinfer.engine.prefix_cache import ResumePoint, page_hashes
from deepinfer.engine.prefix_scheduling import blob_binding
from deepinfer.engine.request import Request, Status
from deepinfer.kvstore.keys import anchor, key_tag

NOTHING = ""  # the ``exporting`` key of handoffs with nothing to export (reported with the next result)


class Handoffs:
    exporting: dict[str, list[tuple[Request, int]]]  # snapshot id -> the requests whose handoff waits for its export

    def _setup_handoff(self, req: Request, hand_off: bool, resume_position: int) -> None:
        """Mark a new request for a handoff after its first token here, or resume it from an exported state."""
        if (hand_off or resume_position) and self.remote is None:
            what = "hand_off" if hand_off else "resume_position"
            raise ValueError(f"{what}: this replica has no kvstore (DEEPINFER_KVSTORE_URL) or no prefix cache")
        if hand_off:
            if req.wants_prompt_logprobs or req.mm is not None:
                raise ValueError("hand_off: not with prompt_logprobs or images (they are served whole)")
            req.handoff_at = len(req.output_token_ids) + 1
        if resume_position:
            if not 0 < resume_position < req.num_tokens:
                raise ValueError(f"resume_position: {resume_position} is not inside the request's {req.num_tokens} "
                                 "tokens (at least one is left to compute)")  # fmt: skip
            req.resume_position = resume_position
            ps, fp = self.config.page_size, self.config.fingerprint
            tokens = req.cache_token_ids[:resume_position]
            full = resume_position // ps
            base = page_hashes(tokens, self._root(req), ps, full)[-1]
            key, _ = blob_binding(ResumePoint("", resume_position, base, tuple(tokens[full * ps :]), []), fp)
            self.add_remote(anchor(base), resume_position, key_tag(fp, key))

    def _handoff_due(self, req: Request, n_out: int) -> bool:
        """Whether a request with ``n_out`` output tokens (in flight included) hands off now."""
        return bool(req.handoff_at) and n_out >= req.handoff_at

    def _hand_off(self, req: Request) -> None:
        """End ``req`` (it sampled its first token here) and export the resume point its finish keeps; it is reported
        done with the export's completion (:meth:`_exports_done`)."""
        position = req.num_computed
        self.finish(req, "handoff")
        tokens = req.cache_token_ids[:position]
        rp = self.prefix.get(tokens, self._root(req)) if position > 0 and self.remote is not None else None
        if rp is None:  # no state, no kvstore, or evicted at once (the pool is that short): the next replica recomputes
            self.exporting.setdefault(NOTHING, []).append((req, 0))
            return
        key, meta = blob_binding(rp, self.config.fingerprint)
        if rp.snapshot_id not in self.exporting:
            self._offloads.append(OffloadOrder(rp.snapshot_id, key, list(rp.pages), meta, export=True))
        self.exporting.setdefault(rp.snapshot_id, []).append((req, position))

    def hand_off_all(self) -> None:
        """Hand off every unfinished request (module docstring: a draining replica)."""
        self._hand_off_now([*self.running, *self.waiting, *(r for r, _ in self.fetching.values())])

    def hand_off(self, request_ids: list[str]) -> list[str]:
        """Hand off these requests as a draining replica does its own (rebalancing: the balancer moves them to a
        less loaded replica); the ids of those that will (the unknown and finished ones are left out)."""
        reqs = [self.requests[r] for r in dict.fromkeys(request_ids) if r in self.requests]
        reqs = [r for r in reqs if not r.finished]
        self._hand_off_now(reqs)
        return [r.request_id for r in reqs]

    def _hand_off_now(self, reqs: list[Request]) -> None:
        """A running request after the token it has in flight (or its next one), any other at once, without state."""
        for req in reqs:
            if req.status is Status.RUNNING and req.num_computed:
                req.handoff_at = len(req.output_token_ids) + max(1, req.in_flight)
            else:
                self.finish(req, "handoff")
                self.exporting.setdefault(NOTHING, []).append((req, 0))

    def _exports_done(self, exported: list[ExportResult]) -> list[Request]:
        """The handed-off requests whose exports completed (or failed), and those with nothing to export: done now."""
        done = []
        for req, _ in self.exporting.pop(NOTHING, []):
            req.handoff_position = 0
            done.append(req)
        for e in exported:
            for req, position in self.exporting.pop(e.snapshot_id, []):
                req.handoff_position = position if e.ok else 0
                done.append(req)
        return done
