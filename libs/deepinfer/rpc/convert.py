"""Conversions between the wire messages of ``deepinfer.v1`` and the engine's own types.

Invalid wire values surface as the same ValueError (naming the field) that the engine raises, so a
servicer can map them to INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from deepinfer.engine.constraint import Constraint
from deepinfer.engine.determinism import Determinism
from deepinfer.engine.interfaces import (
    ChunkPlan,
    ExportResult,
    FetchOrder,
    FetchResult,
    OffloadOrder,
    RankedPlan,
    SeqResult,
    SnapshotOrder,
    StepResult,
    WorkerStepPlan,
)
from deepinfer.grammar import grammar_from_proto, grammar_to_proto
from deepinfer.sampling_params import SamplingParams
from deepinfer.v1 import common_pb2, worker_pb2

_SCHEMA_TYPES = {
    common_pb2.StructuredOutput.SCHEMA_TYPE_REGEX: "regex",
    common_pb2.StructuredOutput.SCHEMA_TYPE_JSON_SCHEMA: "json_schema",
    common_pb2.StructuredOutput.SCHEMA_TYPE_JSON_OBJECT: "json_object",
    common_pb2.StructuredOutput.SCHEMA_TYPE_EBNF: "ebnf",
    common_pb2.StructuredOutput.SCHEMA_TYPE_STRUCTURAL_TAG: "structural_tag",
}


def _schema_enum(name: str) -> int:
    if name == "json":
        name = "json_schema"
    for k, v in _SCHEMA_TYPES.items():
        if v == name:
            return k
    raise ValueError(f"so_args.schema_type {name!r} has no wire form")


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Engine parameters from the wire (unset optional fields keep the engine's defaults)."""
    kw: dict = {}
    for name in ("temperature", "top_p", "max_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens"):
        if p.HasField(name):
            kw[name] = getattr(p, name)
    if p.HasField("seed"):
        kw["seed"] = p.seed
    so = p.structured_output
    if so.schema_type == common_pb2.StructuredOutput.SCHEMA_TYPE_UNSPECIFIED and so.schema:
        raise ValueError("so_args.schema is given without a schema_type")
    if so.schema_type != common_pb2.StructuredOutput.SCHEMA_TYPE_UNSPECIFIED:
        kind = _SCHEMA_TYPES.get(so.schema_type)
        if kind is None:
            raise ValueError(f"so_args.schema_type: unknown enum value {so.schema_type}")
        kw["so_args"] = {"schema_type": kind} | ({"schema": so.schema} if so.schema else {})
    return SamplingParams(
        top_k=p.top_k,
        min_p=p.min_p,
        min_tokens=p.min_tokens,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids) or None,
        ignore_eos=p.ignore_eos,
        include_stop_str_in_output=p.include_stop_str_in_output,
        **kw,
    )


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        min_tokens=s.min_tokens,
        stop=s.stop,
        stop_token_ids=s.stop_token_ids,
        ignore_eos=s.ignore_eos,
        skip_special_tokens=s.skip_special_tokens,
        include_stop_str_in_output=s.include_stop_str_in_output,
    )
    if s.max_tokens is not None:
        p.max_tokens = s.max_tokens
    if s.effective_seed is not None:
        p.seed = s.effective_seed
    if s.logprobs is not None:
        p.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        p.prompt_logprobs = s.prompt_logprobs
    if s.so_args:
        p.structured_output.CopyFrom(structured_output_to_proto(s.so_args))
    return p


def structured_output_to_proto(so_args: dict) -> common_pb2.StructuredOutput:
    """The wire form of a validated ``so_args`` (a schema object travels as its JSON text)."""
    schema = so_args.get("schema") or ""
    return common_pb2.StructuredOutput(
        schema_type=_schema_enum(so_args["schema_type"]),
        schema=schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False),
    )


def constraint_to_proto(c: Constraint) -> common_pb2.Constraint:
    msg = common_pb2.Constraint(
        banned_token_ids=c.banned_token_ids,
        after_think=c.after_think,
        reasoning_banned_token_ids=c.reasoning_banned_token_ids,
    )
    if c.grammar is not None:
        msg.grammar.CopyFrom(grammar_to_proto(c.grammar))
    return msg


def constraint_from_proto(msg: common_pb2.Constraint) -> Constraint:
    grammar = None
    if msg.HasField("grammar"):
        if not msg.grammar.compiled_json:
            raise ValueError("constraint.grammar.compiled_json: required")
        grammar = grammar_from_proto(msg.grammar)
    return Constraint(grammar, tuple(msg.banned_token_ids), msg.after_think, tuple(msg.reasoning_banned_token_ids))


