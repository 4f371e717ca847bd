"""The ``orchard`` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
import traceback
from typing import Any

from . import __version__


def _cluster_options(parser: argparse.ArgumentParser) -> None:
    """Where on which cluster: the namespace, the kubeconfig and its context."""
    parser.add_argument("-n", "--namespace", default="default")
    parser.add_argument("--kubeconfig", default=None)
    parser.add_argument("--context", default=None)


def _common(default: Any) -> argparse.ArgumentParser:
    """--debug and --quiet, taken before the command and after it (``default`` SUPPRESS keeps the first)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=default, help="on an error, show its traceback")
    common.add_argument(
        "-q", "--quiet", action="store_true", default=default, help="print only the results: no progress, no notices"
    )
    return common


def _group(commands: Any, name: str, text: str) -> Any:
    """A command with subcommands of its own (``orchard pool keep``, ``orchard k8s setup``)."""
    return commands.add_parser(name, help=text).add_subparsers(dest=f"{name}_command", required=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orchard", description="Sandboxes for agent rollouts.", parents=[_common(False)]
    )
    parser.add_argument("--version", action="version", version=f"orchard {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    common = [_common(argparse.SUPPRESS)]
    demo = commands.add_parser(
        "demo",
        parents=common,
        help="run a batch of sandboxes, each fixing a failing test, and print latency percentiles",
    )
    demo.add_argument("-n", "--sandboxes", type=int, default=32, help="how many sandboxes (default 32)")
    demo.add_argument(
        "--backend",
        default="local",
        choices=["local", "docker", "kubernetes"],
        help="backend to run on (default: local)",
    )
    demo.add_argument(
        "--image",
        default=None,
        help="task image with python3 on docker and kubernetes (default: orchard-test/swe, which "
        "scripts/docker-setup.sh builds); the local backend has none",
    )
    demo.add_argument("--namespace", default="default", help="kubernetes: the namespace (default: default)")
    demo.add_argument("--kubeconfig", default=None, help="kubernetes: the kubeconfig (default: $KUBECONFIG)")
    demo.add_argument("--context", default=None, help="kubernetes: the kubeconfig's context")
    for name, text in (
        ("ls", "list sandboxes on a cluster backend, with what gc would do to each"),
        ("gc", "delete finished, expired and orphaned sandboxes (by label; no server needed)"),
    ):
        sub = commands.add_parser(name, parents=common, help=text)
        sub.add_argument("--backend", default="kubernetes", choices=["kubernetes", "docker"])
        _cluster_options(sub)
        if name == "gc":
            sub.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
        else:
            sub.add_argument("--json", action="store_true", help="print the sandboxes as a JSON list")
    keep = _group(commands, "pool", "shared warm pools on kubernetes").add_parser(
        "keep",
        parents=common,
        help="keep a pool of started sandboxes that any client with KubernetesConfig(pool=NAME) claims from",
        description="Keep SIZE started, never-used sandbox pods of IMAGE, replacing those claimed, dead or near "
        "their idle timeout, until stopped (SIGINT, SIGTERM: its free pods are then deleted). Any number of keepers "
        "may run: a Lease elects one, and another takes over within --lease-seconds of its last renewal.",
    )
    keep.add_argument("name", help="the pool's name (clients pass it as pool=NAME)")
    keep.add_argument("--image", required=True, help="the sandboxes' image")
    keep.add_argument("--size", type=int, required=True, help="how many free sandboxes to keep")
    keep.add_argument(
        "--spec",
        default="{}",
        metavar="JSON",
        help='the rest of the sandbox spec as JSON, e.g. \'{"cpu": "1", "env": {"A": "b"}}\'; claims must match it',
    )
    keep.add_argument("--max-starting", type=int, default=4, help="pods started at once when refilling (default 4)")
    _cluster_options(keep)
    keep.add_argument("--lease-seconds", type=int, default=15, help="how soon another keeper takes over (default 15)")
    setup = _group(commands, "k8s", "one-time Kubernetes setup").add_parser(
        "setup",
        parents=common,
        help="label the namespace for Pod Security, write the client RBAC Role and the sandbox NetworkPolicies",
        description="Label the namespace for Pod Security admission (enforce --pod-security, warn and audit "
        "'restricted'); write the client Role; write NetworkPolicies that let only clients (pods labelled "
        "orchard.dev/client=true, --client-namespace, --client-cidr; the pod's own node always) reach the "
        "executor port, deny sandboxes all egress, and give network=True sandboxes the internet without "
        "link-local (cloud metadata), the API server and the cluster's pod, service and node addresses. "
        "Policies need a network plugin that enforces them.",
    )
    _cluster_options(setup)
    setup.add_argument("--service-account", default=None, help="also bind the Role to this service account")
    setup.add_argument(
        "--pool",
        action="append",
        default=[],
        metavar="NAME",
        help="a shared pool clients claim from: write its key's Secret and let the Role read it (repeatable)",
    )
    setup.add_argument("--port", type=int, default=8750, help="the executor port sandboxes accept traffic on")
    setup.add_argument(
        "--pod-security",
        default="baseline",
        choices=["privileged", "baseline", "restricted", "none"],
        help="level the namespace enforces (default baseline, which the default pods pass; restricted needs "
        "run_as_user in KubernetesConfig; none leaves the namespace's labels alone)",
    )
    setup.add_argument(
        "--client-cidr", action="append", default=[], metavar="CIDR", help="also admit executor traffic from here"
    )
    setup.add_argument(
        "--client-namespace",
        action="append",
        default=[],
        metavar="NS",
        help="also admit pods labelled orchard.dev/client=true in this namespace",
    )
    setup.add_argument(
        "--cluster-cidr",
        action="append",
        default=[],
        metavar="CIDR",
        help="another range network=True sandboxes may not reach (added to those discovered)",
    )
    setup.add_argument("--allow-metadata", action="store_true", help="let network=True sandboxes reach link-local")
    setup.add_argument(
        "--allow-api-server", action="store_true", help="let network=True sandboxes reach the API server"
    )
    setup.add_argument(
        "--allow-cluster", action="store_true", help="let network=True sandboxes reach pods, services and nodes"
    )
    setup.add_argument("--dry-run", action="store_true", help="print the objects as JSON instead of writing them")
    setup.add_argument("--create-namespace", action="store_true", help="create the namespace if it does not exist")
    doctor = commands.add_parser(
        "doctor",
        parents=common,
        help="check what each backend needs on this machine and cluster, then start a sandbox on each that can",
    )
    doctor.add_argument(
        "--backend",
        action="append",
        choices=["local", "docker", "kubernetes"],
        default=None,
        help="check only this backend (repeatable; default: all three)",
    )
    doctor.add_argument(
        "--image",
        default=None,
        help="image of the trial sandbox on docker and kubernetes (default: the repo's busybox)",
    )
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    _cluster_options(doctor)
    return parser


def _k8s_setup(args: argparse.Namespace) -> int:
    import json

    from ._backends import KubernetesConfig
    from ._backends.kubernetes import setup

    config = KubernetesConfig(
        namespace=args.namespace, kubeconfig=args.kubeconfig, context=args.context, executor_port=args.port
    )
    objects = asyncio.run(
        setup(
            config,
            service_account=args.service_account,
            dry_run=args.dry_run,
            pod_security=None if args.pod_security == "none" else args.pod_security,
            client_cidrs=args.client_cidr,
            client_namespaces=args.client_namespace,
            cluster_cidrs=args.cluster_cidr,
            allow_metadata=args.allow_metadata,
            allow_api_server=args.allow_api_server,
            allow_cluster=args.allow_cluster,
            pools=args.pool,
            create_namespace=args.create_namespace,
        )
    )
    if args.dry_run:
        print(json.dumps(objects, indent=2))
    elif not args.quiet:
        for obj in objects:
            print(f"{obj['kind']}/{obj['metadata']['name']} written in {args.namespace}")
    return 0


def _pool_keep(args: argparse.Namespace) -> int:
    import json
    import logging
    import signal

    from ._backends import KubernetesConfig
    from ._backends.k8s_pool import Keeper
    from ._spec import make_spec
    from .errors import ConfigError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        options = json.loads(args.spec)
        if not isinstance(options, dict):
            raise ConfigError(f"--spec must be a JSON object, not {args.spec!r}")
        config = KubernetesConfig(
            namespace=args.namespace,
            kubeconfig=args.kubeconfig,
            context=args.context,
            lease_seconds=args.lease_seconds,
        )
        keeper = Keeper(config, args.name, make_spec(args.image, options), args.size, max_starting=args.max_starting)
    except (ConfigError, ValueError) as exc:
        print(f"orchard pool keep: {exc}", file=sys.stderr)
        return 2

    async def keep() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        await keeper.run()

    try:
        asyncio.run(keep())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"orchard pool keep: stopped; the free pods of pool {args.name} are deleted", file=sys.stderr)
        return 0
    except ConfigError as exc:
        print(f"orchard pool keep: {exc}", file=sys.stderr)
        return 1
    return 0


