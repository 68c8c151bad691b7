"""Tests for deepinfer.envs: the single registry of DEEPINFER_* environment variables."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer import envs
from deepinfer.envs import EnvError, EnvVar, UnknownEnvWarning

REPO = Path(__file__).resolve().parents[2]
REGISTRY = envs.registry()


def _clean_subprocess_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "libs"), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no DEEPINFER_* (or OTLP endpoint) variable set, whatever the shell has."""
    for name in list(os.environ):
        if name.startswith("DEEPINFER_") or name == "OTEL_EXPORTER_OTLP_ENDPOINT":
            monkeypatch.delenv(name)


def _bad_values(var: EnvVar) -> list[str]:
    bad = ["", "   "]  # set but empty is always an error
    if var.kind == "bool":
        bad += ["maybe", "2", "-1", "ture", "y", "enabled"]
    elif var.kind == "enum":
        bad += ["bogus", var.choices[0] + "x", ",".join(var.choices)]
    elif var.kind == "int":
        bad += ["abc", "1.5", "1e3", "0x10", "8 8"]
        if var.minimum is not None:
            bad += [str(int(var.minimum) - 1), "-8"]
        if var.multiple_of:
            bad += [str(var.multiple_of * 12 + 1), "100"]
    elif var.kind == "path" and var.must_be_dir:
        bad += ["/definitely/not/a/dir/deepinfer"]
    return bad


BAD_CASES = [(name, bad) for name, var in REGISTRY.items() for bad in _bad_values(var)]


def test_registry_covers_the_required_variables():
    required = {
        "DEEPINFER_ACCELERATOR",
        "DEEPINFER_HF_MODEL_DIR",
        "DEEPINFER_MODEL",
        "DEEPINFER_BATCH_INVARIANT",
        "DEEPINFER_LOG_LEVEL",
        "DEEPINFER_LOG_FORMAT",
        "DEEPINFER_CACHE_DIR",
        "DEEPINFER_MAX_MODEL_LEN",
        "DEEPINFER_PAGE_SIZE",
        "DEEPINFER_NUM_PAGES",
        "DEEPINFER_MAX_NUM_SEQS",
        "DEEPINFER_MAX_NUM_BATCHED_TOKENS",
        "DEEPINFER_QUANT_SIM",
        "DEEPINFER_OTEL_ENDPOINT",
    }
    assert required <= set(REGISTRY)
    for name, var in REGISTRY.items():
        assert name.startswith("DEEPINFER_") and var.name == name
        assert len(var.doc) > 40, f"{name} needs a real doc paragraph"


