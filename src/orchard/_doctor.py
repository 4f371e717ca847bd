"""``orchard doctor``: what each backend needs here, checked in order, then one sandbox per backend.

Every check runs under a deadline of its own, so a dead or silent service fails
its check within seconds rather than after the library's retries; a check whose
prerequisite failed is skipped and names that check. The report is a table on
a terminal, one plain line per check otherwise, or JSON with ``--json``
(``{"ok": bool, "checks": [{"backend", "check", "status", "detail", "fix"}]}``).
The exit status is 1 when a check failed; warnings do not count.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ._backends import DockerConfig, KubernetesConfig
    from ._backends.docker_engine import Engine
    from ._backends.kubernetes import KubernetesBackend
    from ._client import Client
    from .errors import OrchardError

Status = Literal["pass", "fail", "warn", "skip"]

BACKENDS = ("local", "docker", "kubernetes")
#: The trial sandbox's image on docker and kubernetes: scripts/docker-setup.sh builds it, and the dev
#: cluster's ``devcluster up`` imports it into the node's containerd.
TRIAL_IMAGE = "orchard-test/busybox:latest"
#: An argv, so that it runs in images without a shell.
TRIAL_COMMAND = ["echo", "orchard doctor"]
#: Seconds one call to the Docker engine or the Kubernetes API server may take.
API_DEADLINE = 5.0
#: Seconds a local program run once (bwrap, slirp4netns) may take.
PROBE_DEADLINE = 10.0
#: Seconds each backend's trial sandbox may take, from the Client's start to the command's answer.
SANDBOX_DEADLINE = {"local": 30.0, "docker": 60.0, "kubernetes": 90.0}
#: The kubelet reports at most this many images per node by default (nodeStatusMaxImages), the largest first.
NODE_IMAGES_CAP = 50
#: The label naming the Pod Security level a namespace enforces.
_PSA_ENFORCE = "pod-security.kubernetes.io/enforce"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a check found: its status, what it saw, and what fixes it (a command or an option)."""

    status: Status
    detail: str
    fix: str = ""


def passed(detail: str) -> Outcome:
    """A check that found what it needs."""
    return Outcome("pass", detail)


def warned(detail: str, fix: str = "") -> Outcome:
    """Works, but not as well as it could, or cannot be told from here."""
    return Outcome("warn", detail, fix)


def failed(detail: str, fix: str) -> Outcome:
    """Sandboxes of this backend cannot work until ``fix`` is done."""
    return Outcome("fail", detail, fix)


@dataclasses.dataclass(frozen=True)
class Check:
    """One line of the report."""

    backend: str
    check: str
    status: Status
    detail: str
    fix: str


class Report:
    """Collects the checks and shows them on stdout.

    One plain line per check as it ends (not a terminal), a table at the end (a terminal), or JSON. Progress,
    a spinner naming the running check, goes to a terminal's stderr; ``quiet`` drops it and the summary line.
    """

    def __init__(self, *, as_json: bool, quiet: bool, debug: bool) -> None:
        self.checks: list[Check] = []
        self.debug = debug
        self._quiet = quiet
        self._json = as_json
        self._table = not as_json and sys.stdout.isatty()
        self._spinner: Any = None
        if not quiet and sys.stderr.isatty():
            from ._console import console

            self._spinner = console(sys.stderr).status("orchard doctor")
            self._spinner.start()

    def starting(self, backend: str, check: str) -> None:
        """A check begins."""
        if self._spinner is not None:
            self._spinner.update(f"orchard doctor: {backend} {check}")

    def add(self, check: Check) -> None:
        """A check ended."""
        self.checks.append(check)
        if not self._json and not self._table:
            print(plain_line(check), flush=True)

    @property
    def ok(self) -> bool:
        """Whether no check failed."""
        return all(c.status != "fail" for c in self.checks)

    def finish(self) -> None:
        """Show what was not streamed, and the summary line."""
        if self._spinner is not None:
            self._spinner.stop()
        if self._json:
            body = {"ok": self.ok, "checks": [dataclasses.asdict(c) for c in self.checks]}
            print(json.dumps(body, indent=2), flush=True)
            return
        if self._table:
            self._print_table()
        if not self._quiet:
            counts = [sum(c.status == s for c in self.checks) for s in ("pass", "warn", "fail", "skip")]
            words = ("passed", "warned", "failed", "skipped")
            summary = ", ".join(f"{n} {word}" for n, word in zip(counts, words, strict=True))
            print(f"orchard doctor: {summary}", flush=True)

    def _print_table(self) -> None:
        from rich import box
        from rich.table import Table
        from rich.text import Text

        from ._console import console

        styles = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
        # Details and fixes wrap within their columns; a blank line between checks keeps them apart.
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, show_lines=True, header_style="bold")
        for column in ("backend", "check", "status", "detail", "fix"):
            table.add_column(column.upper(), overflow="fold", no_wrap=column in ("backend", "check", "status"))
        for c in self.checks:
            table.add_row(c.backend, c.check, Text(c.status.upper(), styles[c.status]), c.detail, c.fix)
        console(sys.stdout).print(table)


