"""The deployment files, checked offline against the code they run.

docker-compose.yml (and its GPU variant deploy/compose.nvidia.yml), Dockerfile, Dockerfile.nvidia, .dockerignore,
deploy/prometheus.yml and deploy/kubernetes: every command line names a real service and only flags its parser
accepts, every DEEPINFER_* variable is declared in deepinfer.envs, health checks and probes run programs their image
has and reach the port the service listens on, only the public ports are published, credentials are mounted where
the *_FILE variables point, and the Kubernetes manifests validate against the Kubernetes JSON schemas
(kubernetes-validate, which ships them: no network).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepinfer import envs

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_NVIDIA = REPO / "deploy" / "compose.nvidia.yml"
PROMETHEUS = REPO / "deploy" / "prometheus.yml"
K8S = REPO / "deploy" / "kubernetes"
DOCS = REPO / "docs" / "deployment.md"
DOCKERFILES = {"deepinfer": REPO / "Dockerfile", "deepinfer-nvidia": REPO / "Dockerfile.nvidia"}

PUBLIC_PORTS = {50051, 8000}  # the balancer's gRPC and OpenAI-compatible HTTP APIs
# What each image can run (health checks, probes, hooks). The nats image is built from scratch: nats-server only.
IMAGE_PROGRAMS = {
    "deepinfer": {"python", "sh", "deepinfer"},
    "deepinfer-nvidia": {"python", "sh", "deepinfer"},
    "nats": {"nats-server"},
}
K8S_STANDALONE = {"secret.yaml", "model-download-job.yaml"}  # applied on their own, never by `kubectl apply -k`
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
VAR_RE = re.compile(r"\bDEEPINFER_[A-Z0-9_]+\b")


# -- loading ------------------------------------------------------------------------------------------------------
def _interpolate(value: Any) -> Any:
    """Compose's variable interpolation with every variable unset: ``${X:-d}`` / ``${X-d}`` -> d, ``${X}`` -> ""."""
    if isinstance(value, str):
        out = re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
        return out.replace("$$", "$")
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    return value


def _merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file, as far as these files need it (mappings merged, the rest replaced)."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in override.items()}}
    return override


def _load_compose(*files: Path) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for f in files:
        doc = _merge(doc, yaml.safe_load(f.read_text()))
    for svc in doc["services"].values():
        if isinstance(svc.get("build"), str):
            svc["build"] = {"context": svc["build"]}
        if isinstance(svc.get("environment"), list):
            svc["environment"] = dict(e.split("=", 1) for e in svc["environment"])
    return _interpolate(doc)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return _load_compose(COMPOSE)


@pytest.fixture(scope="module")
def compose_nvidia() -> dict[str, Any]:
    return _load_compose(COMPOSE, COMPOSE_NVIDIA)


def _k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="module")
def k8s() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) of every manifest under deploy/kubernetes."""
    return [(p.name, d) for p in _k8s_files() for d in yaml.safe_load_all(p.read_text()) if d]


def _image_repo(image: str) -> str:
    return image.rsplit(":", 1)[0].rsplit("/", 1)[-1] if ":" in image else image


def _project() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _project_version() -> str:
    return _project()["version"]


# -- command lines ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Command:
    module: str | None  # `services.<name>` when the argv runs a service
    args: list[str]
    argv: list[str]


def _parse_argv(argv: list[str], where: str) -> Command:
    """What an argv runs: ``python -m services.X ARGS``, or a ``sh -c`` script ending in ``exec python -m
    services.X "$@"`` (then ``$0`` and ARGS follow the script), or another program (module None)."""
    if argv[:2] == ["python", "-m"]:
        return Command(argv[2], argv[3:], argv)
    if argv[:2] == ["sh", "-c"]:
        script = argv[2]
        for line in re.split(r"\n|&&|\|\||;", script):
            words = shlex.split(line, comments=True)
            if words[:3] == ["exec", "python", "-m"]:
                assert words[4:] == ["$@"], f'{where}: {line!r} should pass its arguments on as "$@"'
                return Command(words[3], argv[4:], argv)
        return Command(None, [], argv)
    if argv[:2] == ["python", "-c"]:
        compile(argv[2], where, "exec")  # a syntax error fails here
    return Command(None, [], argv)


def _check_service_args(cmd: Command, where: str) -> Any:
    """The parsed namespace of a ``services.X`` command line; fails if the module or a flag does not exist."""
    assert cmd.module is not None
    name = cmd.module.removeprefix("services.")
    assert cmd.module.startswith("services.") and (REPO / "services" / name / "__main__.py").is_file(), (
        f"{where}: {cmd.module} is not a service (no services/{name}/__main__.py)"
    )
    parser = importlib.import_module(f"{cmd.module}.__main__").build_parser()
    try:
        return parser.parse_args(cmd.args)
    except SystemExit:
        pytest.fail(f"{where}: `{' '.join(cmd.args)}` is not accepted by {cmd.module}'s parser (see stderr)")


def _shell_deepinfer_calls(script: str) -> Iterator[list[str]]:
    """The ``deepinfer ...`` CLI calls of a shell script."""
    for part in re.split(r"\n|&&|\|\||;", script):
        words = shlex.split(part, comments=True)
        if words and words[0] == "deepinfer":
            yield words[1:]


def _hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _listen_ports(ns: Any) -> dict[str, int]:
    """The ports a service's parsed flags make it listen on (0: off)."""
    ports = {k: getattr(ns, k, 0) or 0 for k in ("port", "grpc_port", "http_port", "metrics_port")}
    return {k: v for k, v in ports.items() if v > 0}