@pytest.mark.parametrize(("name", "bad"), BAD_CASES, ids=[f"{n}={b!r}" for n, b in BAD_CASES])
def test_bad_value_is_an_error_naming_variable_value_and_allowed(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    allowed = REGISTRY[name].allowed()
    for call in (lambda: envs.get(name), envs.validate_all, lambda: getattr(envs, name)):
        with pytest.raises(EnvError) as info:
            call()
        message = str(info.value)
        assert isinstance(info.value, ValueError)
        assert name in message and repr(bad) in message and allowed in message


def test_validate_all_reports_every_bad_value_at_once(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PAGE_SIZE", "100")
    monkeypatch.setenv("DEEPINFER_QUANT_SIM", "perhaps")
    monkeypatch.setenv("DEEPINFER_LOG_FORMAT", "xml")
    with pytest.raises(EnvError) as info:
        envs.validate_all()
    assert len(info.value.problems) == 3
    for needle in (
        "DEEPINFER_PAGE_SIZE='100'",
        "DEEPINFER_QUANT_SIM='perhaps'",
        "DEEPINFER_LOG_FORMAT='xml'",
    ):
        assert needle in str(info.value)
    assert "multiple of 8" in str(info.value) and "json, console" in str(info.value)


def test_validate_all_accepts_a_mapping_and_good_values(tmp_path):
    good = {
        "DEEPINFER_ACCELERATOR": "Ascend",
        "DEEPINFER_HF_MODEL_DIR": str(tmp_path),
        "DEEPINFER_PAGE_SIZE": "64",
        "DEEPINFER_BATCH_INVARIANT": "YES",
        "DEEPINFER_OTEL_ENDPOINT": "http://localhost:4317",
        "HOME": "/root",
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        envs.validate_all(good)
    with pytest.raises(EnvError, match="DEEPINFER_PAGE_SIZE"):
        envs.validate_all({"DEEPINFER_PAGE_SIZE": "7"})


def test_validate_all_in_a_subprocess_exits_non_zero_and_names_the_variable():
    code = "from deepinfer import envs; envs.validate_all()"
    bad = subprocess.run(
        [sys.executable, "-c", code],
        env=_clean_subprocess_env(DEEPINFER_MAX_NUM_SEQS="lots"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "DEEPINFER_MAX_NUM_SEQS" in bad.stderr and "'lots'" in bad.stderr and "EnvError" in bad.stderr
    good = subprocess.run(
        [sys.executable, "-c", code],
        env=_clean_subprocess_env(DEEPINFER_MAX_NUM_SEQS="4"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert good.returncode == 0, good.stderr


def test_unknown_variable_warns_with_close_matches_but_is_not_an_error(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PAGESIZE", "64")
    monkeypatch.setenv("DEEPINFER_COMPLETELY_UNRELATED_THING", "1")
    with pytest.warns(UnknownEnvWarning) as record:
        envs.validate_all()
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert "DEEPINFER_PAGESIZE" in messages[1] and "did you mean DEEPINFER_PAGE_SIZE" in messages[1]
    assert "DEEPINFER_COMPLETELY_UNRELATED_THING" in messages[0]


def test_known_variables_produce_no_warning(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PAGE_SIZE", "64")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        envs.validate_all()


def test_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = {
        "DEEPINFER_HF_MODEL_DIR": None,
        "DEEPINFER_MODEL": "deepseek-ai/DeepSeek-V4.1-Flash-1017",
        "DEEPINFER_CACHE_DIR": tmp_path / ".cache" / "deepinfer",
        "DEEPINFER_MAX_MODEL_LEN": None,
        "DEEPINFER_PAGE_SIZE": 256,
        "DEEPINFER_NUM_PAGES": None,
        "DEEPINFER_MAX_NUM_SEQS": 256,
        "DEEPINFER_MAX_NUM_BATCHED_TOKENS": 8192,
        "DEEPINFER_BATCH_INVARIANT": False,
        "DEEPINFER_QUANT_SIM": False,
        "DEEPINFER_LOG_LEVEL": "info",
        "DEEPINFER_LOG_FORMAT": "json",
        "DEEPINFER_OTEL_ENDPOINT": None,
    }
    for name, value in expected.items():
        assert envs.get(name) == value, name
        assert getattr(envs, name) == value, name
    snapshot = envs.snapshot()
    assert set(snapshot) == set(REGISTRY)
    assert {k: snapshot[k] for k in expected} == expected


def test_accelerator_default_follows_torch_and_is_cpu_here(monkeypatch):
    import torch

    expected = "nvidia" if torch.cuda.is_available() else "cpu"
    assert envs.get("DEEPINFER_ACCELERATOR") == expected
    if not torch.cuda.is_available():  # the CPU test machine
        assert envs.DEEPINFER_ACCELERATOR == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert envs.get("DEEPINFER_ACCELERATOR") == "nvidia"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert envs.get("DEEPINFER_ACCELERATOR") == "cpu"
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", " ASCEND ")
    assert envs.get("DEEPINFER_ACCELERATOR") == "ascend"


def test_validate_all_does_not_import_torch():
    code = (
        "import sys, deepinfer; before = 'torch' in sys.modules; from deepinfer import envs;"
        " envs.validate_all(); envs.get('DEEPINFER_PAGE_SIZE');"
        " print(before or 'torch' not in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_clean_subprocess_env(DEEPINFER_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


@pytest.mark.parametrize("text", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_bool_true_spellings(monkeypatch, text):
    monkeypatch.setenv("DEEPINFER_QUANT_SIM", text)
    assert envs.get("DEEPINFER_QUANT_SIM") is True


@pytest.mark.parametrize("text", ["0", "false", "False", "NO", "off", "oFf"])
def test_bool_false_spellings(monkeypatch, text):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", text)
    assert envs.get("DEEPINFER_BATCH_INVARIANT") is False


ACCEPTED_BOOLS = {"1", "0", "true", "false", "yes", "no", "on", "off"}


@given(st.text(max_size=8))
def test_bool_rejects_everything_else(text):
    var = REGISTRY["DEEPINFER_ENABLE_PREFIX_CACHING"]
    if text.strip().lower() in ACCEPTED_BOOLS:
        assert envs.parse(var, text) is (text.strip().lower() in {"1", "true", "yes", "on"})
    else:
        with pytest.raises(EnvError, match="DEEPINFER_ENABLE_PREFIX_CACHING"):
            envs.parse(var, text)


@given(st.integers(min_value=-(10**6), max_value=10**6))
def test_page_size_is_a_positive_multiple_of_8(n):
    var = REGISTRY["DEEPINFER_PAGE_SIZE"]
    if n >= 8 and n % 8 == 0:
        assert envs.parse(var, str(n)) == n
    else:
        with pytest.raises(EnvError, match="multiple of 8"):
            envs.parse(var, str(n))


def test_small_pages_for_tiny_models_are_allowed(monkeypatch):
    for size in ("8", "16", "64", "128"):
        monkeypatch.setenv("DEEPINFER_PAGE_SIZE", size)
        assert envs.DEEPINFER_PAGE_SIZE == int(size)


def test_float_kind():
    var = EnvVar("DEEPINFER_TEST_FLOAT", "float", "A test-only variable.", "Test", minimum=0, maximum=1)
    assert envs.parse(var, "0.25") == 0.25 and envs.parse(var, "1") == 1.0 and envs.parse(var, ".5") == 0.5
    for bad in ("nan", "inf", "-0.1", "1.5", "abc", "1e5"):
        with pytest.raises(EnvError, match="a finite number >= 0 and <= 1"):
            envs.parse(var, bad)


def test_paths_are_expanded(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", "~/model")
    assert envs.get("DEEPINFER_HF_MODEL_DIR") == tmp_path / "model"
    monkeypatch.setenv("DEEPINFER_CACHE_DIR", "~/not-yet-created")  # the cache dir is created on demand
    assert envs.get("DEEPINFER_CACHE_DIR") == tmp_path / "not-yet-created"


def test_otel_endpoint_falls_back_to_the_standard_variable(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://standard:4317")
    assert envs.get("DEEPINFER_OTEL_ENDPOINT") == "http://standard:4317"
    monkeypatch.setenv("DEEPINFER_OTEL_ENDPOINT", "http://ours:4317")
    assert envs.get("DEEPINFER_OTEL_ENDPOINT") == "http://ours:4317"
    monkeypatch.delenv("DEEPINFER_OTEL_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "")  # OpenTelemetry treats empty as unset
    assert envs.get("DEEPINFER_OTEL_ENDPOINT") is None


def test_attribute_access_is_lazy_and_unknown_names_fail(monkeypatch):
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "3")
    assert envs.DEEPINFER_MAX_NUM_SEQS == 3
    monkeypatch.setenv("DEEPINFER_MAX_NUM_SEQS", "4")
    assert envs.DEEPINFER_MAX_NUM_SEQS == 4
    assert "DEEPINFER_MAX_NUM_SEQS" in dir(envs)
    with pytest.raises(AttributeError):
        _ = envs.DEEPINFER_NOT_A_THING
    with pytest.raises(KeyError, match="did you mean DEEPINFER_MAX_NUM_SEQS"):
        envs.get("DEEPINFER_MAX_NUM_SEQ")


def test_override_sets_and_restores(monkeypatch):
    monkeypatch.setenv("DEEPINFER_PAGE_SIZE", "64")
    before = dict(os.environ)
    with envs.override(DEEPINFER_PAGE_SIZE=16, DEEPINFER_QUANT_SIM=True, DEEPINFER_MAX_NUM_SEQS=None):
        assert envs.DEEPINFER_PAGE_SIZE == 16
        assert os.environ["DEEPINFER_QUANT_SIM"] == "1" and envs.DEEPINFER_QUANT_SIM is True
        with envs.override(DEEPINFER_QUANT_SIM=False, DEEPINFER_PAGE_SIZE=None):
            assert envs.DEEPINFER_QUANT_SIM is False and envs.DEEPINFER_PAGE_SIZE == 256
        assert envs.DEEPINFER_QUANT_SIM is True and envs.DEEPINFER_PAGE_SIZE == 16
    assert dict(os.environ) == before


def test_override_restores_on_error_and_rejects_unknown_names():
    before = dict(os.environ)
    with pytest.raises(RuntimeError), envs.override(DEEPINFER_LOG_LEVEL="debug"):
        assert envs.DEEPINFER_LOG_LEVEL == "debug"
        raise RuntimeError
    assert dict(os.environ) == before
    with pytest.raises(KeyError, match="DEEPINFER_LOG_LEVEL"), envs.override(DEEPINFER_LOG_LEVL="debug"):
        pass
    assert dict(os.environ) == before
    with envs.override(DEEPINFER_LOG_LEVEL="loud"):  # values are validated on read, not on override
        with pytest.raises(EnvError, match="DEEPINFER_LOG_LEVEL='loud'"):
            envs.get("DEEPINFER_LOG_LEVEL")
    assert dict(os.environ) == before


def test_committed_reference_matches_the_registry():
    text = envs.render_markdown()
    for name, var in REGISTRY.items():
        assert f"### `{name}`" in text and var.doc in text
    committed = (REPO / "docs" / "environment.md").read_text(encoding="utf-8")
    assert committed == text, (
        "docs/environment.md is stale; regenerate it with "
        "`PYTHONPATH=libs python -m deepinfer.envs --markdown > docs/environment.md`"
    )


def test_cli_prints_the_markdown():
    out = subprocess.run(
        [sys.executable, "-m", "deepinfer.envs", "--markdown"],
        env=_clean_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == envs.render_markdown()
