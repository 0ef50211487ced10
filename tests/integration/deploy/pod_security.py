"""The Pod Security Standards' Baseline and Restricted profiles, applied to rendered pod specs.

No API server can be had here, so a namespace labelled
`pod-security.kubernetes.io/enforce: restricted` cannot admit or refuse the chart's pods.
This is the profile as the Kubernetes documentation ("Pod Security Standards", the
`latest` version: 1.34+, with the Host Probes control) words each control, so that a
test can say which control a manifest breaks, and in which container.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Spec = dict[str, Any]

BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
CONFINED_PROFILES = frozenset({"RuntimeDefault", "Localhost"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")
HANDLERS = ("livenessProbe", "readinessProbe", "startupProbe")


@dataclass(frozen=True)
class Violation:
    profile: str  # "baseline" or "restricted"
    control: str  # the control's name in the Kubernetes documentation
    manifest: str  # Kind/name
    container: str | None  # None: a pod-level field
    detail: str

    def __str__(self) -> str:
        where = f" container {self.container}" if self.container else ""
        return f"{self.profile} / {self.control}: {self.manifest}{where}: {self.detail}"


@dataclass(frozen=True)
class Pod:
    """One pod spec to check: a Pod, or the pod template of a workload."""

    manifest: str
    annotations: dict[str, str]
    spec: Spec

    def containers(self) -> Iterator[Spec]:
        for key in CONTAINER_LISTS:
            yield from self.spec.get(key) or []

    @property
    def context(self) -> Spec:
        context: Spec = self.spec.get("securityContext") or {}
        return context

    @property
    def linux(self) -> bool:
        """The Linux-only controls skip a pod that says it runs on Windows."""
        return (self.spec.get("os") or {}).get("name") != "windows"


def pods(objs: dict[tuple[str, str], dict[str, Any]]) -> list[Pod]:
    """Every pod spec among rendered objects: Pods, and the templates of workloads."""
    found = []
    for (kind, name), obj in sorted(objs.items()):
        template: dict[str, Any] | None = None
        if kind == "Pod":
            template = obj
        elif kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
            template = obj["spec"]["template"]
        elif kind == "CronJob":
            template = obj["spec"]["jobTemplate"]["spec"]["template"]
        if template is not None:
            annotations = (template.get("metadata") or {}).get("annotations") or {}
            found.append(Pod(f"{kind}/{name}", annotations, template["spec"]))
    return found


def context_of(container: Spec) -> Spec:
    context: Spec = container.get("securityContext") or {}
    return context


# -- Baseline ---------------------------------------------------------------------------------

Finding = tuple[str | None, str]  # (container or None, what is wrong)


def host_process(pod: Pod) -> Iterator[Finding]:
    if (pod.context.get("windowsOptions") or {}).get("hostProcess"):
        yield None, "securityContext.windowsOptions.hostProcess is true"
    for c in pod.containers():
        if (context_of(c).get("windowsOptions") or {}).get("hostProcess"):
            yield c["name"], "securityContext.windowsOptions.hostProcess is true"


def host_namespaces(pod: Pod) -> Iterator[Finding]:
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.spec.get(field):
            yield None, f"{field} is true"


def privileged(pod: Pod) -> Iterator[Finding]:
    for c in pod.containers():
        if context_of(c).get("privileged"):
            yield c["name"], "securityContext.privileged is true"


def baseline_capabilities(pod: Pod) -> Iterator[Finding]:
    for c in pod.containers():
        added = set((context_of(c).get("capabilities") or {}).get("add") or [])
        if extra := sorted(added - BASELINE_CAPABILITIES):
            yield c["name"], f"capabilities.add has {extra}, beyond the default set"


def host_path(pod: Pod) -> Iterator[Finding]:
    for volume in pod.spec.get("volumes") or []:
        if "hostPath" in volume:
            yield None, f"volume {volume['name']} is a hostPath"


def host_ports(pod: Pod) -> Iterator[Finding]:
    for c in pod.containers():
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                yield c["name"], f"port {port.get('name', '?')} has hostPort {port['hostPort']}"


def host_probes(pod: Pod) -> Iterator[Finding]:
    for c in pod.containers():
        handlers = {name: c.get(name) for name in HANDLERS}
        lifecycle = c.get("lifecycle") or {}
        handlers |= {f"lifecycle.{hook}": lifecycle.get(hook) for hook in ("postStart", "preStop")}
        for where, handler in handlers.items():
            for kind in ("httpGet", "tcpSocket"):
                if ((handler or {}).get(kind) or {}).get("host"):
                    yield c["name"], f"{where}.{kind}.host is set"


def app_armor(pod: Pod) -> Iterator[Finding]:
    def bad(context: Spec) -> str | None:
        kind = (context.get("appArmorProfile") or {}).get("type")
        return kind if kind is not None and kind not in CONFINED_PROFILES else None

    if kind := bad(pod.context):
        yield None, f"securityContext.appArmorProfile.type is {kind}"
    for c in pod.containers():
        if kind := bad(context_of(c)):
            yield c["name"], f"securityContext.appArmorProfile.type is {kind}"
    for key, value in pod.annotations.items():
        if key.startswith(APPARMOR_ANNOTATION) and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            yield key.removeprefix(APPARMOR_ANNOTATION), f"annotation {key} is {value}"


def se_linux(pod: Pod) -> Iterator[Finding]:
    def bad(context: Spec) -> Iterator[str]:
        options = context.get("seLinuxOptions") or {}
        if options.get("type") not in SELINUX_TYPES | {None}:
            yield f"seLinuxOptions.type is {options['type']}"
        for field in ("user", "role"):
            if options.get(field):
                yield f"seLinuxOptions.{field} is set"

    for problem in bad(pod.context):
        yield None, problem
    for c in pod.containers():
        for problem in bad(context_of(c)):
            yield c["name"], problem


def proc_mount(pod: Pod) -> Iterator[Finding]:
    for c in pod.containers():
        if context_of(c).get("procMount") not in (None, "Default"):
            yield c["name"], f"securityContext.procMount is {context_of(c)['procMount']}"


def baseline_seccomp(pod: Pod) -> Iterator[Finding]:
    if (pod.context.get("seccompProfile") or {}).get("type") == "Unconfined":
        yield None, "securityContext.seccompProfile.type is Unconfined"
    for c in pod.containers():
        if (context_of(c).get("seccompProfile") or {}).get("type") == "Unconfined":
            yield c["name"], "securityContext.seccompProfile.type is Unconfined"


def sysctls(pod: Pod) -> Iterator[Finding]:
    for sysctl in pod.context.get("sysctls") or []:
        if sysctl["name"] not in SAFE_SYSCTLS:
            yield None, f"sysctl {sysctl['name']} is not in the safe set"


# -- Restricted -------------------------------------------------------------------------------


def volume_types(pod: Pod) -> Iterator[Finding]:
    for volume in pod.spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds & RESTRICTED_VOLUMES:
            yield None, f"volume {volume['name']} is a {', '.join(sorted(kinds))}"


def privilege_escalation(pod: Pod) -> Iterator[Finding]:
    if pod.linux:
        for c in pod.containers():
            if context_of(c).get("allowPrivilegeEscalation") is not False:
                yield c["name"], "securityContext.allowPrivilegeEscalation is not false"


def non_root(pod: Pod) -> Iterator[Finding]:
    pod_level = pod.context.get("runAsNonRoot")
    if pod_level is False:
        yield None, "securityContext.runAsNonRoot is false"
    for c in pod.containers():
        own = context_of(c).get("runAsNonRoot")
        if own is False or (own is None and pod_level is not True):
            yield c["name"], "runAsNonRoot is not true (neither the container nor the pod)"


def non_root_user(pod: Pod) -> Iterator[Finding]:
    if pod.context.get("runAsUser") == 0:
        yield None, "securityContext.runAsUser is 0"
    for c in pod.containers():
        if context_of(c).get("runAsUser") == 0:
            yield c["name"], "securityContext.runAsUser is 0"


def restricted_seccomp(pod: Pod) -> Iterator[Finding]:
    if not pod.linux:
        return
    pod_level = (pod.context.get("seccompProfile") or {}).get("type")
    if pod_level is not None and pod_level not in CONFINED_PROFILES:
        yield None, f"securityContext.seccompProfile.type is {pod_level}"
    for c in pod.containers():
        own = (context_of(c).get("seccompProfile") or {}).get("type")
        if own is None and pod_level is None:
            yield c["name"], "no seccompProfile (neither the container nor the pod)"
        elif own is not None and own not in CONFINED_PROFILES:
            yield c["name"], f"securityContext.seccompProfile.type is {own}"


def restricted_capabilities(pod: Pod) -> Iterator[Finding]:
    if not pod.linux:
        return
    for c in pod.containers():
        capabilities = context_of(c).get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            yield c["name"], "capabilities.drop does not include ALL"
        if extra := sorted(set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}):
            yield c["name"], f"capabilities.add has {extra}; only NET_BIND_SERVICE may be added"


Control = Callable[[Pod], Iterator[Finding]]

BASELINE: dict[str, Control] = {
    "HostProcess": host_process,
    "Host Namespaces": host_namespaces,
    "Privileged Containers": privileged,
    "Capabilities": baseline_capabilities,
    "HostPath Volumes": host_path,
    "Host Ports": host_ports,
    "Host Probes / Lifecycle Hooks": host_probes,
    "AppArmor": app_armor,
    "SELinux": se_linux,
    "/proc Mount Type": proc_mount,
    "Seccomp": baseline_seccomp,
    "Sysctls": sysctls,
}
RESTRICTED: dict[str, Control] = {
    "Volume Types": volume_types,
    "Privilege Escalation": privilege_escalation,
    "Running as Non-root": non_root,
    "Running as Non-root user": non_root_user,
    "Seccomp": restricted_seccomp,
    "Capabilities": restricted_capabilities,
}


def violations(pod: Pod) -> list[Violation]:
    """What keeps `pod` out of the Restricted profile (which includes Baseline)."""
    found = []
    for profile, controls in (("baseline", BASELINE), ("restricted", RESTRICTED)):
        for control, check in controls.items():
            for container, detail in check(pod):
                found.append(Violation(profile, control, pod.manifest, container, detail))
    return found