def plain_line(check: Check) -> str:
    """A check as one line of text: ``FAIL docker/engine: what was seen | fix: what to do``."""
    line = f"{check.status.upper()} {check.backend}/{check.check}: {check.detail}"
    return f"{line} | fix: {check.fix}" if check.fix else line


class Checks:
    """The checks of one backend, run in order, each under its deadline; skipped when one it needs did not pass."""

    def __init__(self, backend: str, report: Report) -> None:
        self.backend = backend
        self._report = report
        #: For each check that failed or was skipped, the failed check at the root of it.
        self._broken: dict[str, str] = {}

    async def run(
        self,
        name: str,
        check: Callable[[], Awaitable[Outcome]],
        *,
        deadline: float,
        needs: Sequence[str] = (),
        late: Outcome | None = None,
    ) -> Outcome:
        """Run ``check`` within ``deadline`` seconds; past it, ``late`` (or a generic failure) is the outcome."""
        self._report.starting(self.backend, name)
        cause = next((self._broken[n] for n in needs if n in self._broken), None)
        if cause is not None:
            outcome = Outcome("skip", f"not run: the {cause} check failed")
        else:
            try:
                outcome = await asyncio.wait_for(check(), deadline)
            except TimeoutError:
                outcome = late or failed(f"did not finish within {deadline:g} s", "")
            except Exception as exc:  # a check's own bug or an unforeseen error: reported, not a traceback
                if self._report.debug:
                    traceback.print_exc()
                outcome = failed(f"{type(exc).__name__}: {exc}", "")
        if outcome.status == "fail":
            self._broken[name] = name
        elif outcome.status == "skip":
            self._broken[name] = cause or name
        # One line each, whatever an error's message spans (a YAML parser's runs over three).
        detail, fix = (" ".join(text.split()) for text in (outcome.detail, outcome.fix))
        self._report.add(Check(self.backend, name, outcome.status, detail, fix))
        return outcome


async def _run_program(argv: list[str]) -> tuple[int, str]:
    """Run a program to its end; its exit status and its output (stdout then stderr), stripped.

    Killed if the caller's deadline cancels it.
    """
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await proc.communicate()
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace").strip()


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


# -- local --

_LOCAL_FIX = "LocalConfig(root=DIR) for sandbox directories elsewhere; LocalConfig(fork=False) for fresh executors"
_UNISOLATED = "or LocalConfig(isolation='none') to run sandbox commands on the host unisolated (trusted code only)"


