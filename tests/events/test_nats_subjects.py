"""Subject and bucket names, and the validation of the tokens that go into them."""

from __future__ import annotations

import pytest

from deepinfer.events import subjects


def test_names_live_under_the_deepinfer_prefix():
    assert subjects.load_subject("worker", "w-0") == "deepinfer.load.worker.w-0"
    assert subjects.kv_subject("kvstore", "r1") == "deepinfer.kv.kvstore.r1"
    assert subjects.experts_subject("r1") == "deepinfer.experts.r1"
    assert subjects.load_wildcard() == "deepinfer.load.>"
    assert subjects.load_wildcard("scheduler") == "deepinfer.load.scheduler.*"
    assert subjects.kv_wildcard() == "deepinfer.kv.>"
    assert subjects.kv_wildcard("kvstore") == "deepinfer.kv.kvstore.*"
    assert subjects.experts_wildcard() == "deepinfer.experts.*"
    assert subjects.REGISTRY_BUCKET == "deepinfer_registry"
    assert subjects.registry_key("kvstore", "kv_1") == "kvstore.kv_1"


def test_parsers_invert_the_builders():
    assert subjects.parse_load_subject(subjects.load_subject("grammar", "g=7")) == ("grammar", "g=7")
    assert subjects.parse_registry_key(subjects.registry_key("balancer", "b0")) == ("balancer", "b0")
    for bad in ["deepinfer.load.worker", "deepinfer.kv.worker.w0", "other.load.worker.w0"]:
        with pytest.raises(ValueError):
            subjects.parse_load_subject(bad)
    with pytest.raises(ValueError):
        subjects.parse_registry_key("nodot")


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "*", ">", "w*", "w>", "tab\t", "ü", "a/b", "x" * 129])
def test_bad_tokens_are_rejected(bad):
    builders = (lambda t: subjects.kv_subject("kvstore", t), subjects.experts_subject,
                lambda t: subjects.load_subject("worker", t))  # fmt: skip
    for build in builders:
        with pytest.raises(ValueError):
            build(bad)


def test_bad_kinds_are_rejected_with_the_allowed_ones():
    with pytest.raises(ValueError, match="balancer, scheduler, worker, kvstore, grammar"):
        subjects.load_subject("gateway", "g0")
    with pytest.raises(ValueError):
        subjects.registry_key("worker.x", "w0")
    with pytest.raises(ValueError, match="must be a string"):
        subjects.validate_token(3)  # type: ignore[arg-type]