def _grpc_port(ns: Any) -> int:
    return getattr(ns, "grpc_port", None) or ns.port


def _parse_env_value(name: str, value: str) -> str | None:
    """None if ``value`` is allowed for ``name`` (a path need not exist here), else why not."""
    var = envs.registry().get(name)
    if var is None:
        return f"{name} is not declared in deepinfer.envs"
    try:
        envs.parse(dataclasses.replace(var, must_be_dir=False), value)
    except envs.EnvError as e:
        return str(e)
    return None


# -- docker compose ------------------------------------------------------------------------------------------------
def _compose_command(svc: dict[str, Any], where: str) -> Command:
    entry = svc.get("entrypoint") or []
    command = svc.get("command") or []
    entry = shlex.split(entry) if isinstance(entry, str) else list(entry)
    command = shlex.split(command) if isinstance(command, str) else list(command)
    return _parse_argv(entry + command, where)


def _deepinfer_services(doc: dict[str, Any]) -> dict[str, tuple[dict[str, Any], Any]]:
    """Service name -> (definition, parsed flags) of every compose service that runs ``services.X``."""
    out = {}
    for name, svc in doc["services"].items():
        cmd = _compose_command(svc, f"compose service {name}")
        if cmd.module is not None:
            out[name] = (svc, _check_service_args(cmd, f"compose service {name}"))
    return out


