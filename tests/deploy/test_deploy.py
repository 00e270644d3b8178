"""Checks of deploy/ that schemas cannot make: the files agree with each other
and with the agent they deploy. Run by scripts/check-deploy (in its venv,
which has PyYAML and pytest) after the manifests passed kubernetes-validate:

    pytest tests/deploy --bin target/debug/devtrace

- every agent config (the ConfigMaps' config.toml, deploy/systemd/config.toml)
  is TOML, and every key is a long flag of `devtrace serve`;
- every flag the manifests and the unit pass to `devtrace serve` exists;
- the agent itself accepts every config and every container's arguments
  (`devtrace serve ... --print-config`: names and values);
- the probes and Prometheus annotations use the port metrics-listen gives,
  and the container declares it;
- the DaemonSet adds the capabilities the systemd unit bounds to (plus
  SYS_RESOURCE, which the unit replaces with LimitMEMLOCK=);
- every devtrace image reference is the same;
- every pod running an agent, and the unit, give it time to stop: the
  captures in flight end their windows first.

The flag checks need an agent that reads --config (and --print-config);
against one that does not, they are skipped.
"""

import glob
import os
import re
import subprocess
import tempfile

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KUBERNETES = os.path.join(ROOT, "deploy", "kubernetes")
UNIT = os.path.join(ROOT, "deploy", "systemd", "devtrace.service")
HOST_CONFIG = os.path.join(ROOT, "deploy", "systemd", "config.toml")
IMAGE = re.compile(r"/devtrace:[^/]+$")
# The unit bounds root to these; the DaemonSet also needs SYS_RESOURCE
# (containers cannot raise RLIMIT_MEMLOCK without it).
CONTAINER_ONLY_CAPABILITIES = {"SYS_RESOURCE"}
# What a stopping agent may wait for: a capture window of up to the default
# --max-duration (115 s), its reply, and trigger saves of up to 10 s.
AGENT_STOP_SECONDS = 125


class Failed(AssertionError):
    pass


Skipped = pytest.skip.Exception


def resources():
    """(file, resource) for every resource under deploy/kubernetes."""
    for path in sorted(glob.glob(os.path.join(KUBERNETES, "**", "*.yaml"), recursive=True)):
        with open(path) as f:
            for resource in yaml.safe_load_all(f):
                if resource:
                    yield os.path.relpath(path, ROOT), resource


def pod_spec(resource):
    if resource["kind"] == "Pod":
        return resource["spec"]
    if resource["kind"] in ("DaemonSet", "Deployment", "StatefulSet", "Job"):
        return resource["spec"]["template"]["spec"]
    return None


def containers(spec):
    return spec.get("initContainers", []) + spec.get("containers", [])


def agent_containers():
    """(file, pod resource, container) for every container running `devtrace serve`."""
    for path, resource in resources():
        spec = pod_spec(resource)
        if spec is None:
            continue
        for container in containers(spec):
            if container.get("args", [])[:1] == ["serve"]:
                yield path, resource, container


def config_texts():
    """(name, text) of every agent config."""
    found = []
    for path, resource in resources():
        if resource["kind"] == "ConfigMap" and "config.toml" in resource.get("data", {}):
            name = f"{path} ({resource['metadata']['name']})"
            found.append((name, resource["data"]["config.toml"]))
    with open(HOST_CONFIG) as f:
        found.append((os.path.relpath(HOST_CONFIG, ROOT), f.read()))
    return found


def configs():
    """(name, parsed TOML) of every agent config."""
    parsed = []
    for name, text in config_texts():
        try:
            parsed.append((name, tomllib.loads(text)))
        except tomllib.TOMLDecodeError as error:
            raise Failed(f"{name}: not TOML: {error}")
    return parsed


def serve_flags(binary):
    """The long flags `devtrace serve --help` lists."""
    help_text = subprocess.run(
        [binary, "serve", "--help"], check=True, capture_output=True, text=True
    ).stdout
    return set(re.findall(r"^\s+(?:-\w, )?--([a-z0-9-]+)", help_text, re.M))


def flags_in_args(args):
    return [arg[2:].split("=", 1)[0] for arg in args if arg.startswith("--")]


def unit_exec_flags():
    with open(UNIT) as f:
        line = next(l for l in f if l.startswith("ExecStart="))
    return flags_in_args(line.split()[1:])


def unit_capabilities():
    with open(UNIT) as f:
        line = next(l for l in f if l.startswith("CapabilityBoundingSet="))
    return {c.removeprefix("CAP_") for c in line.split("=", 1)[1].split()}


def test_configs_parse():
    names = [name for name, _ in configs()]
    print(f"{len(names)} agent configs are TOML")


def test_flags_exist(binary):
    flags = serve_flags(binary)
    if "config" not in flags:
        raise Skipped("this devtrace has no --config; config keys and flags are not checked")
    unknown = []
    for name, config in configs():
        unknown += [f"{name}: key {key!r}" for key in config if key not in flags]
    for path, _, container in agent_containers():
        unknown += [
            f"{path} ({container['name']}): --{flag}"
            for flag in flags_in_args(container["args"])
            if flag not in flags
        ]
    unknown += [f"{os.path.relpath(UNIT, ROOT)}: --{flag}" for flag in unit_exec_flags() if flag not in flags]
    if unknown:
        raise Failed("not flags of `devtrace serve`: " + "; ".join(unknown))
    print("every config key and flag is a flag of `devtrace serve`")