class _Local:
    """The local backend: Python, bubblewrap and what ``isolation="auto"`` gives, slirp4netns, one sandbox."""

    async def run(self, checks: Checks) -> None:
        await checks.run("python", self.python, deadline=PROBE_DEADLINE)
        await checks.run("bubblewrap", self.bubblewrap, deadline=PROBE_DEADLINE)
        await checks.run("isolation", self.isolation, deadline=PROBE_DEADLINE * 3, needs=["bubblewrap"])
        await checks.run("slirp4netns", self.slirp4netns, deadline=PROBE_DEADLINE)
        await checks.run("sandbox", self.sandbox, deadline=SANDBOX_DEADLINE["local"], needs=["isolation"])

    async def python(self) -> Outcome:
        # Orchard installs (requires-python) and imports on 3.11 or later only: this says which one runs it,
        # and so runs each executor (LocalConfig.python defaults to it).
        version = ".".join(map(str, sys.version_info[:3]))
        return passed(f"Python {version} at {sys.executable} (3.11 or later needed)")

    async def bubblewrap(self) -> Outcome:
        from ._backends.local import _namespaces

        bwrap = shutil.which("bwrap")
        if bwrap is None:
            return failed(
                "bwrap is not on PATH, so isolation='auto' (the default) cannot start a sandbox",
                f"apt-get install bubblewrap, {_UNISOLATED}",
            )
        as_root = os.getuid() == 0
        # The probe find_isolation makes: the namespaces a sandbox gets, around `true`.
        probe = [bwrap, *_namespaces(as_root), "--ro-bind", "/", "/", "--proc", "/proc", "--", "true"]
        status, output = await _run_program(probe)
        if status != 0:
            return failed(
                f"{bwrap} cannot create a sandbox's namespaces here (exit {status}: {_last_line(output)}), "
                "so isolation='auto' cannot start a sandbox",
                "allow namespaces where the client runs (not an unprivileged container; sysctl "
                f"user.max_user_namespaces > 0 and, without root, kernel.unprivileged_userns_clone=1), {_UNISOLATED}",
            )
        _, version = await _run_program([bwrap, "--version"])
        return passed(f"{_last_line(version)} at {bwrap} creates a sandbox's namespaces")

    async def isolation(self) -> Outcome:
        from ._backends import LocalConfig
        from ._backends.local import find_isolation
        from .errors import ConfigError

        try:  # bounded by its own probe's timeout; the bubblewrap check just ran that probe within its deadline
            found = find_isolation("auto")
        except ConfigError as exc:
            return failed(f"isolation='auto' raises ConfigError: {exc}", "apt-get install util-linux bubblewrap")
        assert found is not None
        if found[1] is not None:
            who = f"as uid {LocalConfig().uid} (LocalConfig.uid), dropped to by {found[1]} (the client runs as root)"
        else:
            who = f"as your uid {os.getuid()} in a user namespace"
        return passed(f"isolation='auto' gives 'bwrap': own namespaces, a root from an allowlist, {who}")

    async def slirp4netns(self) -> Outcome:
        from ._backends.local import find_slirp4netns
        from .errors import ConfigError

        try:
            slirp = find_slirp4netns()
        except ConfigError:
            return warned(
                "no slirp4netns from /usr on PATH: isolated sandboxes with network=True fail "
                "(without network they work, loopback only)",
                "apt-get install slirp4netns",
            )
        status, output = await _run_program([slirp, "--version"])
        if status != 0:
            return warned(
                f"{slirp} --version failed (exit {status}: {_last_line(output)})", "apt-get install slirp4netns"
            )
        version = output.splitlines()[0] if output else "slirp4netns"
        return passed(f"{version} at {slirp}: network=True works on isolated sandboxes")

    async def sandbox(self) -> Outcome:
        from ._client import Client

        return await _trial(Client("local"), "local", {}, fix=lambda _: _LOCAL_FIX)


