"""A container of the rendered chart, run from the built image as a kubelet would run it.

No Kubernetes API server can be had here, so the kubelet's part is done by hand with buildah
(`buildah run --isolation chroot`, the one isolation that works on these machines; see
docs/deploy.md): the container's command and args over the image's ENTRYPOINT and CMD, its
environment with the Secret's keys and the pod's name (downward API) filled in, the ConfigMap
and emptyDir volumes at their mount paths, and the user and group of its securityContext.
What buildah cannot apply (seccomp, no_new_privs, a read-only root filesystem, resource
limits) the callers check another way or leave out, as docs/deploy.md says.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from relay.errors import RelayError

Objects = Mapping[tuple[str, str], dict[str, Any]]

# Kernel and runtime file systems, not the image's: left out of a snapshot.
PSEUDO = frozenset({"proc", "sys", "dev", "run"})


class PodError(RelayError):
    """The rendered pod asks for something this runner does not do."""


@dataclass(frozen=True)
class Pod:
    """One rendered pod template, the objects it refers to, the name the pod would get and
    its namespace."""

    spec: dict[str, Any]
    objects: Objects
    name: str
    namespace: str

    def field(self, path: str) -> str:
        """A downward-API field: the pod's name or namespace."""
        fields = {"metadata.name": self.name, "metadata.namespace": self.namespace}
        if path not in fields:
            raise PodError(f"fieldRef {path} is not supported here")
        return fields[path]

    def container(self, name: str, key: str = "containers") -> dict[str, Any]:
        (found,) = [c for c in self.spec.get(key, []) if c["name"] == name]
        container: dict[str, Any] = found
        return container


def argv(container: Mapping[str, Any], config: Mapping[str, Any]) -> list[str]:
    """What Kubernetes runs: `command` replaces the ENTRYPOINT, `args` the CMD; a `command`
    without `args` drops the image's CMD."""
    entrypoint = container.get("command") or config.get("Entrypoint") or []
    if "args" in container:
        args = container["args"]
    elif "command" in container:
        args = []
    else:
        args = config.get("Cmd") or []
    return [*entrypoint, *args]