def _cluster(args: argparse.Namespace) -> int:
    if args.backend == "docker":
        from ._backends import DockerConfig
        from ._backends.docker import collect_garbage as docker_gc
        from ._backends.docker import list_sandboxes as docker_ls

        docker = DockerConfig()
        rows = asyncio.run(docker_ls(docker)) if args.command == "ls" else []
        deleted = [] if args.command == "ls" else asyncio.run(docker_gc(docker, dry_run=args.dry_run))
    else:
        from ._backends import KubernetesConfig
        from ._backends.kubernetes import collect_garbage, list_sandboxes

        config = KubernetesConfig(namespace=args.namespace, kubeconfig=args.kubeconfig, context=args.context)
        rows = asyncio.run(list_sandboxes(config)) if args.command == "ls" else []
        deleted = [] if args.command == "ls" else asyncio.run(collect_garbage(config, dry_run=args.dry_run))
    if args.command == "ls":
        if args.json:
            import json

            print(json.dumps(rows, indent=2))
        elif args.quiet:
            for row in rows:
                print(row["name"])
        elif rows:
            from ._console import table

            table(rows, list(rows[0]), sys.stdout)
        else:
            where = "on the Docker engine" if args.backend == "docker" else f"in namespace {args.namespace}"
            print(f"no sandboxes {where}", file=sys.stderr)
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    if not args.quiet:
        for name, why in deleted:
            print(f"{verb} {name} ({why})")
    print(f"{verb} {len(deleted)} object(s)")
    return 0