async def _trial(client: Client, image: str, spec: dict[str, Any], *, fix: Callable[[OrchardError], str]) -> Outcome:
    """Start one sandbox on ``client``, run ``TRIAL_COMMAND`` in it, close both; the timings and the route taken."""
    from .errors import CommandNotFound, OrchardError

    t0 = time.monotonic()
    try:
        async with client:
            async with client.sandbox(image, **spec) as sb:
                started = time.monotonic() - t0
                t1 = time.monotonic()
                try:
                    result = await sb.exec(TRIAL_COMMAND, timeout=10)
                except CommandNotFound:
                    ran = f"the image has no {TRIAL_COMMAND[0]!r}, but its executor answered"
                else:
                    if result.exit_code != 0 or result.stdout.strip() != TRIAL_COMMAND[1]:
                        return failed(
                            f"{' '.join(TRIAL_COMMAND)!r} exited {result.exit_code} with {result.stdout!r}",
                            "--image with a working echo",
                        )
                    ran = f"{' '.join(TRIAL_COMMAND)!r} answered in {(time.monotonic() - t1) * 1000:.0f} ms"
            how = _reached(client)
    except OrchardError as exc:
        return failed(f"{type(exc).__name__}: {exc}", fix(exc))
    return passed(f"started in {started * 1000:.0f} ms{how}; {ran}")


def _reached(client: Client) -> str:
    """How the client's backend ran and reached its sandbox, as the backend decided it on this first sandbox."""
    backend = client._backend
    if backend is None or backend.name == "local":
        return ""
    if backend.name == "docker":
        from ._backends.docker import DockerBackend

        assert isinstance(backend, DockerBackend)
        return " over a unix socket" if backend.unix else " over TLS at the container's address"
    from ._backends.kubernetes import KubernetesBackend

    assert isinstance(backend, KubernetesBackend)
    injection = "an image volume" if backend.image_volumes else "an init container's copy"
    if backend.transport == "direct":
        route = "reached directly at the pod IP"
    else:
        route = "pod IPs are not routable from here: reached through a port-forward via the API server (slower)"
    return f", the runtime from {injection}, {route}"


# -- docker --


class _Docker:
    """The docker backend: the engine and its version, the injector and trial images, one sandbox."""

    def __init__(self, image: str) -> None:
        from ._backends import DockerConfig

        self.config: DockerConfig = DockerConfig()
        self.image = image
        self.engine: Engine | None = None
        self.address = self.config.host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"

    async def run(self, checks: Checks) -> None:
        try:
            # The request's own timeout ends a silent engine first; the deadline is a backstop.
            await checks.run("engine", self.version, deadline=API_DEADLINE + 1)
            await checks.run("injector-image", self.injector_image, deadline=API_DEADLINE, needs=["engine"])
            await checks.run("trial-image", self.trial_image, deadline=API_DEADLINE, needs=["engine"])
            await checks.run(
                "sandbox", self.sandbox, deadline=SANDBOX_DEADLINE["docker"], needs=["injector-image", "trial-image"]
            )
        finally:
            if self.engine is not None:
                await self.engine.close()

    async def version(self) -> Outcome:
        from ._backends.docker_engine import API_VERSION, DockerError, Engine
        from .errors import ConfigError

        try:
            self.engine = Engine(self.config.host)
        except ConfigError as exc:
            return failed(str(exc), "DOCKER_HOST=unix:///var/run/docker.sock (or tcp://HOST:PORT)")
        late = failed(
            f"the Docker engine at {self.address} did not answer within {API_DEADLINE:g} s",
            "restart dockerd, or point DOCKER_HOST (DockerConfig(host=...)) at an engine that answers",
        )
        try:
            info = json.loads(await self.engine.request("GET", "/version", timeout=API_DEADLINE))
        except TimeoutError:
            return late
        except DockerError as exc:
            if isinstance(exc.__cause__, TimeoutError):
                return late
            if exc.status:
                return failed(
                    f"the engine at {self.address} refused Engine API {API_VERSION}: {exc.message}",
                    "Docker 20.10 or later",
                )
            why = exc.__cause__ or exc
            return failed(
                f"cannot reach the Docker engine at {self.address}: {why}",
                "start dockerd (scripts/docker-setup.sh installs and starts one), or point DOCKER_HOST "
                "(DockerConfig(host=...)) at a running engine",
            )
        return passed(f"Docker {info.get('Version')} (API {info.get('ApiVersion')}) at {self.address}")

    async def _image(self, image: str, fix: str) -> Outcome:
        assert self.engine is not None
        image_id = await self.engine.image_id(image)
        if image_id is None:
            return failed(f"{image} is not on the engine (doctor does not pull)", fix)
        return passed(f"{image} ({image_id.removeprefix('sha256:')[:12]})")

    async def injector_image(self) -> Outcome:
        image = self.config.injector_image
        return await self._image(
            image,
            f"scripts/docker-setup.sh (no registry needed), or docker build -f Dockerfile.executor -t {image} .",
        )

    async def trial_image(self) -> Outcome:
        fix = f"docker pull {self.image}, or --image IMAGE for an image the engine has"
        if self.image == TRIAL_IMAGE:
            fix = f"scripts/docker-setup.sh (builds {TRIAL_IMAGE}), or --image IMAGE for an image the engine has"
        return await self._image(self.image, fix)

    async def sandbox(self) -> Outcome:
        from ._client import Client

        spec = {"image_pull_policy": "Never", "start_timeout": SANDBOX_DEADLINE["docker"], "ttl": 300}
        fix = f"docker run --rm {self.image} echo ok shows whether the engine runs the image; or --image IMAGE"
        return await _trial(Client(self.config), self.image, spec, fix=lambda _: fix)