def accepted(binary, args):
    """None when `devtrace <args> --print-config` succeeds, else its error."""
    result = subprocess.run([binary, *args, "--print-config"], capture_output=True, text=True)
    return None if result.returncode == 0 else result.stderr.strip().splitlines()[0]


def test_agent_accepts(binary):
    if "print-config" not in serve_flags(binary):
        raise Skipped("this devtrace has no --print-config; configs are not read by the agent")
    refused = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, (name, text) in enumerate(config_texts()):
            path = os.path.join(scratch, f"{index}.toml")
            with open(path, "w") as f:
                f.write(text)
            error = accepted(binary, ["serve", "--config", path])
            if error:
                refused.append(f"{name}: {error}")
        for path, _, container in agent_containers():
            if "--config" in container["args"]:
                continue  # its ConfigMap is read above
            error = accepted(binary, container["args"])
            if error:
                refused.append(f"{path} ({container['name']}): {error}")
    if refused:
        raise Failed("; ".join(refused))
    print("the agent accepts every config and every container's arguments")


def metrics_port(path, container, configs_by_map):
    """The port metrics-listen gives this container, from its args or its ConfigMap."""
    for arg in container.get("args", []):
        if arg.startswith("--metrics-listen="):
            return int(arg.rsplit(":", 1)[1])
    if "--config" in container.get("args", []):
        for config in configs_by_map:
            if "metrics-listen" not in config:
                raise Failed(f"{path}: a ConfigMap for {container['name']} has no metrics-listen")
        ports = {int(config["metrics-listen"].rsplit(":", 1)[1]) for config in configs_by_map}
        if len(ports) != 1:
            raise Failed(f"{path}: the ConfigMaps give different metrics ports: {sorted(ports)}")
        return ports.pop()
    raise Failed(f"{path} ({container['name']}): no --metrics-listen and no --config")


def test_probe_ports():
    agent_configs = [config for name, config in configs() if "kubernetes" in name]
    checked = 0
    for path, resource, container in agent_containers():
        port = metrics_port(path, container, agent_configs)
        named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        if named.get("metrics") != port:
            raise Failed(f"{path} ({container['name']}): port 'metrics' is {named.get('metrics')}, metrics-listen {port}")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            target = container.get(probe, {}).get("httpGet", {}).get("port")
            if target not in ("metrics", port):
                raise Failed(f"{path} ({container['name']}): {probe} goes to {target}, not the metrics port")
        annotations = (resource["spec"].get("template", resource).get("metadata", {}).get("annotations", {}))
        scraped = annotations.get("prometheus.io/port")
        if scraped is not None and int(scraped) != port:
            raise Failed(f"{path}: prometheus.io/port is {scraped}, metrics-listen {port}")
        checked += 1
    print(f"{checked} agent containers probe the port metrics-listen gives")


def test_capabilities():
    unit = unit_capabilities()
    for path, resource, container in agent_containers():
        if resource["kind"] != "DaemonSet":
            continue
        added = set(container["securityContext"]["capabilities"]["add"])
        if added - CONTAINER_ONLY_CAPABILITIES != unit:
            raise Failed(
                f"{path} adds {sorted(added)}, the unit bounds to {sorted(unit)} "
                f"(they differ by more than {sorted(CONTAINER_ONLY_CAPABILITIES)})"
            )
    print(f"the DaemonSet and the unit grant the same capabilities: {' '.join(sorted(unit))}")


def test_images():
    images = set()
    for _, resource in resources():
        spec = pod_spec(resource)
        for container in containers(spec) if spec else []:
            if IMAGE.search(container["image"]):
                images.add(container["image"])
    if len(images) != 1:
        raise Failed(f"the manifests name different devtrace images: {sorted(images)}")
    print(f"one devtrace image: {images.pop()}")


def test_stop_grace():
    pods = set()
    for path, resource, _ in agent_containers():
        grace = pod_spec(resource).get("terminationGracePeriodSeconds", 30)
        if grace < AGENT_STOP_SECONDS:
            raise Failed(
                f"{path}: terminationGracePeriodSeconds {grace} kills a stopping agent "
                f"before its captures in flight end (it needs {AGENT_STOP_SECONDS})"
            )
        pods.add(path)
    with open(UNIT) as f:
        line = next(l for l in f if l.startswith("TimeoutStopSec="))
    timeout = line.split("=", 1)[1].strip()
    if not re.fullmatch(r"\d+s?", timeout) or int(timeout.rstrip("s")) < AGENT_STOP_SECONDS:
        raise Failed(f"{os.path.relpath(UNIT, ROOT)}: TimeoutStopSec={timeout} is under {AGENT_STOP_SECONDS}s")
    print(f"{len(pods)} pod files and the unit give a stopping agent {AGENT_STOP_SECONDS}s or more")