def plan_to_proto(plan: WorkerStepPlan, sent_params: set[str]) -> worker_pb2.StepPlan:
    """Wire form of a step; sampling parameters travel with a request's first chunk only
    (``sent_params`` tracks which requests the worker already knows and is updated here). A ``RankedPlan``: each
    rank's plan in ``ranks`` (a request lives on one rank, so one ``sent_params`` serves them all)."""
    if isinstance(plan, RankedPlan):
        return worker_pb2.StepPlan(step_id=plan.step_id, ranks=[plan_to_proto(p, sent_params) for p in plan.ranks])
    msg = worker_pb2.StepPlan(step_id=plan.step_id, released=plan.released, dropped_snapshots=plan.dropped_snapshots)
    for o in plan.snapshots:
        msg.snapshots.add(request_id=o.request_id, snapshot_id=o.snapshot_id, position=o.position)
    for o in plan.offloads:
        msg.offloads.add(snapshot_id=o.snapshot_id, key=o.key, pages=o.pages, meta=o.meta, export=o.export)
    for f in plan.fetches:
        msg.fetches.add(fetch_id=f.fetch_id, key=f.key)
    for rid in plan.released:
        sent_params.discard(rid)
    for c in plan.chunks:  # (the optional fields only where set: a decode row has none of them)
        chunk = msg.chunks.add(
            request_id=c.request_id, token_ids=c.token_ids, start=c.start, block_table=c.block_table, sample=c.sample
        )
        if c.logprob_targets:
            chunk.logprob_targets.extend(c.logprob_targets)
        if c.resume_from:
            chunk.resume_from = c.resume_from
        if c.num_drafts:
            chunk.num_drafts = c.num_drafts
        if c.decoder_from is not None:
            chunk.decoder_from = c.decoder_from
        if c.mm is not None:
            chunk.images = True  # the features stay on the worker (Worker.PrepareImages)
        if c.constraint is not None:
            chunk.constraint.CopyFrom(constraint_to_proto(c.constraint))
            chunk.constraint_history.extend(c.constraint_history or [])
        if c.request_id not in sent_params:
            chunk.params.CopyFrom(sampling_to_proto(c.params))
            chunk.trace_context.update(c.trace_context or {})
            sent_params.add(c.request_id)
    return msg


def plan_from_proto(
    msg: worker_pb2.StepPlan, known: dict[str, SamplingParams], images: Mapping[str, Any] | None = None
) -> WorkerStepPlan:
    """Engine form of a step; ``known`` holds the parameters of the requests seen so far, ``images`` the images
    the worker prepared (``multimodal.MultiModalInput`` by request id), which a chunk flagged ``images`` takes.
    A plan with ``ranks``: a ``RankedPlan`` of them (its own fields must then be empty)."""
    if msg.ranks:
        if msg.chunks or msg.released or msg.snapshots or msg.dropped_snapshots or msg.offloads or msg.fetches:
            raise ValueError("ranks: a plan of ranks carries its chunks and orders in ranks only")
        plans = [plan_from_proto(p, known, images) for p in msg.ranks]
        if any(p.step_id != msg.step_id for p in plans):
            raise ValueError(f"ranks: every rank's plan must be step {msg.step_id}")
        return RankedPlan.of(plans)
    for rid in msg.released:
        known.pop(rid, None)
    chunks = []
    for c in msg.chunks:
        if c.HasField("params"):
            known[c.request_id] = sampling_from_proto(c.params)
        if c.request_id not in known:
            raise ValueError(f"chunks.params: first chunk of request {c.request_id!r} carries no parameters")
        if (
            not (c.logprob_targets or c.trace_context or c.resume_from or c.images)
            and not c.HasField("constraint")
            and not c.HasField("decoder_from")
        ):  # (a decode row, as most are: the fields it has)
            chunks.append(ChunkPlan(c.request_id, list(c.token_ids), c.start, list(c.block_table), c.sample,
                                    known[c.request_id], num_drafts=c.num_drafts))  # fmt: skip
            continue
        chunks.append(
            ChunkPlan(
                request_id=c.request_id,
                token_ids=list(c.token_ids),
                start=c.start,
                block_table=list(c.block_table),
                sample=c.sample,
                params=known[c.request_id],
                logprob_targets=list(c.logprob_targets) or None,
                trace_context=dict(c.trace_context) or None,
                resume_from=c.resume_from or None,
                constraint=constraint_from_proto(c.constraint) if c.HasField("constraint") else None,
                constraint_history=list(c.constraint_history) if c.HasField("constraint") else None,
                decoder_from=c.decoder_from if c.HasField("decoder_from") else None,
                mm=_prepared(images, c.request_id) if c.images else None,
                num_drafts=c.num_drafts,
            )
        )
    snapshots = [SnapshotOrder(o.request_id, o.snapshot_id, o.position) for o in msg.snapshots]
    offloads = [OffloadOrder(o.snapshot_id, o.key, list(o.pages), dict(o.meta), o.export) for o in msg.offloads]
    fetches = [FetchOrder(f.fetch_id, f.key) for f in msg.fetches]
    return WorkerStepPlan(
        msg.step_id, chunks, list(msg.released), snapshots, list(msg.dropped_snapshots), offloads, fetches
    )