# -- kubernetes --


class _Kubernetes:
    """The kubernetes backend: credentials, the API server, the namespace and RBAC, images, policies, one sandbox."""

    def __init__(self, args: argparse.Namespace, image: str) -> None:
        from ._backends import KubernetesConfig

        self.config: KubernetesConfig = KubernetesConfig(
            namespace=args.namespace, kubeconfig=args.kubeconfig, context=args.context
        )
        self.image = image
        self.backend: KubernetesBackend | None = None
        self.server = "the API server"
        self.version: tuple[int, int] | None = None
        self.git_version = ""

    @property
    def namespace(self) -> str:
        return self.config.namespace

    @property
    def api(self) -> Any:
        assert self.backend is not None
        return self.backend._api

    async def run(self, checks: Checks) -> None:
        deadline = API_DEADLINE * 2  # a check may make a few calls

        async def ask(name: str, check: Callable[[], Awaitable[Outcome]], needs: str) -> None:
            late = failed(
                f"{self.server} did not answer within {deadline:g} s",
                "check the cluster is up and reachable from here: kubectl cluster-info",
            )
            await checks.run(name, check, deadline=deadline, needs=[needs], late=late)

        try:
            await checks.run("kubeconfig", self.kubeconfig, deadline=deadline)
            await ask("api-server", self.api_server, "kubeconfig")
            await ask("namespace", self.namespace_exists, "api-server")
            await ask("rbac", self.rbac, "api-server")
            await ask("injector-image", self.injector_image, "api-server")
            await ask("trial-image", self.trial_image, "api-server")
            await ask("image-volumes", self.image_volumes, "namespace")
            await ask("network-policies", self.network_policies, "namespace")
            await checks.run(
                "sandbox", self.sandbox, deadline=SANDBOX_DEADLINE["kubernetes"], needs=["namespace", "rbac"]
            )
        finally:
            if self.backend is not None:
                await self.backend._close_api()

    async def kubeconfig(self) -> Outcome:
        from ._backends.kubernetes import KubernetesBackend
        from .errors import ConfigError

        backend = KubernetesBackend(self.config, session_id="doctor")
        where = self.config.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        try:
            await backend._load()
        except ConfigError as exc:
            # Caused: the file is there but does not load. Uncaused: there is no file.
            detail = f"no kubeconfig: {where} does not exist"
            if exc.__cause__ is not None:
                context = self.config.context or "its current context"
                detail = f"cannot load {where} ({context}): {exc.__cause__}"
            return failed(
                detail,
                "--kubeconfig PATH (or $KUBECONFIG; default ~/.kube/config), and --context NAME for another context",
            )
        self.backend = backend
        self.server = str(self.api.configuration.host)
        return passed(
            f"{where}: server {self.server}" + (f", context {self.config.context}" if self.config.context else "")
        )

    async def api_server(self) -> Outcome:
        from kubernetes_asyncio import client

        try:
            info = await client.VersionApi(self.api).get_code(_request_timeout=API_DEADLINE)
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status in (401, 403):
                return failed(
                    f"{self.server} refused the kubeconfig's credentials: {_k8s_error(exc)}",
                    "refresh the kubeconfig's credentials (e.g. your cloud CLI's get-credentials)",
                )
            return failed(
                f"{self.server} did not answer: {_k8s_error(exc)}",
                "check the cluster is up and its address reachable from here: kubectl cluster-info",
            )
        self.git_version = str(info.git_version)
        major, minor = (int("".join(ch for ch in str(part) if ch.isdigit()) or 0) for part in (info.major, info.minor))
        self.version = (major, minor)
        return passed(f"Kubernetes {self.git_version} at {self.server}")

    async def namespace_exists(self) -> Outcome:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            ns = await client.CoreV1Api(self.api).read_namespace(self.namespace, _request_timeout=API_DEADLINE)
        except ApiException as exc:
            if exc.status == 404:
                return failed(
                    f"namespace {self.namespace!r} does not exist",
                    f"kubectl create namespace {self.namespace}, or a cluster admin runs `orchard k8s setup -n "
                    f"{self.namespace} --create-namespace` (also labels it for Pod Security and writes the client Role "
                    "and NetworkPolicies)",
                )
            if exc.status == 403:
                return warned(
                    f"may not read namespace {self.namespace!r} ({_k8s_error(exc)}): the sandbox check shows "
                    "whether it exists"
                )
            raise
        enforce = (ns.metadata.labels or {}).get(_PSA_ENFORCE)
        labels = f"Pod Security enforce={enforce}" if enforce else "no Pod Security label"
        return passed(f"namespace {self.namespace!r} exists ({labels})")

    async def _whoami(self) -> str | None:
        from kubernetes_asyncio import client

        try:
            review = await client.AuthenticationV1Api(self.api).create_self_subject_review(
                client.V1SelfSubjectReview(), _request_timeout=API_DEADLINE
            )
        except Exception:  # before Kubernetes 1.28, or not allowed: the fix then names no subject
            return None
        return str(review.status.user_info.username)

    async def rbac(self) -> Outcome:
        from kubernetes_asyncio import client

        from ._backends.k8s_pod import client_role

        wanted = [
            (verb, rule["apiGroups"][0], resource)
            for rule in client_role(self.namespace)["rules"]
            for resource in rule["resources"]
            for verb in rule["verbs"]
        ]
        authz = client.AuthorizationV1Api(self.api)

        async def allowed(verb: str, group: str, resource: str) -> bool:
            kind, _, sub = resource.partition("/")
            attributes = client.V1ResourceAttributes(
                namespace=self.namespace, verb=verb, group=group, resource=kind, subresource=sub or None
            )
            body = client.V1SelfSubjectAccessReview(
                spec=client.V1SelfSubjectAccessReviewSpec(resource_attributes=attributes)
            )
            review = await authz.create_self_subject_access_review(body, _request_timeout=API_DEADLINE)
            return bool(review.status.allowed)

        user = await self._whoami()
        answers = await asyncio.gather(*(allowed(*w) for w in wanted))
        who = f" as {user}" if user else ""
        missing = [f"{verb} {resource}" for (verb, _, resource), ok in zip(wanted, answers, strict=True) if not ok]
        if not missing:
            return passed(f"all {len(wanted)} permissions of the orchard-client Role in {self.namespace}{who}")
        return failed(
            f"{len(missing)} of the orchard-client Role's {len(wanted)} permissions missing in {self.namespace}"
            f"{who}: {', '.join(missing)}",
            self._rbac_fix(user),
        )

    def _rbac_fix(self, user: str | None) -> str:
        ns = self.namespace
        setup = f"a cluster admin runs `orchard k8s setup -n {ns}"
        if user and user.startswith("system:serviceaccount:"):
            sa_namespace, _, sa = user.removeprefix("system:serviceaccount:").partition(":")
            if sa_namespace == ns:
                return f"{setup} --service-account {sa}`"
            return f"{setup}`, then `kubectl create rolebinding orchard-client-{sa} -n {ns} --role orchard-client --serviceaccount {sa_namespace}:{sa}`"
        subject = user or "USER"
        return f"{setup}`, then `kubectl create rolebinding orchard-client -n {ns} --role orchard-client --user {subject}` (or --service-account SA with setup)"

    async def _on_nodes(self, image: str, fix: str) -> Outcome:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            nodes = (await client.CoreV1Api(self.api).list_node(_request_timeout=API_DEADLINE)).items
        except ApiException as exc:
            if exc.status == 403:
                return warned(f"may not list nodes ({_k8s_error(exc)}): not checked; the sandbox check shows it")
            raise
        want = normalized_image(image)
        has = [n.metadata.name for n in nodes if want in _node_images(n)]
        lacks = [n.metadata.name for n in nodes if n.metadata.name not in has]
        if not lacks:
            return passed(f"{image} is on every node ({', '.join(has)})")
        capped = [n.metadata.name for n in nodes if len(n.status.images or []) >= NODE_IMAGES_CAP]
        maybe = (
            f"; {', '.join(capped)} list {NODE_IMAGES_CAP} images, the kubelet's default cap, so it may be there unlisted"
            if capped
            else ""
        )
        where = "on no node" if not has else f"not on {', '.join(lacks)} ({len(has)} of {len(nodes)} nodes have it)"
        return warned(
            f"{image} is {where}: a pod pulls it where it is missing (IfNotPresent), from a registry that must "
            f"serve it{maybe}",
            fix,
        )

    async def injector_image(self) -> Outcome:
        image = self.config.injector_image
        return await self._on_nodes(
            image,
            "push it to a registry the nodes pull from and use KubernetesConfig(injector_image=REGISTRY/...), or "
            "import it into each node's runtime (on the dev cluster: hack/devcluster/devcluster up)",
        )

    async def trial_image(self) -> Outcome:
        fix = "--image IMAGE for an image the nodes have or can pull"
        if self.image == TRIAL_IMAGE:
            fix = f"scripts/docker-setup.sh then hack/devcluster/devcluster up (imports {TRIAL_IMAGE}), or {fix}"
        return await self._on_nodes(self.image, fix)

    async def image_volumes(self) -> Outcome:
        from ._spec import make_spec

        no_volumes = "injection='auto' copies the runtime with an init container (about a second more per start)"
        fix = (
            "Kubernetes 1.35+ (or 1.33+ with the ImageVolume feature gate) and a runtime with image volumes "
            "(containerd 2.1+, CRI-O 1.31+)"
        )
        if self.version is not None and self.version < (1, 33):
            return warned(f"Kubernetes {self.git_version} has no image volumes: {no_volumes}", fix)
        assert self.backend is not None
        # The backend's own question, asked the same way: a dry-run create of a pod with the runtime as an image volume.
        manifest = self.backend._manifest(
            make_spec(self.image, {}), "orchard-doctor-probe", "0" * 64, None, image_volumes=True
        )
        accepted = await self.backend._dry_run(manifest)
        if accepted is None:
            return warned(
                "the API server refused the dry-run pod for a reason other than its volumes, so cannot tell "
                "(the sandbox check shows the reason)"
            )
        if not accepted:
            return warned(f"the API server ({self.git_version}) refuses image volumes: {no_volumes}", fix)
        return passed(
            f"the API server ({self.git_version}) accepts image volumes: injection='auto' mounts the runtime from "
            "the node's copy of the injector image (whether the runtime can, the sandbox check shows)"
        )

    async def network_policies(self) -> Outcome:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        from ._backends.k8s_pod import MANAGED_BY

        try:
            found = await client.NetworkingV1Api(self.api).list_namespaced_network_policy(
                self.namespace, label_selector=f"{MANAGED_BY}=orchard", _request_timeout=API_DEADLINE
            )
        except ApiException as exc:
            if exc.status == 403:
                return warned(f"may not list NetworkPolicies in {self.namespace} ({_k8s_error(exc)}): unknown")
            raise
        if not found.items:
            return warned(
                f"no Orchard NetworkPolicies in {self.namespace}: any pod may reach the executors' port, and "
                "sandboxes have egress",
                f"a cluster admin runs `orchard k8s setup -n {self.namespace}`, on a network plugin that enforces "
                "NetworkPolicy",
            )
        names = ", ".join(p.metadata.name for p in found.items)
        return warned(
            f"{len(found.items)} Orchard NetworkPolicies in {self.namespace} ({names}); whether the network plugin "
            "enforces them cannot be told from the API: unknown",
            "check that the cluster's network plugin enforces NetworkPolicy (Calico, Cilium, kube-router do; "
            "flannel alone does not); tests/k8s/test_k8s_netpol.py shows a proof",
        )

    async def sandbox(self) -> Outcome:
        from ._backends.kubernetes import _IMAGE_REASONS
        from ._client import Client

        def fix(exc: OrchardError) -> str:
            if getattr(exc, "reason", None) not in _IMAGE_REASONS:
                return f"kubectl -n {self.namespace} get events shows why"
            if self.image == TRIAL_IMAGE:
                return f"scripts/docker-setup.sh then hack/devcluster/devcluster up (imports {TRIAL_IMAGE}), or --image"
            return "--image IMAGE for an image the nodes have or can pull"

        spec = {"start_timeout": SANDBOX_DEADLINE["kubernetes"] - 10, "ttl": 300}
        return await _trial(Client(self.config), self.image, spec, fix=fix)