#: What each command asks of the API server, for a refusal's message.
_DOING = {
    "demo": "start sandboxes",
    "ls": "list pods and Leases",
    "gc": "list and delete pods and Leases",
    "k8s": "write its Role, RoleBinding and NetworkPolicies",
    "pool": "keep a pool's pods",
    "doctor": "check",
}


def _name(args: argparse.Namespace) -> str:
    """The command as typed: ``ls``, ``k8s setup``, ``pool keep``."""
    return " ".join(filter(None, [args.command, getattr(args, f"{args.command}_command", None)]))


def explain(exc: BaseException, args: argparse.Namespace) -> str | None:
    """One or two lines saying what failed and what fixes it; None for an error that is a bug (shown whole)."""
    from .errors import OrchardError

    if isinstance(exc, OrchardError):
        return str(exc)
    api = sys.modules.get("kubernetes_asyncio.client.exceptions")
    if api is not None and isinstance(exc, api.ApiException):
        from ._backends.kubernetes import refusal

        typed = refusal(exc, getattr(args, "namespace", "default"), _DOING.get(args.command, "do this"))
        if typed is not exc:
            return str(typed)
        from ._backends.kubernetes import _status_message

        failed: Any = exc
        return f"the Kubernetes API server answered {failed.status} {failed.reason}: {_status_message(failed.body)}"
    import aiohttp

    if isinstance(exc, aiohttp.ClientError | OSError):
        return f"{type(exc).__name__}: {exc}"
    return None


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        from ._demo import run_demo

        if args.sandboxes < 1:
            print("orchard demo: --sandboxes must be at least 1", file=sys.stderr)
            return 2
        try:
            cluster = (
                {"namespace": args.namespace, "kubeconfig": args.kubeconfig, "context": args.context}
                if args.backend == "kubernetes"
                else {}
            )
            rec = asyncio.run(
                run_demo(args.sandboxes, backend=args.backend, image=args.image, quiet=args.quiet, **cluster)
            )
        except KeyboardInterrupt:
            print("\norchard demo: interrupted; every sandbox was deleted", file=sys.stderr)
            return 130
        return 0 if rec.failed == 0 else 1
    if args.command == "k8s":
        return _k8s_setup(args)
    if args.command == "pool":
        return _pool_keep(args)
    if args.command == "doctor":
        from ._doctor import run as run_doctor

        return run_doctor(args)
    return _cluster(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``orchard`` command: 0 done, 1 failed (one or two lines on stderr), 2 bad usage."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        print(f"\norchard {_name(args)}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = explain(exc, args)
        if message is None:
            raise
        if args.debug:
            traceback.print_exception(exc)
        print(f"orchard {_name(args)}: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