def _prepared(images: Mapping[str, Any] | None, request_id: str) -> Any:
    mm = None if images is None else images.get(request_id)
    if mm is None:
        raise ValueError(f"chunks.images: no images were prepared for request {request_id!r} (PrepareImages)")
    return mm


def result_to_proto(result: StepResult) -> worker_pb2.StepResult:
    msg = worker_pb2.StepResult(step_id=result.step_id, graph_captures=result.graph_captures)
    for f in result.fetched:
        msg.fetched.add(fetch_id=f.fetch_id, ok=f.ok, reason=f.reason)
    for e in result.exported:
        msg.exported.add(snapshot_id=e.snapshot_id, ok=e.ok, reason=e.reason)
    for r in result.results:
        out = msg.results.add(request_id=r.request_id, error=r.error or "", num_drafts=r.num_drafts)
        if r.token_id is not None:
            out.token_id = r.token_id
            _logprob_to_proto(out.logprob, r.token_id, r.logprob, r.top_logprobs)
            out.extra_token_ids.extend(r.extra_token_ids)
            for i, t in enumerate(r.extra_token_ids):
                lp = r.extra_logprobs[i] if i < len(r.extra_logprobs) else None
                top = r.extra_top_logprobs[i] if i < len(r.extra_top_logprobs) else None
                _logprob_to_proto(out.extra_logprobs.add(), t, lp, top)
        for row in r.prompt_logprobs or []:
            out.prompt_logprobs.add().entries.extend(
                common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in row.items()
            )
    return msg


def _logprob_to_proto(
    out: common_pb2.TokenLogprob, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None
) -> None:
    out.token_id = token_id
    out.logprob = logprob if logprob is not None else 0.0
    for t, lp in top or []:
        out.top.add(token_id=t, logprob=lp)


def result_from_proto(msg: worker_pb2.StepResult) -> StepResult:
    results = []
    for r in msg.results:
        has_token = r.HasField("token_id")
        if has_token and not (r.extra_token_ids or r.prompt_logprobs or r.error or r.logprob.top):  # a plain row
            results.append(SeqResult(r.request_id, r.token_id, r.logprob.logprob, num_drafts=r.num_drafts))
            continue
        results.append(
            SeqResult(
                request_id=r.request_id,
                token_id=r.token_id if has_token else None,
                logprob=r.logprob.logprob if has_token else None,
                top_logprobs=[(t.token_id, t.logprob) for t in r.logprob.top] or None,
                prompt_logprobs=[{e.token_id: e.logprob for e in row.entries} for row in r.prompt_logprobs] or None,
                error=r.error or None,
                extra_token_ids=list(r.extra_token_ids),
                extra_logprobs=[e.logprob for e in r.extra_logprobs],
                extra_top_logprobs=[[(t.token_id, t.logprob) for t in e.top] or None for e in r.extra_logprobs],
                num_drafts=r.num_drafts,
            )
        )
    fetched = [FetchResult(f.fetch_id, f.ok, f.reason) for f in msg.fetched]
    exported = [ExportResult(e.snapshot_id, e.ok, e.reason) for e in msg.exported]
    return StepResult(step_id=msg.step_id, results=results, fetched=fetched, exported=exported,
                      graph_captures=msg.graph_captures)  # fmt: skip


def determinism_to_proto(d: Determinism) -> common_pb2.Determinism:
    return common_pb2.Determinism(
        batch_invariant=d.batch_invariant,
        deterministic_sampling=d.deterministic_sampling,
        covers=d.covers,
        requires=d.requires,
    )


def determinism_from_proto(p: common_pb2.Determinism) -> Determinism:
    return Determinism(p.batch_invariant, p.deterministic_sampling, list(p.covers), dict(p.requires))