def _compose_problems(doc: dict[str, Any]) -> list[str]:
    problems = []
    services = doc["services"]
    runs = _deepinfer_services(doc)
    names = {**{n: n for n in services}, **{s["hostname"]: n for n, s in services.items() if "hostname" in s}}
    version = _project_version()

    def reaches(address: str, where: str) -> None:
        host, port = _hostport(address)
        target = names.get(host)
        if target is None or target not in runs:
            problems.append(f"{where}: {address}: no deepinfer service named {host!r}")
        elif port != _grpc_port(runs[target][1]):
            problems.append(f"{where}: {address}: {target} listens on {_grpc_port(runs[target][1])}, not {port}")

    for name, svc in services.items():
        where = f"compose service {name}"
        image = svc.get("image", "")
        repo = _image_repo(image)
        env = svc.get("environment") or {}
        cmd = _compose_command(svc, where)
        if repo in DOCKERFILES:
            if image != f"{repo}:{version}":
                problems.append(f"{where}: image {image}, expected {repo}:{version} (pyproject's version)")
            build = svc.get("build") or {}
            dockerfile = REPO / build.get("context", ".") / build.get("dockerfile", "Dockerfile")
            if dockerfile != DOCKERFILES[repo]:
                problems.append(f"{where}: {image} must be built from {DOCKERFILES[repo].name}, not {dockerfile}")
        for var, value in env.items():
            if var.startswith("DEEPINFER_") and (why := _parse_env_value(var, str(value))):
                problems.append(f"{where}: {why}")
        for call in _shell_deepinfer_calls(cmd.argv[2]) if cmd.argv[:2] == ["sh", "-c"] else ():
            from deepinfer.cli import build_parser

            try:
                build_parser().parse_args(call)
            except SystemExit:
                problems.append(f"{where}: `deepinfer {' '.join(call)}` is not a valid deepinfer command")
        # health checks run what the image has, against the port the service listens on
        if "healthcheck" in svc:
            test = svc["healthcheck"]["test"]
            program = "sh" if test[0] == "CMD-SHELL" else test[1]
            if test[0] not in ("CMD", "CMD-SHELL"):
                problems.append(f"{where}: healthcheck test must start with CMD or CMD-SHELL: {test}")
            if program not in IMAGE_PROGRAMS.get(repo, set()):
                problems.append(f"{where}: healthcheck runs {program!r}, which image {image} does not have")
            if test[1:4] == ["python", "-m", "deepinfer.serving.healthcheck"] and name in runs:
                host, port = _hostport(test[4])
                if port != _grpc_port(runs[name][1]) or host not in LOOPBACK:
                    problems.append(f"{where}: healthcheck probes {test[4]}, not its own gRPC port")
        # dependencies can be met
        deps = svc.get("depends_on") or {}
        for dep, spec in deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps):
            condition = (spec or {}).get("condition", "service_started")
            if dep not in services:
                problems.append(f"{where}: depends on unknown service {dep}")
            elif condition == "service_healthy" and "healthcheck" not in services[dep]:
                problems.append(f"{where}: waits for {dep} to be healthy, but {dep} has no healthcheck")
            elif condition == "service_completed_successfully" and services[dep].get("restart", "no") != "no":
                problems.append(f"{where}: waits for {dep} to complete, but {dep} restarts")
        # published ports: only the public APIs; profile-only tools on this host's loopback only
        for spec in svc.get("ports") or []:
            parts = str(spec).split(":")
            host_ip = parts[0] if len(parts) == 3 else ""
            host_port, container_port = int(parts[-2]), int(parts[-1].split("/")[0])
            if svc.get("profiles"):
                if host_ip != "127.0.0.1":
                    problems.append(f"{where}: publishes {spec} beyond 127.0.0.1")
            elif host_port not in PUBLIC_PORTS or host_port != container_port:
                problems.append(f"{where}: publishes {spec}; only {sorted(PUBLIC_PORTS)} are public")
            elif name not in runs or container_port not in _listen_ports(runs[name][1]).values():
                problems.append(f"{where}: publishes {spec}, but does not serve the public API there")
            elif container_port == getattr(runs[name][1], "metrics_port", 0):
                problems.append(f"{where}: publishes its metrics port")
        # secrets and volumes exist
        for secret in svc.get("secrets") or []:
            if secret not in (doc.get("secrets") or {}):
                problems.append(f"{where}: secret {secret} is not declared")
        for volume in svc.get("volumes") or []:
            source = str(volume).split(":")[0]
            if source.startswith((".", "/")):
                if source.startswith(".") and not (REPO / source).exists():
                    problems.append(f"{where}: mounts {source}, which does not exist")
            elif source not in (doc.get("volumes") or {}):
                problems.append(f"{where}: volume {source} is not declared")

    # the deepinfer services: credentials, model, addresses, metrics
    for name, (svc, ns) in runs.items():
        where = f"compose service {name}"
        env = svc.get("environment") or {}
        mounted = {f"/run/secrets/{s}" for s in svc.get("secrets") or []}
        if ns.host not in LOOPBACK and not env.get("DEEPINFER_ALLOW_UNAUTHENTICATED"):
            if not {"DEEPINFER_INTERNAL_TOKEN", "DEEPINFER_INTERNAL_TOKEN_FILE"} & env.keys():
                problems.append(f"{where}: listens on {ns.host} without the internal token (it refuses to start)")
            if name == "balancer" and not {"DEEPINFER_API_KEYS", "DEEPINFER_API_KEY_FILE"} & env.keys():
                problems.append(f"{where}: the public API listens on {ns.host} without API keys")
        for var in ("DEEPINFER_INTERNAL_TOKEN_FILE", "DEEPINFER_API_KEY_FILE"):
            if var in env and env[var] not in mounted:
                problems.append(f"{where}: {var}={env[var]} is not one of its secrets {sorted(mounted)}")
        if "DEEPINFER_HF_MODEL_DIR" in env:
            targets = [str(v).split(":")[1] for v in svc.get("volumes") or []]
            if not any(env["DEEPINFER_HF_MODEL_DIR"].startswith(t.rstrip("/") + "/") for t in targets):
                problems.append(f"{where}: DEEPINFER_HF_MODEL_DIR={env['DEEPINFER_HF_MODEL_DIR']} is on no volume")
        for address in getattr(ns, "scheduler", None) or []:
            reaches(address, f"{where} --scheduler")
        if getattr(ns, "worker", None):
            reaches(ns.worker, f"{where} --worker")
        for var in ("DEEPINFER_KVSTORE_URL", "DEEPINFER_GRAMMAR_URL"):
            if var in env:
                reaches(env[var], f"{where} {var}")
        nats = env.get("DEEPINFER_NATS_URL", "")
        if nats and names.get(nats.removeprefix("nats://").split(":")[0]) not in services:
            problems.append(f"{where}: DEEPINFER_NATS_URL={nats} names no service")
        if name != "balancer" and not getattr(ns, "metrics_port", 0):
            problems.append(f"{where}: no --metrics-port")
        grace = re.fullmatch(r"(\d+)s", str(svc.get("stop_grace_period", "10s")))
        if not grace or int(grace.group(1)) < float(env.get("DEEPINFER_DRAIN_GRACE_S", 30)) + 10:
            problems.append(f"{where}: stop_grace_period (default 10s) must cover DEEPINFER_DRAIN_GRACE_S + 10 s")
    workers = [n for n, (svc, _) in runs.items() if _compose_command(svc, n).module.startswith("services.worker_")]
    if len(workers) != 1:
        problems.append(f"exactly one worker service should run, found {workers}")
    return problems


def test_compose_is_consistent(compose):
    problems = _compose_problems(compose)
    assert not problems, "docker-compose.yml:\n" + "\n".join(problems)