def environment(pod: Pod, container: Mapping[str, Any]) -> dict[str, str]:
    """The container's `env`, each `valueFrom` resolved as the kubelet would."""
    if container.get("envFrom"):
        raise PodError(f"container {container['name']}: envFrom is not supported here")
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        source = entry.get("valueFrom", {})
        if "fieldRef" in source:
            env[entry["name"]] = pod.field(source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source:
            env[entry["name"]] = secret_value(pod.objects, source["secretKeyRef"])
        else:
            raise PodError(f"env {entry['name']}: unsupported source {sorted(source)}")
    return env


def secret_value(objects: Objects, ref: Mapping[str, Any]) -> str:
    secret = objects.get(("Secret", ref["name"]))
    if secret is None:
        raise PodError(f"Secret {ref['name']} is not among the rendered objects")
    if ref["key"] in secret.get("stringData", {}):
        return str(secret["stringData"][ref["key"]])
    if ref["key"] in secret.get("data", {}):
        return base64.b64decode(secret["data"][ref["key"]]).decode()
    raise PodError(f"Secret {ref['name']} has no key {ref['key']}")


def volume_mounts(pod: Pod, container: Mapping[str, Any], where: Path) -> list[tuple[Path, str]]:
    """(host directory, mount path) per volume mount: a ConfigMap's keys written as files
    (0644, as its default mode), an emptyDir as a fresh directory anyone may write (0777)."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    mounts: list[tuple[Path, str]] = []
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        host = where / mount["name"]
        host.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            config_map = pod.objects[("ConfigMap", volume["configMap"]["name"])]
            for key, text in config_map.get("data", {}).items():
                (host / key).write_text(text, encoding="utf-8")
                (host / key).chmod(0o644)
            host.chmod(0o755)
        elif "emptyDir" in volume:
            host.chmod(0o777)
        else:
            raise PodError(f"volume {mount['name']}: only configMap and emptyDir are supported")
        mounts.append((host, mount["mountPath"]))
    return mounts


def user(pod: Pod, container: Mapping[str, Any]) -> str:
    """uid:gid from the container's securityContext over the pod's, as Kubernetes merges them."""
    merged = {**pod.spec.get("securityContext", {}), **container.get("securityContext", {})}
    if "runAsUser" not in merged:
        raise PodError(f"container {container['name']}: no runAsUser in its securityContext")
    return f"{merged['runAsUser']}:{merged.get('runAsGroup', merged['runAsUser'])}"


def port_of(container: Mapping[str, Any], probe: str) -> tuple[int, str]:
    """The (port, path) a probe's httpGet names; a port name is looked up in `ports`."""
    get = container[probe]["httpGet"]
    port = get["port"]
    if isinstance(port, str):
        (port,) = [p["containerPort"] for p in container.get("ports", []) if p["name"] == port]
    return int(port), str(get["path"])


class Buildah:
    """A working container from a local image: what it is configured with, and its runs."""

    def __init__(self, image: str) -> None:
        self.image = image
        self.id = _output("buildah", "from", "--pull=never", image)
        self.root = Path(_output("buildah", "mount", self.id))

    def config(self) -> dict[str, Any]:
        """The image's OCI config (Entrypoint, Cmd, Env, Labels, User, WorkingDir)."""
        data = json.loads(_output("buildah", "inspect", "--type", "image", self.image))
        config: dict[str, Any] = data["OCIv1"]["config"]
        return config

    def command(self, pod: Pod, container: Mapping[str, Any], where: Path) -> list[str]:
        """The `buildah run` of `container` of `pod`, its volumes made under `where`."""
        command = ["buildah", "run", "--isolation", "chroot", "--cap-drop", "all"]
        command += ["--user", user(pod, container)]
        for host, path in volume_mounts(pod, container, where):
            mode = "ro" if _read_only(container, path) else "rw"
            command += ["--volume", f"{host}:{path}:{mode}"]
        for key, value in environment(pod, container).items():
            command += ["--env", f"{key}={value}"]
        return [*command, self.id, "--", *argv(container, self.config())]

    def run_as(self, user: str) -> list[str]:
        """`buildah run` as `user`, to be followed by the command."""
        return ["buildah", "run", "--isolation", "chroot", "--user", user, self.id, "--"]

    def remove(self) -> None:
        subprocess.run(["buildah", "rm", self.id], capture_output=True, check=False)


def _read_only(container: Mapping[str, Any], path: str) -> bool:
    return any(
        m["mountPath"] == path and m.get("readOnly") for m in container.get("volumeMounts", [])
    )


def _output(*command: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PodError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result.stdout.strip()


class Running:
    """A `buildah run` in the background, its output in a file."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log = log
        self._out: IO[bytes] = log.open("wb")
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, stdout=self._out, stderr=subprocess.STDOUT)

    def init_pid(self) -> int:
        """The container's first process (tini): the one the kubelet's SIGTERM goes to.

        buildah's chroot isolation starts it from a `buildah-chroot-exec` process of its own.
        """
        for pid in _descendants(self.process.pid):
            if _argv0(pid) == "buildah-chroot-exec" and _children(pid):
                return _children(pid)[0]
        raise PodError(f"no container process under buildah run ({self.process.pid})")

    def terminate(self) -> None:
        os.kill(self.init_pid(), signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is not None:
                self._out.close()

    def kill(self) -> None:
        """SIGKILL to the container's processes and buildah's, the deepest first: killing
        `buildah run` alone would leave the relay running."""
        if self.process.poll() is None:
            for pid in reversed([self.process.pid, *_descendants(self.process.pid)]):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.process.wait()
        self._out.close()


def _descendants(pid: int) -> list[int]:
    """Every process under `pid`, parents before their children."""
    found: list[int] = []
    pending = _children(pid)
    while pending:
        current = pending.pop(0)
        found.append(current)
        pending += _children(current)
    return found


def _children(pid: int) -> list[int]:
    children: list[int] = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):  # any thread's children
        try:
            children += [int(child) for child in listing.read_text().split()]
        except OSError:  # the thread or the process ended
            continue
    return children


def _argv0(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def snapshot(root: Path, skip: frozenset[str] = PSEUDO) -> dict[str, tuple[int, int, int]]:
    """Every path under `root` but the skipped top-level names: (mode, size, mtime in ns)."""
    found: dict[str, tuple[int, int, int]] = {}
    for directory, dirs, files in os.walk(root):
        relative = Path(directory).relative_to(root)
        if relative == Path("."):
            dirs[:] = [d for d in dirs if d not in skip]
        for name in [*dirs, *files]:
            path = Path(directory) / name
            info = path.lstat()
            found[str(relative / name)] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found