def normalized_image(image: str) -> str:
    """An image reference as a node reports it: ``busybox`` is ``docker.io/library/busybox:latest``."""
    name, at, digest = image.partition("@")
    first, slash, _ = name.partition("/")
    if not slash:
        name = f"docker.io/library/{name}"
    elif "." not in first and ":" not in first and first != "localhost":
        name = f"docker.io/{name}"
    if not at and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return name + at + digest


def _node_images(node: Any) -> set[str]:
    return {normalized_image(name) for image in node.status.images or [] for name in image.names or []}


def _k8s_error(exc: BaseException) -> str:
    """An API call's failure in a few words: the status and message, or why the connection failed."""
    import aiohttp

    from ._backends.kubernetes import _status_message

    status = getattr(exc, "status", None)
    if isinstance(status, int) and hasattr(exc, "body"):
        return f"{status} {getattr(exc, 'reason', '')}: {_status_message(exc.body)}"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, TimeoutError):
        return f"no answer within {API_DEADLINE:g} s"
    return f"{type(exc).__name__}: {exc}"


async def _doctor(args: argparse.Namespace, report: Report) -> None:
    chosen = args.backend or BACKENDS
    image = args.image or TRIAL_IMAGE
    for name in BACKENDS:
        if name not in chosen:
            continue
        checks = Checks(name, report)
        if name == "local":
            await _Local().run(checks)
        elif name == "docker":
            await _Docker(image).run(checks)
        else:
            await _Kubernetes(args, image).run(checks)


def run(args: argparse.Namespace) -> int:
    """Run the checks of ``args.backend`` (all when None); 0 when no check failed, else 1."""
    debug = bool(getattr(args, "debug", False))
    if debug:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    report = Report(as_json=args.json, quiet=bool(getattr(args, "quiet", False)), debug=debug)
    try:
        asyncio.run(_doctor(args, report))
    except KeyboardInterrupt:
        report.finish()
        print("orchard doctor: interrupted", file=sys.stderr)
        return 130
    report.finish()
    return 0 if report.ok else 1