def test_compose_nvidia_variant(compose_nvidia):
    """deploy/compose.nvidia.yml swaps the one worker onto the GPU image with a GPU reservation."""
    problems = _compose_problems(compose_nvidia)
    assert not problems, "docker-compose.yml + deploy/compose.nvidia.yml:\n" + "\n".join(problems)
    override = yaml.safe_load(COMPOSE_NVIDIA.read_text())["services"]
    assert set(override) == {"worker"}, "the GPU variant replaces the worker and nothing else"
    worker = compose_nvidia["services"]["worker"]
    assert _image_repo(worker["image"]) == "deepinfer-nvidia"
    assert worker["environment"]["DEEPINFER_ACCELERATOR"] == "nvidia"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    cpu = _load_compose(COMPOSE)["services"]["worker"]
    assert cpu["environment"]["DEEPINFER_ACCELERATOR"] == "cpu" and "deploy" not in cpu


def test_compose_nats_waits_use_python(compose):
    """The nats image has no shell, wget or curl: NATS's health is probed from a deepinfer container."""
    services = compose["services"]
    assert "healthcheck" not in services["nats"] or services["nats"]["healthcheck"]["test"][1] == "nats-server"
    waiters = [n for n, s in services.items() if "nats:8222/healthz" in " ".join(map(str, s.get("command") or []))]
    assert waiters, "a service should poll http://nats:8222/healthz"
    for name in waiters:
        assert _image_repo(services[name]["image"]) in ("deepinfer", "deepinfer-nvidia")
        assert services[name]["entrypoint"][0] == "python"
    for name, svc in services.items():
        deps = svc.get("depends_on") or {}
        if isinstance(deps, dict) and "nats" in deps:
            assert deps["nats"].get("condition", "service_started") == "service_started", name


def test_compose_metrics_are_scraped(compose):
    """deploy/prometheus.yml scrapes every service's metrics port (the balancer: its HTTP port)."""
    expected = set()
    for name, (_, ns) in _deepinfer_services(compose).items():
        port = ns.http_port if name == "balancer" else ns.metrics_port
        expected.add(f"{name}:{port}")
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == expected, (
        f"deploy/prometheus.yml scrapes {sorted(targets)}; the services serve {sorted(expected)}"
    )
    prometheus = compose["services"]["prometheus"]
    assert prometheus["profiles"] == ["metrics"]
    assert any(str(v).startswith("./deploy/prometheus.yml:") for v in prometheus["volumes"])


def test_compose_secrets_are_generated_by_the_documented_step(compose):
    """Every compose secret file is written by the documented one-liner (docs/deployment.md and the compose file's
    header) and ignored by git; the files themselves are not required here."""
    docs, header = DOCS.read_text(), COMPOSE.read_text()
    for name, secret in compose["secrets"].items():
        rel = secret["file"].removeprefix("./")
        assert rel.startswith("secrets/"), f"secret {name}: {rel} should live in secrets/"
        for text, where in ((docs, "docs/deployment.md"), (header, "docker-compose.yml")):
            assert re.search(rf">\s*(\./)?{re.escape(rel)}\b", text), f"{where} does not show how to write {rel}"
    ignored = {line.strip() for line in (REPO / ".gitignore").read_text().splitlines()}
    assert ignored & {"/secrets/", "secrets/", "/secrets"}, ".gitignore must keep secrets/ out of git"


# -- every DEEPINFER_* name ----------------------------------------------------------------------------------------
def test_every_named_variable_is_declared():
    files = [COMPOSE, COMPOSE_NVIDIA, PROMETHEUS, DOCS, *DOCKERFILES.values(), *K8S.glob("*.yaml")]
    declared = envs.registry()
    named = {(f.relative_to(REPO), v) for f in files for v in VAR_RE.findall(f.read_text())}
    unknown = sorted(f"{f}: {v}" for f, v in named if v not in declared)
    assert not unknown, "not declared in deepinfer.envs:\n" + "\n".join(unknown)


# -- Dockerfiles and .dockerignore ---------------------------------------------------------------------------------
def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(KEYWORD, rest) of each instruction: comments dropped, continued lines joined."""
    out, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip().removesuffix("\\") + " "
        if not line.rstrip().endswith("\\"):
            keyword, _, rest = pending.strip().partition(" ")
            if keyword:
                out.append((keyword.upper(), rest.strip()))
            pending = ""
    return out


def _glob_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _dockerignore() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negate = line.startswith("!")
            rules.append((negate, _glob_regex(line.removeprefix("!").strip().strip("/"))))
    return rules


def _excluded(rel: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent directories decides."""
    parts = rel.strip("/").split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    excluded = False
    for negate, rx in rules:
        if any(rx.match(p) for p in prefixes):
            excluded = not negate
    return excluded


def _source_files(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
        return
    for p in sorted(path.rglob("*")):
        rel = p.relative_to(REPO).parts
        if p.is_file() and not any(part == "__pycache__" or part.endswith(".egg-info") for part in rel):
            yield p


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_copies_what_the_context_holds(image):
    dockerfile = DOCKERFILES[image]
    rules = _dockerignore()
    copies = [rest for keyword, rest in _instructions(dockerfile) if keyword in ("COPY", "ADD")]
    assert copies, f"{dockerfile.name} copies nothing"
    for rest in copies:
        words = [w for w in (json.loads(rest) if rest.startswith("[") else rest.split()) if not w.startswith("--")]
        for source in words[:-1]:
            path = REPO / source
            assert path.exists(), f"{dockerfile.name}: COPY {source}: no such file in the repository"
            files = list(_source_files(path))
            assert files, f"{dockerfile.name}: COPY {source} is empty"
            left_out = [str(f.relative_to(REPO)) for f in files if _excluded(str(f.relative_to(REPO)), rules)]
            assert not left_out, f"{dockerfile.name}: COPY {source}: .dockerignore leaves out {left_out[:5]}"


def test_dockerignore_keeps_the_context_small():
    rules = _dockerignore()
    junk = [".venv/bin/python", ".git/HEAD", "bench/results/x.json", "tests/data/x", "secrets/api_keys", "docs/x.md"]
    junk += ["libs/deepinfer/__pycache__/envs.cpython-311.pyc", "deepinfer.egg-info/PKG-INFO", ".pytest_cache/x"]
    for rel in junk:
        assert _excluded(rel, rules), f".dockerignore lets {rel} into the build context"


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_dockerfile_installs_and_runs(image):
    steps = _instructions(DOCKERFILES[image])
    text = " ".join(rest for _, rest in steps)
    extras_declared = set(_project()["optional-dependencies"])
    installed = re.findall(r"\"\.\[([\w,]+)\]\"", text)
    assert installed, f"{image}: the project is not pip-installed"
    for extra in {e for group in installed for e in group.split(",")}:
        assert extra in extras_declared, f"{image}: installs extra {extra!r}, which pyproject.toml does not declare"
    base = next(rest for keyword, rest in steps if keyword == "FROM")
    if image == "deepinfer-nvidia":
        assert base.startswith("nvidia/cuda:"), "the GPU image builds on a CUDA base"
        assert any("nvidia" in group.split(",") for group in installed), "the GPU image installs the nvidia extra"
        assert re.search(r"ENV .*DEEPINFER_ACCELERATOR=nvidia", "\n".join(f"{k} {r}" for k, r in steps))
    users = [rest for keyword, rest in steps if keyword == "USER"]
    assert users and users[-1].isdigit() and users[-1] != "0", f"{image}: runs as a numeric non-root USER"
    entry = json.loads(next(rest for keyword, rest in steps if keyword == "ENTRYPOINT"))
    cmd = json.loads(next(rest for keyword, rest in steps if keyword == "CMD"))
    assert entry == ["deepinfer"]
    from deepinfer.cli import build_parser

    build_parser().parse_args(cmd)


def _dockerfile_uid() -> int:
    uids = {int([r for k, r in _instructions(p) if k == "USER"][-1]) for p in DOCKERFILES.values()}
    assert len(uids) == 1, f"the images run as different users: {uids}"
    return uids.pop()


# -- Kubernetes ----------------------------------------------------------------------------------------------------
def _k8s_versions() -> list[str]:
    from kubernetes_validate.utils import all_versions
    from packaging.version import Version

    supported = [v for v in all_versions() if Version(v) >= Version("1.29")]
    assert supported, "kubernetes-validate has no schemas for Kubernetes >= 1.29"
    return sorted({supported[0], supported[-1]}, key=Version)


@pytest.mark.parametrize("path", _k8s_files(), ids=lambda p: p.name)
def test_kubernetes_manifest_validates(path):
    """Each object against the strict (no unknown fields) schemas of the oldest and newest Kubernetes supported."""
    import kubernetes_validate

    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path.name} holds no object"
    for doc in docs:
        for version in _k8s_versions():
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                what = f"{doc['kind']}/{doc['metadata']['name']}"
                pytest.fail(f"{path.name}: {what} (Kubernetes {version}): {'.'.join(map(str, e.path))}: {e.message}")


def test_kustomization_lists_the_manifests(k8s):
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted({p.name for p in _k8s_files()} - K8S_STANDALONE), (
        f"kustomization.yaml should list every manifest but the standalone ones {sorted(K8S_STANDALONE)}"
    )
    images = {_image_repo(c["image"]) for _, pod in _pod_templates_of(k8s) for c in _containers(pod)}
    for entry in kustomization.get("images", []):
        assert entry["name"] in images, f"kustomization.yaml: image {entry['name']} is used by no container"


def _pod_templates_of(objs: list[tuple[str, dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for file, obj in objs:
        if "template" in obj.get("spec", {}):
            yield f"{file}: {obj['kind']}/{obj['metadata']['name']}", obj["spec"]["template"]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"].get("initContainers", []) + pod["spec"]["containers"]


def _configmaps(objs: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for _, o in objs if o["kind"] == "ConfigMap"}


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@dataclasses.dataclass
class Container:
    where: str
    pod: dict[str, Any]
    spec: dict[str, Any]
    env: dict[str, Any]  # envFrom ConfigMaps and env (valueFrom entries as their dict)
    cmd: Command
    ns: Any  # the parsed flags when it runs a service, else None

    @property
    def repo(self) -> str:
        return _image_repo(self.spec["image"])

    def port(self, port: int | str) -> int | None:
        if isinstance(port, int):
            return port
        return next((p["containerPort"] for p in self.spec.get("ports", []) if p.get("name") == port), None)

    def mounted(self, path: str) -> tuple[dict[str, Any], str] | None:
        """(volume, path inside it) of the mount holding ``path``."""
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        for m in self.spec.get("volumeMounts", []):
            root = m["mountPath"].rstrip("/") + "/"
            if path.startswith(root):
                return volumes[m["name"]], path[len(root) :]
        return None


@pytest.fixture(scope="module")
def containers(k8s) -> list[Container]:
    configmaps = _configmaps(k8s)
    out = []
    for where, pod in _pod_templates_of(k8s):
        for c in _containers(pod):
            cwhere = f"{where} container {c['name']}"
            env: dict[str, Any] = {}
            for src in c.get("envFrom", []):
                env.update(configmaps[src["configMapRef"]["name"]])
            env.update({e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])})
            for ref in re.findall(r"\$\((\w+)\)", " ".join(c.get("command", []) + c.get("args", []))):
                assert ref in env, f"{cwhere}: uses $({ref}), which its env does not define"
            argv = [re.sub(r"\$\(\w+\)", "10.0.0.1", a) for a in c.get("command", []) + c.get("args", [])]
            cmd = _parse_argv(argv, cwhere) if c.get("command") else Command(None, argv, argv)
            ns = _check_service_args(cmd, cwhere) if cmd.module else None
            out.append(Container(cwhere, pod, c, env, cmd, ns))
    return out


def _service_containers(containers: list[Container], prefix: str = "services.") -> list[Container]:
    return [c for c in containers if c.cmd.module and c.cmd.module.startswith(prefix)]


def test_kubernetes_images_commands_and_env(k8s, containers):
    problems = []
    version = _project_version()
    for name, data in _configmaps(k8s).items():
        for var, value in data.items():
            if not var.startswith("DEEPINFER_"):
                problems.append(f"ConfigMap {name}: {var} is not a DEEPINFER_* variable")
            elif why := _parse_env_value(var, str(value)):
                problems.append(f"ConfigMap {name}: {why}")
    for c in containers:
        if c.repo not in IMAGE_PROGRAMS:
            problems.append(f"{c.where}: image {c.spec['image']} is not one whose contents are known")
            continue
        if c.repo in DOCKERFILES and c.spec["image"] != f"{c.repo}:{version}":
            problems.append(f"{c.where}: image {c.spec['image']}, expected {c.repo}:{version} (pyproject's version)")
        for var, value in c.env.items():
            if var.startswith("DEEPINFER_") and isinstance(value, str) and (why := _parse_env_value(var, value)):
                problems.append(f"{c.where}: {why}")
        runs = [("command", c.spec["command"])] if c.spec.get("command") else []
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in c.spec.get(kind, {}):
                runs.append((kind, c.spec[kind]["exec"]["command"]))
        for hook, handler in c.spec.get("lifecycle", {}).items():
            if "exec" in handler:
                runs.append((hook, handler["exec"]["command"]))
        for kind, argv in runs:
            if argv[0] not in IMAGE_PROGRAMS[c.repo]:
                problems.append(f"{c.where}: its {kind} runs {argv[0]!r}, which image {c.spec['image']} does not have")
            if kind != "command":
                _parse_argv(argv, f"{c.where} {kind}")  # inline Python must compile
    assert not problems, "deploy/kubernetes:\n" + "\n".join(problems)


def test_kubernetes_credentials_and_model(k8s, containers):
    """Services beyond loopback get the internal token (the balancer also API keys) from a mounted Secret key, and
    the model directory is on a mounted volume."""
    secrets = {o["metadata"]["name"]: o for _, o in k8s if o["kind"] == "Secret"}
    problems = []

    def secret_key(c: Container, path: str) -> str | None:
        found = c.mounted(path)
        if found is None or "secret" not in found[0]:
            return f"{path} is on no Secret volume"
        volume, rest = found
        items = {i["path"]: i["key"] for i in volume["secret"].get("items", [])} or {rest: rest}
        secret = secrets.get(volume["secret"]["secretName"])
        if rest not in items:
            return f"{path}: the Secret volume has no {rest}"
        if secret is None or items[rest] not in {**secret.get("data", {}), **secret.get("stringData", {})}:
            return f"{path}: Secret {volume['secret']['secretName']} has no key {items[rest]}"
        return None

    for c in _service_containers(containers):
        if c.ns.host not in LOOPBACK and "DEEPINFER_INTERNAL_TOKEN_FILE" not in c.env:
            problems.append(f"{c.where}: listens on {c.ns.host} without the internal token (it refuses to start)")
        if c.cmd.module == "services.balancer" and "DEEPINFER_API_KEY_FILE" not in c.env:
            problems.append(f"{c.where}: the public API needs DEEPINFER_API_KEY_FILE")
    for c in containers:
        for var in ("DEEPINFER_INTERNAL_TOKEN_FILE", "DEEPINFER_API_KEY_FILE"):
            if var in c.env and c.cmd.module and (why := secret_key(c, c.env[var])):
                problems.append(f"{c.where}: {var}: {why}")
        if "DEEPINFER_HF_MODEL_DIR" in c.env and c.mounted(c.env["DEEPINFER_HF_MODEL_DIR"]) is None:
            problems.append(f"{c.where}: DEEPINFER_HF_MODEL_DIR={c.env['DEEPINFER_HF_MODEL_DIR']} is on no volume")
    assert not problems, "deploy/kubernetes:\n" + "\n".join(problems)


def test_kubernetes_probes_and_ports(containers):
    """gRPC services: native grpc probes on their service port; the balancer: GET /ready and /live on its HTTP
    port; NATS: GET /healthz on its monitoring port. Every port a service listens on is a declared container port."""
    problems = []
    kinds = ("startupProbe", "readinessProbe", "livenessProbe")
    for c in containers:
        if c.repo == "nats":
            for kind in kinds:
                get = c.spec.get(kind, {}).get("httpGet", {})
                if not get.get("path", "").startswith("/healthz") or c.port(get.get("port", 0)) != 8222:
                    problems.append(f"{c.where}: {kind} should GET /healthz on the monitoring port 8222")
    for c in _service_containers(containers):
        listen = _listen_ports(c.ns)
        declared = {p["containerPort"] for p in c.spec.get("ports", [])}
        if set(listen.values()) - declared:
            problems.append(f"{c.where}: listens on {sorted(listen.values())}, declares {sorted(declared)}")
        if c.cmd.module == "services.balancer":
            for kind, path in (("readinessProbe", "/ready"), ("livenessProbe", "/live")):
                get = c.spec.get(kind, {}).get("httpGet", {})
                if get.get("path") != path or c.port(get.get("port", 0)) != c.ns.http_port:
                    problems.append(f"{c.where}: {kind} should GET {path} on the HTTP port {c.ns.http_port}")
            if "startupProbe" not in c.spec:
                problems.append(f"{c.where}: no startupProbe")
            continue
        for kind in kinds:
            port = c.spec.get(kind, {}).get("grpc", {}).get("port")
            if port != _grpc_port(c.ns):
                problems.append(f"{c.where}: {kind} should be a grpc probe on its port {_grpc_port(c.ns)}")
        if not getattr(c.ns, "metrics_port", 0):
            problems.append(f"{c.where}: no --metrics-port")
    assert not problems, "deploy/kubernetes:\n" + "\n".join(problems)


def test_kubernetes_replica_is_a_scheduler_and_its_worker(containers):
    """A scheduler drives exactly one worker: the two are containers of one pod, the worker on the GPU image with one
    GPU, the scheduler dialing it over localhost and not holding a GPU."""
    schedulers = _service_containers(containers, "services.scheduler")
    assert len(schedulers) == 1, f"one scheduler container template expected: {[c.where for c in schedulers]}"
    scheduler = schedulers[0]
    workers = [c for c in _service_containers(containers, "services.worker_") if c.pod is scheduler.pod]
    assert len(workers) == 1, "the scheduler's pod should hold exactly one worker"
    assert len(_service_containers(containers, "services.worker_")) == 1, "workers run only beside a scheduler"
    worker = workers[0]
    host, port = _hostport(scheduler.ns.worker)
    assert host in LOOPBACK and port == worker.ns.port, f"--worker {scheduler.ns.worker}: not its worker's port"
    assert worker.repo == "deepinfer-nvidia" and worker.env.get("DEEPINFER_ACCELERATOR") == "nvidia"
    assert str(worker.spec["resources"]["limits"].get("nvidia.com/gpu")) == "1"
    assert scheduler.repo != "deepinfer-nvidia", "the scheduler needs no GPU (the CUDA image would show it every GPU)"
    assert "nvidia.com/gpu" not in scheduler.spec["resources"].get("limits", {})
    assert "preStop" in worker.spec.get("lifecycle", {}), "the worker outlives its draining scheduler"
    waits = re.search(r"healthcheck ([\w.:-]+)", " ".join(scheduler.cmd.argv))
    assert waits is None or waits.group(1) == scheduler.ns.worker, "the scheduler waits for another address"


def test_kubernetes_pods(k8s, containers):
    """Non-root as the images' user, resources, the NetworkPolicy's label, and time to drain on SIGTERM."""
    uid = _dockerfile_uid()
    drain = float(_configmaps(k8s).get("deepinfer-env", {}).get("DEEPINFER_DRAIN_GRACE_S", 30.0))
    problems = []
    pods = {id(c.pod): (c.where.split(" container ")[0], c.pod) for c in containers}
    for where, pod in pods.values():
        spec = pod["spec"]
        repos = {_image_repo(c["image"]) for c in _containers(pod)}
        if repos & set(DOCKERFILES) and spec.get("securityContext", {}).get("runAsUser") != uid:
            problems.append(f"{where}: runAsUser should be the images' USER {uid}")
        if spec.get("securityContext", {}).get("runAsNonRoot") is not True:
            problems.append(f"{where}: runAsNonRoot: true")
        serves = any(c.cmd.module and c.pod is pod for c in containers)
        if serves and pod["metadata"]["labels"].get("app.kubernetes.io/part-of") != "deepinfer":
            problems.append(f"{where}: label app.kubernetes.io/part-of=deepinfer (NATS's NetworkPolicy admits it)")
        if serves and spec.get("terminationGracePeriodSeconds", 30) < drain + 10:
            problems.append(f"{where}: terminationGracePeriodSeconds < DEEPINFER_DRAIN_GRACE_S ({drain:g} s) + 10 s")
    for c in containers:
        resources = c.spec.get("resources", {})
        if not resources.get("requests") or "memory" not in resources.get("limits", {}):
            problems.append(f"{c.where}: resource requests and a memory limit")
        if c.spec.get("securityContext", {}).get("allowPrivilegeEscalation") is not False:
            problems.append(f"{c.where}: allowPrivilegeEscalation: false")
    assert not problems, "deploy/kubernetes:\n" + "\n".join(problems)


def test_kubernetes_selectors(k8s):
    """Workloads select their pods; Services, the HPA and the PDB select what exists."""
    problems = []
    pods = list(_pod_templates_of(k8s))
    workloads = {(o["kind"], o["metadata"]["name"]): o for _, o in k8s if "template" in o.get("spec", {})}
    for (kind, name), obj in workloads.items():
        if kind != "Job" and not _matches(
            obj["spec"]["selector"]["matchLabels"], obj["spec"]["template"]["metadata"]["labels"]
        ):
            problems.append(f"{kind}/{name}: its selector does not match its pod template")
    for svc in (o for _, o in k8s if o["kind"] == "Service"):
        name = svc["metadata"]["name"]
        targets = [pod for _, pod in pods if _matches(svc["spec"]["selector"], pod["metadata"]["labels"])]
        if not targets:
            problems.append(f"Service/{name}: selects no pod")
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            ports = [p for pod in targets for c in pod["spec"]["containers"] for p in c.get("ports", [])]
            if not any(target in (p.get("name"), p["containerPort"]) for p in ports):
                problems.append(f"Service/{name}: targetPort {target} is no port of its pods")
    for obj in (o for _, o in k8s):
        if obj["kind"] == "HorizontalPodAutoscaler":
            ref = obj["spec"]["scaleTargetRef"]
            if (ref["kind"], ref["name"]) not in workloads:
                problems.append(f"HPA {obj['metadata']['name']}: scales unknown {ref['kind']}/{ref['name']}")
            elif "replicas" in workloads[(ref["kind"], ref["name"])]["spec"]:
                problems.append(f"{ref['kind']}/{ref['name']}: sets replicas, which its HPA owns")
        if obj["kind"] == "PodDisruptionBudget":
            label = obj["spec"]["selector"]["matchLabels"]
            selected = [w for w, pod in pods if _matches(label, pod["metadata"]["labels"])]
            if len(selected) != 1 or "balancer" not in selected[0]:
                problems.append(f"PDB {obj['metadata']['name']}: should select the balancer, selects {selected}")
    kinds = {o["kind"] for _, o in k8s}
    for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget", "StatefulSet", "Secret", "NetworkPolicy"):
        if kind not in kinds:
            problems.append(f"deploy/kubernetes has no {kind}")
    assert not problems, "deploy/kubernetes:\n" + "\n".join(problems)


def test_kubernetes_addresses_resolve(k8s, containers):
    """DEEPINFER_NATS_URL / _KVSTORE_URL / _GRAMMAR_URL (and http:// URLs in commands) name a Service port that
    reaches a container port."""
    services = {o["metadata"]["name"]: o for _, o in k8s if o["kind"] == "Service"}
    pods = [pod for _, pod in _pod_templates_of(k8s)]
    problems = []
    for c in containers:
        urls = ("DEEPINFER_NATS_URL", "DEEPINFER_KVSTORE_URL", "DEEPINFER_GRAMMAR_URL")
        addresses = [(var, c.env[var]) for var in urls if var in c.env]
        addresses += [("a URL in its command", u) for u in re.findall(r"http://([\w.-]+:\d+)", " ".join(c.cmd.argv))]
        for var, address in addresses:
            host, port = _hostport(address.removeprefix("nats://"))
            svc = services.get(host)
            service_port = next((p for p in svc["spec"]["ports"] if p["port"] == port), None) if svc else None
            if service_port is None:
                problems.append(f"{c.where}: {var} {address}: no Service {host} with port {port}")
                continue
            target = service_port.get("targetPort", port)
            ports = [
                p
                for pod in pods
                if _matches(svc["spec"]["selector"], pod["metadata"]["labels"])
                for c2 in pod["spec"]["containers"]
                for p in c2.get("ports", [])
            ]
            if not any(target in (p.get("name"), p["containerPort"]) for p in ports):
                problems.append(f"{c.where}: {var} {address}: Service {host} reaches no container port")
    assert not problems, "deploy/kubernetes:\n" + "\n".join(problems)
